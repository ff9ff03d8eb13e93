#include "lib/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "io/mapped_file.h"
#include "util/error.h"
#include "util/half.h"

namespace colibri {

using nlohmann::json;

namespace {

struct DtypeEntry {
  const char* name;
  StDtype dtype;
  size_t size;
};

// The dtypes the format defines. Only F32/F16/BF16 can be converted, but the
// others are valid in a checkpoint (e.g. integer buffers, FP8 weights) and
// must still be parsed so the file's offsets can be checked.
constexpr DtypeEntry kDtypes[] = {
    {"F64", StDtype::kF64, 8},       {"F32", StDtype::kF32, 4},     {"F16", StDtype::kF16, 2},
    {"BF16", StDtype::kBF16, 2},     {"I64", StDtype::kI64, 8},     {"I32", StDtype::kI32, 4},
    {"I16", StDtype::kI16, 2},       {"I8", StDtype::kI8, 1},       {"U64", StDtype::kU64, 8},
    {"U32", StDtype::kU32, 4},       {"U16", StDtype::kU16, 2},     {"U8", StDtype::kU8, 1},
    {"BOOL", StDtype::kBool, 1},     {"F8_E4M3", StDtype::kF8E4M3, 1},
    {"F8_E5M2", StDtype::kF8E5M2, 1}, {"F8_E8M0", StDtype::kF8E8M0, 1},
};

uint64_t load_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = v << 8 | p[i];
  return v;
}

[[noreturn]] void bad_tensor(const std::string& source, const std::string& name, const std::string& what) {
  fail(Status::kFormat, source + ": tensor \"" + name + "\": " + what);
}

// A JSON value as a non-negative integer. Numbers beyond uint64 are parsed
// by nlohmann as floating point, so they land in the error branch too.
bool as_u64(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}

// Short, bounded rendering of a JSON value for messages: a hostile header
// may hold megabytes in one value.
std::string brief(const json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

}  // namespace

bool parse_st_dtype(const std::string& name, StDtype* out) {
  for (const DtypeEntry& e : kDtypes) {
    if (name == e.name) {
      *out = e.dtype;
      return true;
    }
  }
  return false;
}

const char* st_dtype_name(StDtype dtype) {
  for (const DtypeEntry& e : kDtypes) {
    if (e.dtype == dtype) return e.name;
  }
  return "?";
}

size_t st_dtype_size(StDtype dtype) {
  for (const DtypeEntry& e : kDtypes) {
    if (e.dtype == dtype) return e.size;
  }
  return 0;
}

StHeader parse_safetensors(const uint8_t* data, size_t size, const std::string& source) {
  return parse_safetensors(data, size, size, source);
}

StHeader parse_safetensors(const uint8_t* data, size_t size, size_t available, const std::string& source) {
  if (size < 8) {
    fail(Status::kFormat, source + ": not a safetensors file: " + std::to_string(size) +
                                 " bytes, too short for the 8-byte header length");
  }
  const uint64_t header_len = load_le64(data);
  if (header_len > kMaxSafetensorsHeaderBytes) {
    fail(Status::kFormat, source + ": header length " + std::to_string(header_len) +
                                 " exceeds the limit of " + std::to_string(kMaxSafetensorsHeaderBytes) +
                                 " bytes (not a safetensors file?)");
  }
  if (header_len > size - 8) {
    fail(Status::kFormat, source + ": header length " + std::to_string(header_len) +
                                 " runs past the end of the file (" + std::to_string(size) +
                                 " bytes; truncated?)");
  }
  if (available < 8 + header_len) {
    fail(Status::kFormat, source + ": header (" + std::to_string(header_len) + " bytes) could not be read whole");
  }
  StHeader h;
  h.data_start = 8 + header_len;
  const uint64_t data_bytes = size - h.data_start;

  // The DOM keeps only the last of repeated keys; the callback sees them
  // all, so a tensor named twice (two readers, two answers) is caught.
  std::set<std::string> seen;
  std::string repeated;
  const json::parser_callback_t on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 && repeated.empty()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!seen.insert(key).second) repeated = key;
    }
    return true;
  };
  const char* text = reinterpret_cast<const char*>(data + 8);
  // nlohmann stops at a NUL as if the input ended there, which would accept
  // "{...}\0<anything>". Valid JSON never holds a raw NUL.
  if (const void* nul = std::memchr(text, 0, header_len)) {
    fail(Status::kFormat, source + ": header is not valid JSON: NUL byte at header offset " +
                                 std::to_string(static_cast<const char*>(nul) - text));
  }
  json doc;
  try {
    doc = json::parse(text, text + header_len, on_event);
  } catch (const json::exception& e) {
    fail(Status::kFormat, source + ": header is not valid JSON: " + e.what());
  }
  if (!doc.is_object()) {
    fail(Status::kFormat, source + ": header must be a JSON object, not " + std::string(doc.type_name()));
  }
  if (!repeated.empty()) bad_tensor(source, repeated, "named more than once in the header");

  for (const auto& [name, entry] : doc.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) fail(Status::kFormat, source + ": \"__metadata__\" must be an object");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) {
          fail(Status::kFormat, source + ": \"__metadata__\".\"" + key + "\" must be a string");
        }
      }
      continue;
    }
    if (!entry.is_object()) bad_tensor(source, name, "entry must be an object");
    StTensor t;
    t.name = name;

    const auto dtype = entry.find("dtype");
    if (dtype == entry.end()) bad_tensor(source, name, "missing \"dtype\"");
    if (!dtype->is_string() || !parse_st_dtype(dtype->get<std::string>(), &t.dtype)) {
      bad_tensor(source, name, "unknown dtype " + brief(*dtype));
    }

    const auto shape = entry.find("shape");
    if (shape == entry.end()) bad_tensor(source, name, "missing \"shape\"");
    if (!shape->is_array()) bad_tensor(source, name, "\"shape\" must be an array");
    // Overflow is checked on the product of the non-zero dimensions: a zero
    // elsewhere does not make a shape like [0, 2^40, 2^40] sensible.
    uint64_t product = 1;
    bool has_zero = false;
    for (const json& dim : *shape) {
      uint64_t d = 0;
      if (!as_u64(dim, &d)) {
        bad_tensor(source, name, "shape dimension " + brief(dim) + " is not a non-negative integer");
      }
      t.shape.push_back(d);
      if (d == 0) has_zero = true;
      else if (__builtin_mul_overflow(product, d, &product)) {
        bad_tensor(source, name, "shape " + brief(*shape) + " overflows 64 bits");
      }
    }
    t.n_elements = has_zero ? 0 : product;

    const auto offsets = entry.find("data_offsets");
    if (offsets == entry.end()) bad_tensor(source, name, "missing \"data_offsets\"");
    uint64_t begin = 0, end = 0;
    if (!offsets->is_array() || offsets->size() != 2 || !as_u64((*offsets)[0], &begin) ||
        !as_u64((*offsets)[1], &end)) {
      bad_tensor(source, name, "\"data_offsets\" must be two non-negative integers, not " + brief(*offsets));
    }
    if (end < begin) {
      bad_tensor(source, name, "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                                   "] end before begin");
    }
    if (end > data_bytes) {
      bad_tensor(source, name, "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                                   "] run past the end of the file (" + std::to_string(data_bytes) +
                                   " data bytes; truncated?)");
    }
    uint64_t expected = 0;
    const bool overflow = __builtin_mul_overflow(t.n_elements, st_dtype_size(t.dtype), &expected);
    if (overflow || expected != end - begin) {
      bad_tensor(source, name, "data_offsets give " + std::to_string(end - begin) + " bytes, but shape " +
                                   brief(*shape) + " of " + st_dtype_name(t.dtype) + " needs " +
                                   (overflow ? std::string("more than 2^64") : std::to_string(expected)));
    }
    t.offset = h.data_start + begin;
    t.n_bytes = end - begin;
    h.tensors.push_back(std::move(t));
  }

  // Overlap check: by start offset, each tensor must begin at or after the
  // furthest end seen so far.
  std::vector<const StTensor*> by_offset;
  by_offset.reserve(h.tensors.size());
  for (const StTensor& t : h.tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const StTensor* a, const StTensor* b) {
    return a->offset != b->offset ? a->offset < b->offset : a->n_bytes < b->n_bytes;
  });
  const StTensor* furthest = nullptr;
  for (const StTensor* t : by_offset) {
    if (furthest != nullptr && t->offset < furthest->offset + furthest->n_bytes) {
      bad_tensor(source, t->name, "data overlaps tensor \"" + furthest->name + "\"");
    }
    if (furthest == nullptr || t->offset + t->n_bytes > furthest->offset + furthest->n_bytes) furthest = t;
  }
  return h;
}

