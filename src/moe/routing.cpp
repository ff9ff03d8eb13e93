// Routing compiler: `.route` text -> Routing -> routing.bin bytes and back.
// The format is specified in docs/FORMAT.md. Every input is treated as
// hostile: counts are checked against the input size before anything is
// allocated, and every failure throws colibri::Error with a one-line message
// that starts with the source name (and, for text, the line number).
#include "moe/routing.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <system_error>

#define XXH_STATIC_LINKING_ONLY  // XXH64_state_t on the stack: the header path must not allocate
#include <xxhash.h>

#include "util/error.h"
#include "util/half.h"

namespace colibri {
namespace {

// Longest accepted `.route` line, excluding its line ending. Real lines are a
// few dozen bytes; the cap keeps per-line work bounded on hostile input.
constexpr size_t kMaxLineBytes = 64 * 1024;
constexpr size_t kChecksumOffset = 32;
constexpr uint32_t kMaxU8Experts = 256;
constexpr int32_t kMaxTopK = 65535;  // top_k is a u16 in the header

std::string source_name(std::string_view source, const char* fallback) {
  return source.empty() ? std::string(fallback) : std::string(source);
}

// Text fields are quoted in messages; cap and escape them so that a message
// stays one short line whatever bytes the field holds.
std::string quote(std::string_view field) {
  constexpr size_t kMaxShown = 32;
  std::string out = "'";
  for (size_t i = 0; i < field.size() && i < kMaxShown; ++i) {
    const auto c = static_cast<unsigned char>(field[i]);
    if (c < 0x20 || c >= 0x7f) {
      static const char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  if (field.size() > kMaxShown) out += "...";
  out += "'";
  return out;
}

// ------------------------------------------------------- little-endian bytes

uint16_t load_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t load_u32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}
uint64_t load_u64(const uint8_t* p) {
  return static_cast<uint64_t>(load_u32(p)) | (static_cast<uint64_t>(load_u32(p + 4)) << 32);
}
void store_u16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
void store_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void store_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

// ------------------------------------------------------------ shared checks

// Both the text parser and the payload decoder need "is any expert repeated
// within this token" for k up to 65535, where the quadratic scan would let a
// small hostile input take minutes. A bitmap over expert ids keeps it O(k)
// and fits on the stack (8 KiB), so the decoder stays allocation-free.
class ExpertSet {
 public:
  explicit ExpertSet(int32_t n_experts) {
    std::fill_n(words_, (static_cast<size_t>(n_experts) + 63) / 64, uint64_t{0});
  }
  // Index of the first id equal to an earlier one, or -1. Ids must already be
  // in [0, n_experts). Leaves the set empty again.
  int32_t first_repeat(const int32_t* ids, int32_t k) {
    int32_t j = 0;
    int32_t repeat = -1;
    for (; j < k; ++j) {
      const auto id = static_cast<uint32_t>(ids[j]);
      const uint64_t bit = uint64_t{1} << (id & 63);
      if (words_[id >> 6] & bit) {
        repeat = j;
        break;
      }
      words_[id >> 6] |= bit;
    }
    for (int32_t i = 0; i < j; ++i) words_[static_cast<uint32_t>(ids[i]) >> 6] = 0;
    return repeat;
  }

 private:
  uint64_t words_[kMaxRoutingExperts / 64];
};

int32_t earlier_index(const int32_t* ids, int32_t repeat) {
  int32_t i = 0;
  while (ids[i] != ids[repeat]) ++i;
  return i;
}

// q4 codes and compact bytes must decode to the very same floats.
float q4_weight(uint32_t q) { return static_cast<float>(q) / 15.0f; }

uint64_t id_bytes(IdEncoding e) { return e == IdEncoding::kU16 ? 2 : 1; }
uint64_t weight_bytes(WeightEncoding e) { return e == WeightEncoding::kF32 ? 4 : 2; }

const char* id_encoding_name(IdEncoding e) { return e == IdEncoding::kU16 ? "u16" : "u8"; }
const char* weight_encoding_name(WeightEncoding e) {
  return e == WeightEncoding::kF32 ? "f32" : "f16";
}

// n_tokens <= 2^28 and top_k <= 2^16 keep this below 2^47: no overflow.
uint64_t implied_payload_bytes(uint64_t n_tokens, uint64_t top_k, IdEncoding ids,
                               WeightEncoding weights) {
  if (ids == IdEncoding::kCompact) return n_tokens;
  return n_tokens * top_k * (id_bytes(ids) + weight_bytes(weights));
}

IdEncoding general_id_encoding(int32_t n_experts) {
  return static_cast<uint32_t>(n_experts) <= kMaxU8Experts ? IdEncoding::kU8 : IdEncoding::kU16;
}

// -------------------------------------------------------------- text fields

enum class IntParse { kOk, kNotInteger, kOutOfRange };

IntParse parse_int(std::string_view field, int64_t& value) {
  const char* end = field.data() + field.size();
  const auto [ptr, ec] = std::from_chars(field.data(), end, value);
  if (ec == std::errc::result_out_of_range && ptr == end) return IntParse::kOutOfRange;
  if (ec != std::errc() || ptr != end) return IntParse::kNotInteger;
  return IntParse::kOk;
}

enum class FloatParse { kOk, kNotNumber, kOutOfRange };

FloatParse parse_float(std::string_view field, float& value) {
  const char* end = field.data() + field.size();
  const auto [ptr, ec] = std::from_chars(field.data(), end, value);
  if (ec == std::errc() && ptr == end) return FloatParse::kOk;
  if (ec != std::errc::result_out_of_range || ptr != end) return FloatParse::kNotNumber;
  // Too big or too small for float. Exports of float64 probabilities can hold
  // values like 1e-50, which are 0 as far as float32 weights go; only values
  // too large to represent are errors.
  double wide = 0;
  const auto [wptr, wec] = std::from_chars(field.data(), end, wide);
  if (wec == std::errc() && wptr == end && std::fabs(wide) < 1.0) {
    value = static_cast<float>(wide);  // rounds to a signed zero
    return FloatParse::kOk;
  }
  return FloatParse::kOutOfRange;
}

[[noreturn]] void fail_line(const std::string& src, uint64_t line, const std::string& what) {
  fail(Status::kFormat, src + ":" + std::to_string(line) + ": " + what);
}

std::string column(size_t index0) { return " (column " + std::to_string(index0 + 1) + ")"; }

std::string_view trim(std::string_view s) {
  size_t b = 0;
  size_t e = s.size();
  while (b < e && (s[b] == ' ' || s[b] == '\t')) ++b;
  while (e > b && (s[e - 1] == ' ' || s[e - 1] == '\t')) --e;
  return s.substr(b, e - b);
}

// Rows in file order; placed by token id once the token count is known.
struct TextRows {
  std::vector<int32_t> token;
  std::vector<uint64_t> line;
  std::vector<int32_t> ids;    // [rows][k]
  std::vector<float> weights;  // [rows][k]
};

// Token ids must be exactly 0..T-1 where T is the number of rows. Reports the
// first offending row in file order: a repeat (with the line of the first
// occurrence) or an id >= T (with an id that is consequently missing).
void check_token_ids(const TextRows& rows, const std::string& src) {
  const size_t n = rows.token.size();
  std::vector<int32_t> first_row(n, -1);  // n <= kMaxRoutingTokens fits
  for (size_t r = 0; r < n; ++r) {
    const auto t = static_cast<size_t>(rows.token[r]);
    if (t < n && first_row[t] < 0) first_row[t] = static_cast<int32_t>(r);
  }
  for (size_t r = 0; r < n; ++r) {
    const auto t = static_cast<size_t>(rows.token[r]);
    if (t >= n) {
      // t >= n among n rows means some id below n has no row (pigeonhole).
      size_t missing = 0;
      while (first_row[missing] >= 0) ++missing;
      fail_line(src, rows.line[r],
                "token id " + std::to_string(t) + " out of range [0, " + std::to_string(n) + ") (" +
                    std::to_string(n) + " data lines, so token id " + std::to_string(missing) +
                    " is missing)");
    }
    if (first_row[t] != static_cast<int32_t>(r)) {
      fail_line(src, rows.line[r],
                "token id " + std::to_string(t) + " repeated (first on line " +
                    std::to_string(rows.line[static_cast<size_t>(first_row[t])]) + ")");
    }
  }
}

void check_routing_shape(const Routing& r, const std::string& src) {
  const auto bad = [&](const std::string& what) {
    fail(Status::kInvalidArgument, src + ": " + what);
  };
  if (r.n_experts < 1 || r.n_experts > kMaxRoutingExperts)
    bad("n_experts " + std::to_string(r.n_experts) + " out of range [1, " +
        std::to_string(kMaxRoutingExperts) + "]");
  if (r.top_k < 1 || r.top_k > r.n_experts || r.top_k > kMaxTopK)
    bad("top_k " + std::to_string(r.top_k) + " out of range [1, " +
        std::to_string(std::min(r.n_experts, kMaxTopK)) + "]");
  if (r.n_tokens < 0 || r.n_tokens > kMaxRoutingTokens)
    bad("n_tokens " + std::to_string(r.n_tokens) + " out of range [0, " +
        std::to_string(kMaxRoutingTokens) + "]");
  const uint64_t entries = static_cast<uint64_t>(r.n_tokens) * static_cast<uint64_t>(r.top_k);
  if (r.ids.size() != entries || r.weights.size() != entries)
    bad("ids/weights hold " + std::to_string(r.ids.size()) + "/" +
        std::to_string(r.weights.size()) +
        " entries, expected n_tokens * top_k = " + std::to_string(entries));
  ExpertSet seen(r.n_experts);
  for (int32_t t = 0; t < r.n_tokens; ++t) {
    const int32_t* ids = r.ids.data() + static_cast<size_t>(t) * static_cast<size_t>(r.top_k);
    const float* w = r.weights.data() + static_cast<size_t>(t) * static_cast<size_t>(r.top_k);
    for (int32_t j = 0; j < r.top_k; ++j) {
      if (ids[j] < 0 || ids[j] >= r.n_experts)
        bad("token " + std::to_string(t) + ": expert id " + std::to_string(ids[j]) +
            " out of range [0, " + std::to_string(r.n_experts) + ")");
      if (!std::isfinite(w[j]))
        bad("token " + std::to_string(t) + ": weight " + std::to_string(w[j]) + " is not finite");
    }
    const int32_t repeat = seen.first_repeat(ids, r.top_k);
    if (repeat >= 0)
      bad("token " + std::to_string(t) + ": expert id " + std::to_string(ids[repeat]) +
          " appears twice");
  }
}

}  // namespace

// ================================================================ .route text

Routing parse_route_text(std::string_view text, std::string_view source, int32_t n_experts,
                         bool q4_weights) {
  const std::string src = source_name(source, "<route text>");
  if (n_experts < 1 || n_experts > kMaxRoutingExperts) {
    fail(Status::kInvalidArgument, src + ": n_experts " + std::to_string(n_experts) +
                                           " out of range [1, " +
                                           std::to_string(kMaxRoutingExperts) + "]");
  }

  TextRows rows;
  std::vector<std::string_view> fields;
  size_t columns = 0;  // of the first data line; 0 until then
  uint64_t columns_line = 0;
  int32_t k = 0;
  ExpertSet seen(n_experts);

  size_t pos = 0;
  uint64_t line_no = 0;
  while (pos < text.size()) {
    ++line_no;
    // Look no further than the longest legal line (+ "\r\n"), so a huge line
    // costs one bounded scan rather than a walk to its end.
    const size_t rest = text.size() - pos;
    const size_t window = std::min(rest, kMaxLineBytes + 2);
    const void* nl = std::memchr(text.data() + pos, '\n', window);
    if (nl == nullptr && rest >= kMaxLineBytes + 2)
      fail_line(src, line_no, "line longer than " + std::to_string(kMaxLineBytes) + " bytes");
    const size_t raw_len =
        nl != nullptr ? static_cast<size_t>(static_cast<const char*>(nl) - (text.data() + pos))
                      : rest;
    std::string_view line = text.substr(pos, raw_len);
    pos += raw_len + (nl != nullptr ? 1 : 0);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.size() > kMaxLineBytes)
      fail_line(src, line_no, "line longer than " + std::to_string(kMaxLineBytes) + " bytes");

    // Binary data is rejected outright, comments included: it usually means
    // the wrong file (e.g. a routing.bin) was passed as text.
    for (size_t i = 0; i < line.size(); ++i) {
      const auto c = static_cast<unsigned char>(line[i]);
      if ((c < 0x20 && c != '\t') || c == 0x7f) {
        char hex[8];
        std::snprintf(hex, sizeof hex, "0x%02x", c);
        fail_line(src, line_no,
                  std::string("control character ") + hex + " at column " + std::to_string(i + 1) +
                      " (binary data?)");
      }
    }

    const std::string_view content = trim(line);
    if (content.empty() || content.front() == '#') continue;

    fields.clear();
    for (size_t b = 0;;) {
      const size_t comma = content.find(',', b);
      const size_t e = comma == std::string_view::npos ? content.size() : comma;
      fields.push_back(trim(content.substr(b, e - b)));
      if (fields.back().empty()) fail_line(src, line_no, "empty field" + column(fields.size() - 1));
      if (comma == std::string_view::npos) break;
      b = comma + 1;
    }

    if (columns == 0) {
      if (fields.size() < 3 || fields.size() % 2 == 0)
        fail_line(src, line_no,
                  std::to_string(fields.size()) +
                      " columns; expected token_id, k expert ids, k weights (an odd number >= 3)");
      columns = fields.size();
      columns_line = line_no;
      k = static_cast<int32_t>((columns - 1) / 2);
      if (k > n_experts)
        fail_line(src, line_no,
                  "top-k " + std::to_string(k) + " (from " + std::to_string(columns) +
                      " columns) exceeds n_experts " + std::to_string(n_experts));
    } else if (fields.size() != columns) {
      fail_line(src, line_no,
                std::to_string(fields.size()) + " columns, but line " +
                    std::to_string(columns_line) + " has " + std::to_string(columns));
    }
    if (rows.token.size() >= static_cast<size_t>(kMaxRoutingTokens))
      fail_line(src, line_no, "more than " + std::to_string(kMaxRoutingTokens) + " data lines");

    int64_t token = 0;
    const IntParse token_parse = parse_int(fields[0], token);
    if (token_parse == IntParse::kNotInteger)
      fail_line(src, line_no, "token id " + quote(fields[0]) + " is not an integer");
    if (token < 0 || (token_parse == IntParse::kOutOfRange && fields[0].front() == '-'))
      fail_line(src, line_no, "token id " + std::string(fields[0]) + " is negative");
    if (token_parse == IntParse::kOutOfRange || token >= kMaxRoutingTokens)
      fail_line(src, line_no,
                "token id " + quote(fields[0]) + " too large (at most " +
                    std::to_string(kMaxRoutingTokens) + " tokens)");

    const size_t base = rows.ids.size();
    for (size_t j = 0; j < static_cast<size_t>(k); ++j) {
      const std::string_view f = fields[1 + j];
      int64_t id = 0;
      const IntParse p = parse_int(f, id);
      if (p == IntParse::kNotInteger)
        fail_line(src, line_no, "expert id " + quote(f) + " is not an integer" + column(1 + j));
      if (p == IntParse::kOutOfRange || id < 0 || id >= n_experts)
        fail_line(src, line_no,
                  "expert id " + std::string(f) + " out of range [0, " + std::to_string(n_experts) +
                      ")" + column(1 + j));
      rows.ids.push_back(static_cast<int32_t>(id));
    }
    const int32_t repeat = seen.first_repeat(rows.ids.data() + base, k);
    if (repeat >= 0) {
      const int32_t first = earlier_index(rows.ids.data() + base, repeat);
      fail_line(src, line_no,
                "expert id " + std::to_string(rows.ids[base + static_cast<size_t>(repeat)]) +
                    " repeated (columns " + std::to_string(2 + first) + " and " +
                    std::to_string(2 + repeat) + ")");
    }

    for (size_t j = 0; j < static_cast<size_t>(k); ++j) {
      const size_t index = 1 + static_cast<size_t>(k) + j;
      const std::string_view f = fields[index];
      float w = 0;
      if (q4_weights) {
        int64_t q = 0;
        if (parse_int(f, q) != IntParse::kOk || q < 0 || q > 15)
          fail_line(src, line_no,
                    "weight " + quote(f) + " is not a q4 code (an integer 0..15)" + column(index));
        w = q4_weight(static_cast<uint32_t>(q));
      } else {
        const FloatParse p = parse_float(f, w);
        if (p == FloatParse::kNotNumber)
          fail_line(src, line_no, "weight " + quote(f) + " is not a number" + column(index));
        if (p == FloatParse::kOutOfRange)
          fail_line(src, line_no, "weight " + quote(f) + " out of float32 range" + column(index));
        if (!std::isfinite(w))
          fail_line(src, line_no, "weight " + quote(f) + " is not finite" + column(index));
      }
      rows.weights.push_back(w);
    }
    rows.token.push_back(static_cast<int32_t>(token));
    rows.line.push_back(line_no);
  }

