#include "io/gguf.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "util/error.h"

namespace colibri {

namespace {

struct TypeSize {
  const char* name;
  uint32_t block_elements;
  uint32_t block_bytes;
};

// ggml's type table (ggml.h, and the gguf package's GGML_QUANT_SIZES);
// block_elements 0: a value never defined or since removed.
constexpr TypeSize kGgmlTypes[] = {
    {"F32", 1, 4},       {"F16", 1, 2},       {"Q4_0", 32, 18},     {"Q4_1", 32, 20},    {nullptr, 0, 0},
    {nullptr, 0, 0},     {"Q5_0", 32, 22},    {"Q5_1", 32, 24},     {"Q8_0", 32, 34},    {"Q8_1", 32, 40},
    {"Q2_K", 256, 84},   {"Q3_K", 256, 110},  {"Q4_K", 256, 144},   {"Q5_K", 256, 176},  {"Q6_K", 256, 210},
    {"Q8_K", 256, 292},  {"IQ2_XXS", 256, 66}, {"IQ2_XS", 256, 74}, {"IQ3_XXS", 256, 98}, {"IQ1_S", 256, 50},
    {"IQ4_NL", 32, 18},  {"IQ3_S", 256, 110}, {"IQ2_S", 256, 82},   {"IQ4_XS", 256, 136}, {"I8", 1, 1},
    {"I16", 1, 2},       {"I32", 1, 4},       {"I64", 1, 8},        {"F64", 1, 8},       {"IQ1_M", 256, 56},
    {"BF16", 1, 2},      {nullptr, 0, 0},     {nullptr, 0, 0},      {nullptr, 0, 0},     {"TQ1_0", 256, 54},
    {"TQ2_0", 256, 66},  {nullptr, 0, 0},     {nullptr, 0, 0},      {nullptr, 0, 0},     {"MXFP4", 32, 17},
    {"NVFP4", 64, 36},   {"Q1_0", 128, 18},
};
constexpr uint32_t kGgmlTypeCount = sizeof(kGgmlTypes) / sizeof(kGgmlTypes[0]);

// GGML_MAX_NAME: llama.cpp refuses longer tensor names, so no valid file has them.
constexpr size_t kMaxTensorName = 63;
constexpr uint32_t kMaxDims = 4;
// Arrays keep at most this many numbers (per-layer hyperparameters); longer
// ones (token scores) are checked and skipped.
constexpr uint64_t kMaxKeptNumbers = 1u << 16;

bool mul_overflows(uint64_t a, uint64_t b, uint64_t* out) { return __builtin_mul_overflow(a, b, out); }

// Sequential little-endian reads that check every length against the bytes left.
class Cursor {
 public:
  Cursor(const uint8_t* data, uint64_t size, const std::string& source) : data_(data), size_(size), source_(source) {}

  uint64_t pos() const { return pos_; }
  uint64_t left() const { return size_ - pos_; }

  [[noreturn]] void bad(const std::string& what) const {
    fail(Status::kFormat, source_ + ": " + what + " (at byte " + std::to_string(pos_) + ")");
  }