void st_to_floats(StDtype dtype, const uint8_t* src, size_t count, float* out) {
  switch (dtype) {
    case StDtype::kF32:
      for (size_t i = 0; i < count; ++i) {
        const uint8_t* p = src + 4 * i;
        out[i] = bits_float(static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
                            static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24);
      }
      return;
    case StDtype::kF16:
      for (size_t i = 0; i < count; ++i) {
        out[i] = f16_to_float(static_cast<uint16_t>(src[2 * i] | src[2 * i + 1] << 8));
      }
      return;
    case StDtype::kBF16:
      for (size_t i = 0; i < count; ++i) {
        out[i] = bf16_to_float(static_cast<uint16_t>(src[2 * i] | src[2 * i + 1] << 8));
      }
      return;
    default:
      fail(Status::kFormat, std::string("cannot convert ") + st_dtype_name(dtype) + " to float32");
  }
}

namespace {

// Exactly n bytes at offset; a short read means the file shrank after it
// was checked: an error naming it, never SIGBUS as a mapping would give.
void pread_exact(int fd, const std::string& path, uint64_t offset, size_t n, uint8_t* out) {
  if (read_at(fd, path, offset, out, n) != n) {
    fail(Status::kFormat, path + ": file shrank while being read (truncated by someone else?)");
  }
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  fd_ = open_regular_file(path, &size_);
  try {
    // Only the header is read here: the length word, then as much of the
    // JSON as the parser will look at (it refuses lengths beyond the file
    // or the header limit before reading the text).
    std::vector<uint8_t> head(static_cast<size_t>(std::min<uint64_t>(size_, 8)));
    pread_exact(fd_, path, 0, head.size(), head.data());
    if (head.size() == 8) {
      uint64_t n = 0;
      for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(head[i]) << (8 * i);
      n = std::min({n, size_ - 8, kMaxSafetensorsHeaderBytes});
      head.resize(8 + static_cast<size_t>(n));
      pread_exact(fd_, path, 8, static_cast<size_t>(n), head.data() + 8);
    }
    header_ = parse_safetensors(head.data(), static_cast<size_t>(size_), head.size(), path);
  } catch (...) {
    ::close(fd_);
    throw;
  }
  index_.reserve(header_.tensors.size());
  for (size_t i = 0; i < header_.tensors.size(); ++i) index_.emplace(header_.tensors[i].name, i);
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

const StTensor* SafetensorsFile::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

void SafetensorsFile::read_floats(const StTensor& t, uint64_t first, uint64_t count, float* out) const {
  if (t.dtype != StDtype::kF32 && t.dtype != StDtype::kF16 && t.dtype != StDtype::kBF16) {
    fail(Status::kFormat, path() + ": tensor \"" + t.name + "\": dtype " + st_dtype_name(t.dtype) +
                                 " cannot be converted (expected BF16, F16 or F32)");
  }
  if (first > t.n_elements || count > t.n_elements - first) {
    fail(Status::kInternal, path() + ": tensor \"" + t.name + "\": read of elements [" +
                                   std::to_string(first) + ", +" + std::to_string(count) + ") out of range");
  }
  const size_t esize = st_dtype_size(t.dtype);
  // Read (not mapped) in slices, so neither a huge tensor nor a file cut
  // short while we convert can hurt: memory stays at one slice, and a short
  // read is an error.
  constexpr uint64_t kSliceElements = uint64_t{1} << 20;
  std::vector<uint8_t> raw;
  for (uint64_t done = 0; done < count;) {
    const uint64_t n = std::min(kSliceElements, count - done);
    raw.resize(static_cast<size_t>(n * esize));
    pread_exact(fd_, path_, t.offset + (first + done) * esize, raw.size(), raw.data());
    st_to_floats(t.dtype, raw.data(), static_cast<size_t>(n), out + done);
    done += n;
  }
}

void SafetensorsFile::read_u8(const StTensor& t, uint64_t first, uint64_t count, uint8_t* out) const {
  if (t.dtype != StDtype::kU8 && t.dtype != StDtype::kF8E4M3) {
    fail(Status::kFormat, path() + ": tensor \"" + t.name + "\": dtype " + st_dtype_name(t.dtype) + ", expected U8 or F8_E4M3");
  }
  if (first > t.n_elements || count > t.n_elements - first) {
    fail(Status::kInternal, path() + ": tensor \"" + t.name + "\": read of bytes [" + std::to_string(first) + ", +" +
                                   std::to_string(count) + ") out of range");
  }
  pread_exact(fd_, path_, t.offset + first, static_cast<size_t>(count), out);
}

}  // namespace colibri