  if (rows.token.empty()) fail(Status::kFormat, src + ": no data lines");
  check_token_ids(rows, src);

  // Every token id is now known to appear exactly once in [0, T).
  Routing out;
  out.n_tokens = static_cast<int32_t>(rows.token.size());
  out.n_experts = n_experts;
  out.top_k = k;
  out.id_encoding = general_id_encoding(n_experts);
  out.weight_encoding = WeightEncoding::kF32;
  const size_t uk = static_cast<size_t>(k);
  out.ids.resize(rows.ids.size());
  out.weights.resize(rows.weights.size());
  for (size_t r = 0; r < rows.token.size(); ++r) {
    const size_t t = static_cast<size_t>(rows.token[r]);
    std::copy_n(rows.ids.begin() + static_cast<std::ptrdiff_t>(r * uk), uk,
                out.ids.begin() + static_cast<std::ptrdiff_t>(t * uk));
    std::copy_n(rows.weights.begin() + static_cast<std::ptrdiff_t>(r * uk), uk,
                out.weights.begin() + static_cast<std::ptrdiff_t>(t * uk));
  }
  return out;
}

// ================================================================ routing.bin

std::vector<uint8_t> encode_routing(const Routing& routing, bool compact,
                                    WeightEncoding general_weights, std::string_view source) {
  const std::string src = source_name(source, "<routing>");
  check_routing_shape(routing, src);

  IdEncoding ids_enc;
  WeightEncoding weights_enc;
  if (compact) {
    if (routing.n_experts > 4 || routing.top_k != 2) {
      fail(Status::kInvalidArgument,
           src + ": compact encoding needs n_experts <= 4 and top_k == 2, but n_experts is " +
               std::to_string(routing.n_experts) + " and top_k is " +
               std::to_string(routing.top_k));
    }
    ids_enc = IdEncoding::kCompact;
    weights_enc = WeightEncoding::kCompactQ4;
  } else {
    if (general_weights != WeightEncoding::kF32 && general_weights != WeightEncoding::kF16) {
      fail(Status::kInvalidArgument, src + ": weight encoding " +
                                             std::to_string(static_cast<int>(general_weights)) +
                                             " is not a general-mode encoding (f32 or f16)");
    }
    ids_enc = general_id_encoding(routing.n_experts);
    weights_enc = general_weights;
  }

  const size_t n_tokens = static_cast<size_t>(routing.n_tokens);
  const size_t entries = routing.ids.size();
  const uint64_t payload =
      implied_payload_bytes(n_tokens, static_cast<uint64_t>(routing.top_k), ids_enc, weights_enc);
  std::vector<uint8_t> out(kRoutingHeaderBytes + static_cast<size_t>(payload));
  uint8_t* h = out.data();
  std::memcpy(h, kRoutingMagic, 4);
  store_u16(h + 4, kRoutingVersion);
  store_u16(h + 6, static_cast<uint16_t>(kRoutingHeaderBytes));
  store_u32(h + 8, static_cast<uint32_t>(routing.n_tokens));
  store_u32(h + 12, static_cast<uint32_t>(routing.n_experts));
  store_u16(h + 16, static_cast<uint16_t>(routing.top_k));
  h[18] = static_cast<uint8_t>(ids_enc);
  h[19] = static_cast<uint8_t>(weights_enc);
  store_u32(h + 20, 0);
  store_u64(h + 24, payload);

  uint8_t* p = h + kRoutingHeaderBytes;
  if (compact) {
    for (size_t t = 0; t < n_tokens; ++t) {
      // Only the first weight is stored; the second decodes as 1 - q/15.
      const double scaled = std::round(static_cast<double>(routing.weights[2 * t]) * 15.0);
      const auto q = static_cast<uint32_t>(std::clamp(scaled, 0.0, 15.0));
      const auto e0 = static_cast<uint32_t>(routing.ids[2 * t]);
      const auto e1 = static_cast<uint32_t>(routing.ids[2 * t + 1]);
      p[t] = static_cast<uint8_t>(e0 | (e1 << 2) | (q << 4));
    }
  } else {
    for (size_t i = 0; i < entries; ++i) {
      const auto id = static_cast<uint16_t>(routing.ids[i]);
      if (ids_enc == IdEncoding::kU8) {
        *p++ = static_cast<uint8_t>(id);
      } else {
        store_u16(p, id);
        p += 2;
      }
    }
    for (size_t i = 0; i < entries; ++i) {
      const float w = routing.weights[i];
      if (weights_enc == WeightEncoding::kF32) {
        store_u32(p, float_bits(w));
        p += 4;
      } else {
        const uint16_t half = float_to_f16(w);
        if (!std::isfinite(f16_to_float(half))) {
          fail(Status::kInvalidArgument,
               src + ": token " + std::to_string(i / static_cast<size_t>(routing.top_k)) +
                   ": weight " + std::to_string(w) + " does not fit in f16 (|w| < 65520)");
        }
        store_u16(p, half);
        p += 2;
      }
    }
  }

  XXH64_state_t state;
  XXH64_reset(&state, 0);
  XXH64_update(&state, h, kChecksumOffset);
  XXH64_update(&state, h + kRoutingHeaderBytes, static_cast<size_t>(payload));
  store_u64(h + kChecksumOffset, XXH64_digest(&state));
  return out;
}

bool has_routing_magic(const void* data, size_t size) {
  return data != nullptr && size >= 4 && std::memcmp(data, kRoutingMagic, 4) == 0;
}

RoutingHeader parse_routing_header(const void* data, size_t size, int32_t model_experts,
                                   std::string_view source) {
  // Messages are built only on failure, so the success path does not allocate.
  const auto err = [&](Status status, const std::string& what) {
    fail(status, source_name(source, "<routing.bin>") + ": " + what);
  };
  if (data == nullptr && size > 0) err(Status::kInvalidArgument, "NULL routing data");
  const auto* b = static_cast<const uint8_t*>(data);

  if (size > 0 && std::memcmp(b, kRoutingMagic, std::min<size_t>(size, 4)) != 0)
    err(Status::kFormat, "not a routing.bin file: bad magic");
  if (size < kRoutingHeaderBytes)
    err(Status::kFormat, "truncated: " + std::to_string(size) + " bytes, shorter than the " +
                                std::to_string(kRoutingHeaderBytes) + "-byte header");
  const uint16_t version = load_u16(b + 4);
  if (version != kRoutingVersion)
    err(Status::kFormat, "unknown version " + std::to_string(version) +
                                " (this build reads version " + std::to_string(kRoutingVersion) +
                                ")");
  const uint16_t header_bytes = load_u16(b + 6);
  if (header_bytes != kRoutingHeaderBytes)
    err(Status::kFormat, "header_bytes " + std::to_string(header_bytes) + ", expected " +
                                std::to_string(kRoutingHeaderBytes));
  const uint64_t payload = load_u64(b + 24);
  const uint64_t available = size - kRoutingHeaderBytes;
  if (payload > available)
    err(Status::kFormat, "truncated: header promises " + std::to_string(payload) +
                                " payload bytes but only " + std::to_string(available) +
                                " follow the header");
  if (payload < available)
    err(Status::kFormat, std::to_string(available - payload) +
                                " unexpected bytes after the payload (payload_bytes " +
                                std::to_string(payload) + ")");

  // Checked before the fields so that random corruption is reported as such.
  XXH64_state_t state;
  XXH64_reset(&state, 0);
  XXH64_update(&state, b, kChecksumOffset);
  XXH64_update(&state, b + kRoutingHeaderBytes, static_cast<size_t>(payload));
  const uint64_t computed = XXH64_digest(&state);
  const uint64_t stored = load_u64(b + kChecksumOffset);
  if (computed != stored) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "checksum mismatch: stored %016llx, computed %016llx",
                  static_cast<unsigned long long>(stored),
                  static_cast<unsigned long long>(computed));
    err(Status::kChecksum, buf);
  }

  const uint32_t n_tokens = load_u32(b + 8);
  const uint32_t n_experts = load_u32(b + 12);
  const uint16_t top_k = load_u16(b + 16);
  const uint8_t id_enc = b[18];
  const uint8_t weight_enc = b[19];
  const uint32_t flags = load_u32(b + 20);
  if (flags != 0) err(Status::kFormat, "flags " + std::to_string(flags) + " must be 0");
  if (n_experts == 0 || n_experts > static_cast<uint32_t>(kMaxRoutingExperts))
    err(Status::kFormat, "n_experts " + std::to_string(n_experts) + " out of range [1, " +
                                std::to_string(kMaxRoutingExperts) + "]");
  if (n_tokens > static_cast<uint64_t>(kMaxRoutingTokens))
    err(Status::kFormat, "n_tokens " + std::to_string(n_tokens) + " exceeds the limit of " +
                                std::to_string(kMaxRoutingTokens));
  if (top_k == 0 || top_k > n_experts)
    err(Status::kFormat, "top_k " + std::to_string(top_k) + " out of range [1, n_experts " +
                                std::to_string(n_experts) + "]");
  if (model_experts > 0 && n_experts > static_cast<uint32_t>(model_experts))
    err(Status::kFormat, "routing is for " + std::to_string(n_experts) +
                                " experts but the model has " + std::to_string(model_experts));
  if (id_enc > static_cast<uint8_t>(IdEncoding::kU16))
    err(Status::kFormat, "unknown id_encoding " + std::to_string(id_enc));
  if (weight_enc > static_cast<uint8_t>(WeightEncoding::kF16))
    err(Status::kFormat, "unknown weight_encoding " + std::to_string(weight_enc));

  RoutingHeader h;
  h.n_tokens = static_cast<int32_t>(n_tokens);
  h.n_experts = static_cast<int32_t>(n_experts);
  h.top_k = top_k;
  h.id_encoding = static_cast<IdEncoding>(id_enc);
  h.weight_encoding = static_cast<WeightEncoding>(weight_enc);
  h.payload_bytes = payload;

  // Each expert count has exactly one general id width, and compact mode is
  // all-or-nothing; anything else is a writer bug, not a variant.
  const bool compact_ids = h.id_encoding == IdEncoding::kCompact;
  const bool compact_weights = h.weight_encoding == WeightEncoding::kCompactQ4;
  if (compact_ids != compact_weights)
    err(Status::kFormat, "id_encoding " + std::to_string(id_enc) + " and weight_encoding " +
                                std::to_string(weight_enc) +
                                " disagree (compact mode needs both 0)");
  if (compact_ids && (n_experts > 4 || top_k != 2))
    err(Status::kFormat, "compact encoding needs n_experts <= 4 and top_k == 2, not " +
                                std::to_string(n_experts) + " and " + std::to_string(top_k));
  if (!compact_ids && h.id_encoding != general_id_encoding(h.n_experts))
    err(Status::kFormat, "id_encoding " + std::to_string(id_enc) + " does not match " +
                                std::to_string(n_experts) + " experts (u8 up to " +
                                std::to_string(kMaxU8Experts) + ", else u16)");
  const uint64_t expected =
      implied_payload_bytes(n_tokens, top_k, h.id_encoding, h.weight_encoding);
  if (payload != expected) {
    err(Status::kFormat,
        "payload_bytes " + std::to_string(payload) + " but " + std::to_string(n_tokens) +
            " tokens x top_k " + std::to_string(top_k) +
            (compact_ids ? std::string(" in compact mode")
                         : std::string(" with ") + id_encoding_name(h.id_encoding) + " ids and " +
                               weight_encoding_name(h.weight_encoding) + " weights") +
            " need " + std::to_string(expected));
  }
  return h;
}