  template <typename T>
  T scalar(const std::string& what) {
    if (left() < sizeof(T)) bad("truncated " + what + ": the file ends");
    T v;
    std::memcpy(&v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  std::string string(const std::string& what, uint64_t max_len) {
    const uint64_t n = scalar<uint64_t>(what + " length");
    if (n > left()) bad(what + " length " + std::to_string(n) + " runs past the end of the file");
    if (n > max_len) bad(what + " is " + std::to_string(n) + " bytes, longer than " + std::to_string(max_len));
    std::string s(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(n));
    pos_ += n;
    return s;
  }

  void skip_string(const std::string& what) {
    const uint64_t n = scalar<uint64_t>(what + " length");
    if (n > left()) bad(what + " length " + std::to_string(n) + " runs past the end of the file");
    pos_ += n;
  }

 private:
  const uint8_t* data_;
  uint64_t size_;
  uint64_t pos_ = 0;
  const std::string& source_;
};

bool valid_type(uint32_t t) { return t <= static_cast<uint32_t>(GgufType::kFloat64); }

uint64_t scalar_bytes(GgufType t) {
  switch (t) {
    case GgufType::kUint8:
    case GgufType::kInt8:
    case GgufType::kBool:
      return 1;
    case GgufType::kUint16:
    case GgufType::kInt16:
      return 2;
    case GgufType::kUint32:
    case GgufType::kInt32:
    case GgufType::kFloat32:
      return 4;
    case GgufType::kUint64:
    case GgufType::kInt64:
    case GgufType::kFloat64:
      return 8;
    case GgufType::kString:
    case GgufType::kArray:
      return 0;
  }
  return 0;
}

// One scalar of type t into v (strings included).
void read_scalar(Cursor& c, GgufType t, const std::string& what, GgufValue* v) {
  auto set_int = [v](int64_t x) {
    v->i = x;
    v->is_negative = x < 0;
    v->u = x < 0 ? 0 : static_cast<uint64_t>(x);
    v->f = static_cast<double>(x);
  };
  switch (t) {
    case GgufType::kUint8:
      set_int(c.scalar<uint8_t>(what));
      return;
    case GgufType::kInt8:
      set_int(c.scalar<int8_t>(what));
      return;
    case GgufType::kUint16:
      set_int(c.scalar<uint16_t>(what));
      return;
    case GgufType::kInt16:
      set_int(c.scalar<int16_t>(what));
      return;
    case GgufType::kUint32:
      set_int(c.scalar<uint32_t>(what));
      return;
    case GgufType::kInt32:
      set_int(c.scalar<int32_t>(what));
      return;
    case GgufType::kUint64: {
      const uint64_t x = c.scalar<uint64_t>(what);
      v->u = x;
      v->i = x > static_cast<uint64_t>(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(x);
      v->f = static_cast<double>(x);
      return;
    }
    case GgufType::kInt64:
      set_int(c.scalar<int64_t>(what));
      return;
    case GgufType::kFloat32:
      v->f = c.scalar<float>(what);
      return;
    case GgufType::kFloat64:
      v->f = c.scalar<double>(what);
      return;
    case GgufType::kBool: {
      const uint8_t b = c.scalar<uint8_t>(what);
      if (b > 1) c.bad(what + " is a bool of value " + std::to_string(b) + ", not 0 or 1");
      set_int(b);
      return;
    }
    case GgufType::kString:
      v->s = c.string(what, c.left());
      return;
    case GgufType::kArray:
      break;
  }
  c.bad(what + " has an array where a scalar belongs");
}

// An array's elements (the type and count already read), nested arrays
// included, `depth` levels deep.
void read_array(Cursor& c, GgufType elem, uint64_t count, const std::string& what, int depth, GgufValue* v) {
  if (depth > 2) c.bad(what + ": arrays nested more than 2 deep");
  const uint64_t each = scalar_bytes(elem);
  if (each != 0) {
    uint64_t total = 0;
    if (mul_overflows(each, count, &total) || total > c.left()) {
      c.bad(what + ": " + std::to_string(count) + " elements of " + gguf_type_name(elem) +
            " run past the end of the file");
    }
    const bool keep = v != nullptr && count <= kMaxKeptNumbers && elem != GgufType::kBool;
    if (keep) v->numbers.reserve(static_cast<size_t>(count));
    for (uint64_t k = 0; k < count; ++k) {
      GgufValue one;
      read_scalar(c, elem, what, &one);
      if (keep) v->numbers.push_back(one.f);
    }
    return;
  }
  if (elem == GgufType::kString) {
    // Every string needs at least its 8-byte length.
    if (count > c.left() / 8) c.bad(what + ": " + std::to_string(count) + " strings cannot fit in the file");
    for (uint64_t k = 0; k < count; ++k) c.skip_string(what + " element");
    return;
  }
  // Nested arrays: each needs at least its type and count.
  if (count > c.left() / 12) c.bad(what + ": " + std::to_string(count) + " arrays cannot fit in the file");
  for (uint64_t k = 0; k < count; ++k) {
    const uint32_t inner = c.scalar<uint32_t>(what + " element type");
    if (!valid_type(inner)) c.bad(what + ": unknown element type " + std::to_string(inner));
    const uint64_t n = c.scalar<uint64_t>(what + " element count");
    read_array(c, static_cast<GgufType>(inner), n, what, depth + 1, nullptr);
  }
}

}  // namespace

const char* gguf_type_name(GgufType t) {
  switch (t) {
    case GgufType::kUint8:
      return "uint8";
    case GgufType::kInt8:
      return "int8";
    case GgufType::kUint16:
      return "uint16";
    case GgufType::kInt16:
      return "int16";
    case GgufType::kUint32:
      return "uint32";
    case GgufType::kInt32:
      return "int32";
    case GgufType::kFloat32:
      return "float32";
    case GgufType::kBool:
      return "bool";
    case GgufType::kString:
      return "string";
    case GgufType::kArray:
      return "array";
    case GgufType::kUint64:
      return "uint64";
    case GgufType::kInt64:
      return "int64";
    case GgufType::kFloat64:
      return "float64";
  }
  return "unknown";
}

bool ggml_type_size(uint32_t type, uint32_t* block_elements, uint32_t* block_bytes) {
  if (type >= kGgmlTypeCount || kGgmlTypes[type].block_elements == 0) return false;
  *block_elements = kGgmlTypes[type].block_elements;
  *block_bytes = kGgmlTypes[type].block_bytes;
  return true;
}

std::string ggml_type_name(uint32_t type) {
  if (type < kGgmlTypeCount && kGgmlTypes[type].name != nullptr) return kGgmlTypes[type].name;
  return "type " + std::to_string(type);
}

bool GgufValue::is_integer() const {
  switch (type) {
    case GgufType::kUint8:
    case GgufType::kInt8:
    case GgufType::kUint16:
    case GgufType::kInt16:
    case GgufType::kUint32:
    case GgufType::kInt32:
    case GgufType::kUint64:
    case GgufType::kInt64:
      return true;
    default:
      return false;
  }
}

GgufFile GgufFile::open(const std::string& path) {
  GgufFile g;
  g.file_ = MappedFile(path);
  g.bytes_ = g.file_.data();
  g.size_ = g.file_.size();
  g.source_ = path;
  g.parse_bytes();
  return g;
}

GgufFile GgufFile::parse(const uint8_t* data, size_t size, const std::string& source) {
  GgufFile g;
  g.bytes_ = data;
  g.size_ = size;
  g.source_ = source;
  g.parse_bytes();
  return g;
}

void GgufFile::parse_bytes() {
  Cursor c(bytes_, size_, source_);
  if (size_ < 4 || std::memcmp(bytes_, "GGUF", 4) != 0) {
    fail(Status::kFormat, source_ + ": not a GGUF file (the first 4 bytes are not \"GGUF\")");
  }
  (void)c.scalar<uint32_t>("magic");
  version_ = c.scalar<uint32_t>("version");
  if (version_ == 1) c.bad("GGUF version 1 (32-bit counts) is not supported; convert the file with a current llama.cpp");
  if (version_ != 2 && version_ != 3) {
    // A big-endian file reads its small version number byte-swapped.
    const bool swapped = (version_ & 0xffffu) == 0 && (version_ >> 24) != 0;
    c.bad(swapped ? "big-endian GGUF files are not supported"
                  : "unknown GGUF version " + std::to_string(version_) + " (2 and 3 are supported)");
  }
  const uint64_t n_tensors = c.scalar<uint64_t>("tensor count");
  const uint64_t n_keys = c.scalar<uint64_t>("key/value count");
  if (n_tensors > kMaxGgufTensors) c.bad("tensor count " + std::to_string(n_tensors) + " is absurd");
  if (n_keys > kMaxGgufKeys) c.bad("key/value count " + std::to_string(n_keys) + " is absurd");
  // Each key needs at least its length and type, each tensor its name
  // length, dimension count, type and offset.
  if (n_keys > c.left() / 12) c.bad(std::to_string(n_keys) + " key/value pairs cannot fit in the file");

  for (uint64_t k = 0; k < n_keys; ++k) {
    const std::string where = "key/value pair " + std::to_string(k);
    std::string key = c.string(where + " key", c.left());
    if (key.empty()) c.bad(where + " has an empty key");
    const std::string what = "key " + key;
    const uint32_t t = c.scalar<uint32_t>(what + " type");
    if (!valid_type(t)) c.bad(what + " has unknown value type " + std::to_string(t));
    GgufValue v;
    v.type = static_cast<GgufType>(t);
    if (v.type == GgufType::kArray) {
      const uint32_t elem = c.scalar<uint32_t>(what + " element type");
      if (!valid_type(elem)) c.bad(what + " has unknown element type " + std::to_string(elem));
      v.element_type = static_cast<GgufType>(elem);
      v.count = c.scalar<uint64_t>(what + " element count");
      read_array(c, v.element_type, v.count, what, 1, &v);
    } else {
      read_scalar(c, v.type, what, &v);
    }
    if (values_.count(key) != 0) c.bad("duplicate " + what);
    key_order_.push_back(key);
    values_.emplace(std::move(key), std::move(v));
  }

  if (const GgufValue* a = find("general.alignment")) {
    if (a->type != GgufType::kUint32) {
      fail(Status::kFormat, source_ + ": key general.alignment is " + gguf_type_name(a->type) + ", not uint32");
    }
    if (a->u == 0 || (a->u & (a->u - 1)) != 0) {
      fail(Status::kFormat,
           source_ + ": key general.alignment is " + std::to_string(a->u) + ", not a power of two");
    }
    alignment_ = a->u;
  }

  if (n_tensors > c.left() / 24) c.bad(std::to_string(n_tensors) + " tensors cannot fit in the file");
  tensors_.reserve(static_cast<size_t>(n_tensors));
  for (uint64_t k = 0; k < n_tensors; ++k) {
    GgufTensor t;
    t.name = c.string("tensor " + std::to_string(k) + " name", c.left());
    if (t.name.empty()) c.bad("tensor " + std::to_string(k) + " has an empty name");
    const std::string what = "tensor " + t.name;
    if (t.name.size() > kMaxTensorName) {
      c.bad(what + ": name is " + std::to_string(t.name.size()) + " bytes, longer than " +
            std::to_string(kMaxTensorName));
    }
    t.n_dims = c.scalar<uint32_t>(what + " dimension count");
    if (t.n_dims == 0 || t.n_dims > kMaxDims) {
      c.bad(what + " has " + std::to_string(t.n_dims) + " dimensions (1 to 4 allowed)");
    }
    uint64_t elements = 1;
    for (uint32_t d = 0; d < t.n_dims; ++d) {
      t.ne[d] = c.scalar<uint64_t>(what + " dimension");
      if (t.ne[d] == 0) c.bad(what + ": dimension " + std::to_string(d) + " is 0");
      if (mul_overflows(elements, t.ne[d], &elements) || elements > (uint64_t{1} << 60)) {
        c.bad(what + ": dimensions multiply past 2^60 elements");
      }
    }
    t.type = c.scalar<uint32_t>(what + " type");
    uint32_t block = 0, block_bytes = 0;
    if (!ggml_type_size(t.type, &block, &block_bytes)) {
      c.bad(what + " has unknown tensor type " + std::to_string(t.type));
    }
    if (t.ne[0] % block != 0) {
      c.bad(what + ": its rows of " + std::to_string(t.ne[0]) + " elements are not whole " + ggml_type_name(t.type) +
            " blocks of " + std::to_string(block));
    }
    t.bytes = elements / block * block_bytes;  // elements < 2^60, block_bytes < 2^9: no overflow
    t.offset = c.scalar<uint64_t>(what + " offset");
    if (t.offset % alignment_ != 0) {
      c.bad(what + ": data offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
            std::to_string(alignment_));
    }
    if (tensor_index_.count(t.name) != 0) c.bad("duplicate " + what);
    tensor_index_.emplace(t.name, tensors_.size());
    tensors_.push_back(std::move(t));
  }

  // The data section starts at the next multiple of the alignment.
  const uint64_t end_of_table = c.pos();
  data_offset_ = (end_of_table + alignment_ - 1) / alignment_ * alignment_;
  if (data_offset_ < end_of_table) c.bad("data section offset overflows");
  if (!tensors_.empty() && data_offset_ > size_) c.bad("the file ends before its data section");
  std::vector<size_t> by_offset(tensors_.size());
  for (size_t k = 0; k < tensors_.size(); ++k) {
    GgufTensor& t = tensors_[k];
    const uint64_t room = size_ - data_offset_;
    if (t.offset > room || t.bytes > room - t.offset) {
      fail(Status::kFormat, source_ + ": tensor " + t.name + ": data [" + std::to_string(t.offset) + ", +" +
                                std::to_string(t.bytes) + ") lies outside the file's data section of " +
                                std::to_string(room) + " bytes");
    }
    t.offset += data_offset_;
    by_offset[k] = k;
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [&](size_t a, size_t b) { return tensors_[a].offset < tensors_[b].offset; });
  for (size_t k = 1; k < by_offset.size(); ++k) {
    const GgufTensor& prev = tensors_[by_offset[k - 1]];
    const GgufTensor& next = tensors_[by_offset[k]];
    if (prev.offset + prev.bytes > next.offset) {
      fail(Status::kFormat, source_ + ": tensors " + prev.name + " and " + next.name + " overlap");
    }
  }
}

const GgufValue* GgufFile::find(const std::string& key) const {
  const auto it = values_.find(key);
  return it == values_.end() ? nullptr : &it->second;
}

const GgufTensor* GgufFile::tensor(const std::string& name) const {
  const auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

bool GgufFile::get_string(const std::string& key, std::string* out) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return false;
  if (v->type != GgufType::kString) {
    fail(Status::kFormat, source_ + ": key " + key + " is " + gguf_type_name(v->type) + ", expected a string");
  }
  *out = v->s;
  return true;
}

bool GgufFile::get_uint(const std::string& key, uint64_t* out) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return false;
  if (!v->is_integer() || v->is_negative) {
    fail(Status::kFormat, source_ + ": key " + key + " is " +
                              (v->is_integer() ? "negative" : std::string(gguf_type_name(v->type))) +
                              ", expected a non-negative integer");
  }
  *out = v->u;
  return true;
}

bool GgufFile::get_float(const std::string& key, double* out) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return false;
  if (!v->is_number()) {
    fail(Status::kFormat, source_ + ": key " + key + " is " + gguf_type_name(v->type) + ", expected a number");
  }
  *out = v->f;
  return true;
}

bool GgufFile::get_bool(const std::string& key, bool* out) const {
  const GgufValue* v = find(key);
  if (v == nullptr) return false;
  if (v->type != GgufType::kBool && !(v->is_integer() && v->u <= 1 && !v->is_negative)) {
    fail(Status::kFormat, source_ + ": key " + key + " is " + gguf_type_name(v->type) + ", expected a bool");
  }
  *out = v->u != 0;
  return true;
}

}  // namespace colibri