void decode_routing_payload(const RoutingHeader& header, const void* data, int32_t* ids,
                            float* weights, std::string_view source) {
  const auto err = [&](size_t token, const std::string& what) {
    fail(Status::kFormat,
         source_name(source, "<routing.bin>") + ": token " + std::to_string(token) + ": " + what);
  };
  const auto* p = static_cast<const uint8_t*>(data) + kRoutingHeaderBytes;
  const size_t n_tokens = static_cast<size_t>(header.n_tokens);
  const size_t k = static_cast<size_t>(header.top_k);
  const auto n_experts = static_cast<uint32_t>(header.n_experts);

  if (header.id_encoding == IdEncoding::kCompact) {
    for (size_t t = 0; t < n_tokens; ++t) {
      const uint32_t byte = p[t];
      const uint32_t e0 = byte & 3;
      const uint32_t e1 = (byte >> 2) & 3;
      const uint32_t q = byte >> 4;
      if (e0 >= n_experts || e1 >= n_experts)
        err(t, "expert id " + std::to_string(e0 >= n_experts ? e0 : e1) + " out of range [0, " +
                   std::to_string(n_experts) + ")");
      if (e0 == e1) err(t, "expert id " + std::to_string(e0) + " appears twice");
      ids[2 * t] = static_cast<int32_t>(e0);
      ids[2 * t + 1] = static_cast<int32_t>(e1);
      weights[2 * t] = q4_weight(q);
      weights[2 * t + 1] = 1.0f - q4_weight(q);
    }
    return;
  }

  const bool wide_ids = header.id_encoding == IdEncoding::kU16;
  const uint8_t* w = p + n_tokens * k * (wide_ids ? 2 : 1);
  ExpertSet seen(header.n_experts);
  for (size_t t = 0; t < n_tokens; ++t) {
    int32_t* row = ids + t * k;
    for (size_t j = 0; j < k; ++j) {
      const size_t i = t * k + j;
      const uint32_t id = wide_ids ? load_u16(p + 2 * i) : p[i];
      if (id >= n_experts)
        err(t, "expert id " + std::to_string(id) + " out of range [0, " +
                   std::to_string(n_experts) + ")");
      row[j] = static_cast<int32_t>(id);
    }
    const int32_t repeat = seen.first_repeat(row, header.top_k);
    if (repeat >= 0) err(t, "expert id " + std::to_string(row[repeat]) + " appears twice");
    for (size_t j = 0; j < k; ++j) {
      const size_t i = t * k + j;
      const float v = header.weight_encoding == WeightEncoding::kF32
                          ? bits_float(load_u32(w + 4 * i))
                          : f16_to_float(load_u16(w + 2 * i));
      if (!std::isfinite(v)) err(t, "weight in slot " + std::to_string(j) + " is not finite");
      weights[i] = v;
    }
  }
}

Routing decode_routing(const void* data, size_t size, int32_t model_experts,
                       std::string_view source) {
  const RoutingHeader h = parse_routing_header(data, size, model_experts, source);
  Routing r;
  r.n_tokens = h.n_tokens;
  r.n_experts = h.n_experts;
  r.top_k = h.top_k;
  r.id_encoding = h.id_encoding;
  r.weight_encoding = h.weight_encoding;
  // Bounded by the blob: parse_routing_header matched the payload size to
  // n_tokens * top_k entries of at least one byte each (or 1 byte per 2 in
  // compact mode).
  const size_t entries = static_cast<size_t>(h.n_tokens) * static_cast<size_t>(h.top_k);
  r.ids.resize(entries);
  r.weights.resize(entries);
  decode_routing_payload(h, data, r.ids.data(), r.weights.data(), source);
  return r;
}

}  // namespace colibri
