// The C ABI boundary: argument checks, exception-to-status translation and
// the thread-local error/warning strings. Nothing below this file knows
// about C handles; nothing above it sees a C++ exception.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <new>
#include <string>

#include "colibri.h"
#include "api/desc.h"
#include "io/manifest.h"
#include "io/mapped_file.h"
#include "io/verify.h"
#include "kernels/kernels.h"
#include "moe/attention.h"
#include "moe/doctor.h"
#include "moe/linear.h"
#include "moe/model.h"
#include "moe/rms_norm.h"
#include "moe/rope.h"
#include "moe/routing.h"
#include "runtime/memory.h"
#include "runtime/thread_pool.h"
#include "util/c_enum.h"
#include "util/error.h"

struct colibri_model {
  colibri::Model impl;
  colibri_model(const std::string& dir, const colibri_open_options_t& o, std::string* warnings)
      : impl(dir, colibri::api::open_options(o), warnings) {}
  colibri_model(const colibri::api::MemoryModel& memory, const colibri_open_options_t& o, std::string* warnings)
      : impl(memory.manifest, memory.layers, colibri::api::open_options(o), warnings, memory.fetch) {}
};

struct colibri_linear {
  colibri::Linear impl;
};

struct colibri_routing {
  colibri::Routing impl;
};

namespace {

// A per-thread message. A plain char array on purpose: a thread_local with
// a destructor (std::string) makes glibc allocate on a thread's first call
// to register that destructor, and abort the process if the allocation
// fails, which a call under memory exhaustion must not do.
struct ThreadMessage {
  static constexpr size_t kBytes = 4096;
  char text[kBytes];

  void clear() { text[0] = '\0'; }
  const char* c_str() const { return text; }
  // The concatenation of the pieces; longer messages are cut short,
  // ending in "...". Never allocates.
  void set(std::initializer_list<const char*> pieces) {
    size_t used = 0;
    for (const char* piece : pieces) {
      for (; *piece != '\0'; ++piece) {
        if (used == kBytes - 1) {
          std::memcpy(text + kBytes - 4, "...", 4);
          return;
        }
        text[used++] = *piece;
      }
    }
    text[used] = '\0';
  }
  void set(const std::string& message) { set({message.c_str()}); }
};

thread_local ThreadMessage t_last_error;
thread_local ThreadMessage t_last_warning;

colibri_status_t set_error(colibri_status_t status, const std::string& message) {
  t_last_error.set(message);
  return status;
}

// Without building a std::string: for the error paths that may run out of
// memory themselves.
colibri_status_t set_error(colibri_status_t status, std::initializer_list<const char*> pieces) {
  t_last_error.set(pieces);
  return status;
}

// The internal status is the C ABI's, value for value.
colibri_status_t to_c_status(colibri::Status s) { return static_cast<colibri_status_t>(static_cast<int>(s)); }
static_assert(static_cast<int>(colibri::Status::kOk) == COLIBRI_OK);
static_assert(static_cast<int>(colibri::Status::kInvalidArgument) == COLIBRI_ERR_INVALID_ARGUMENT);
static_assert(static_cast<int>(colibri::Status::kIo) == COLIBRI_ERR_IO);
static_assert(static_cast<int>(colibri::Status::kFormat) == COLIBRI_ERR_FORMAT);
static_assert(static_cast<int>(colibri::Status::kChecksum) == COLIBRI_ERR_CHECKSUM);
static_assert(static_cast<int>(colibri::Status::kOutOfMemory) == COLIBRI_ERR_OUT_OF_MEMORY);
static_assert(static_cast<int>(colibri::Status::kUnsupported) == COLIBRI_ERR_UNSUPPORTED);
static_assert(static_cast<int>(colibri::Status::kInternal) == COLIBRI_ERR_INTERNAL);
static_assert(static_cast<int>(colibri::Status::kCancelled) == COLIBRI_ERR_CANCELLED);

colibri_huge_page_kind_t to_c_huge_pages(colibri::HugePageKind k) {
  switch (k) {
    case colibri::HugePageKind::kHugetlbfs: return COLIBRI_HUGE_PAGES_HUGETLBFS;
    case colibri::HugePageKind::kTransparent: return COLIBRI_HUGE_PAGES_TRANSPARENT;
    case colibri::HugePageKind::kNone: break;
  }
  return COLIBRI_HUGE_PAGES_NONE;
}

// colibri_dtype_t's values are WeightType's; callers check the range first
// (known_dtype).
colibri::WeightType to_weight_type(colibri_dtype_t d) { return static_cast<colibri::WeightType>(colibri::raw_enum(d)); }
colibri_dtype_t to_c_dtype(colibri::WeightType t) { return static_cast<colibri_dtype_t>(static_cast<int>(t)); }
static_assert(COLIBRI_DTYPE_F32 == static_cast<int>(colibri::WeightType::kF32) &&
              COLIBRI_DTYPE_F16 == static_cast<int>(colibri::WeightType::kF16) &&
              COLIBRI_DTYPE_BF16 == static_cast<int>(colibri::WeightType::kBF16) &&
              COLIBRI_DTYPE_Q8_0 == static_cast<int>(colibri::WeightType::kQ8_0) &&
              COLIBRI_DTYPE_Q4_0 == static_cast<int>(colibri::WeightType::kQ4_0) &&
              COLIBRI_DTYPE_Q4_K == static_cast<int>(colibri::WeightType::kQ4_K) &&
              COLIBRI_DTYPE_Q5_K == static_cast<int>(colibri::WeightType::kQ5_K) &&
              COLIBRI_DTYPE_Q6_K == static_cast<int>(colibri::WeightType::kQ6_K) &&
              COLIBRI_DTYPE_MXFP4 == static_cast<int>(colibri::WeightType::kMXFP4) &&
              COLIBRI_DTYPE_Q4_1 == static_cast<int>(colibri::WeightType::kQ4_1) &&
              COLIBRI_DTYPE_Q5_0 == static_cast<int>(colibri::WeightType::kQ5_0) &&
              COLIBRI_DTYPE_Q5_1 == static_cast<int>(colibri::WeightType::kQ5_1) &&
              COLIBRI_DTYPE_IQ4_NL == static_cast<int>(colibri::WeightType::kIQ4_NL) &&
              COLIBRI_DTYPE_IQ4_XS == static_cast<int>(colibri::WeightType::kIQ4_XS) &&
              COLIBRI_DTYPE_Q2_K == static_cast<int>(colibri::WeightType::kQ2_K) &&
              COLIBRI_DTYPE_Q3_K == static_cast<int>(colibri::WeightType::kQ3_K) &&
              COLIBRI_DTYPE_IQ2_XXS == static_cast<int>(colibri::WeightType::kIQ2_XXS) &&
              COLIBRI_DTYPE_IQ3_XXS == static_cast<int>(colibri::WeightType::kIQ3_XXS) &&
              COLIBRI_DTYPE_IQ1_S == static_cast<int>(colibri::WeightType::kIQ1_S) &&
              COLIBRI_DTYPE_IQ1_M == static_cast<int>(colibri::WeightType::kIQ1_M) &&
              COLIBRI_DTYPE_IQ2_XS == static_cast<int>(colibri::WeightType::kIQ2_XS) &&
              COLIBRI_DTYPE_IQ2_S == static_cast<int>(colibri::WeightType::kIQ2_S) &&
              COLIBRI_DTYPE_IQ3_S == static_cast<int>(colibri::WeightType::kIQ3_S) &&
              COLIBRI_DTYPE_FP8_E4M3 == static_cast<int>(colibri::WeightType::kFP8_E4M3) &&
              COLIBRI_DTYPE_TQ1_0 == static_cast<int>(colibri::WeightType::kTQ1_0) &&
              COLIBRI_DTYPE_TQ2_0 == static_cast<int>(colibri::WeightType::kTQ2_0) &&
              colibri::kWeightTypeCount == COLIBRI_DTYPE_TQ2_0 + 1);
static_assert(COLIBRI_ROUTER_GPT_OSS == colibri::kLastRouterFamily &&
              COLIBRI_ROUTER_DEEPSEEK_V3 == static_cast<int>(colibri::RouterFamily::kDeepseekV3) &&
              COLIBRI_ROUTER_MIXTRAL == static_cast<int>(colibri::RouterFamily::kMixtral) &&
              COLIBRI_ROUTER_QWEN2_MOE == static_cast<int>(colibri::RouterFamily::kQwen2Moe) &&
              COLIBRI_ROUTER_QWEN3_MOE == static_cast<int>(colibri::RouterFamily::kQwen3Moe) &&
              COLIBRI_ROUTER_OLMOE == static_cast<int>(colibri::RouterFamily::kOlmoe) &&
              COLIBRI_ROUTER_DEEPSEEK_V2 == static_cast<int>(colibri::RouterFamily::kDeepseekV2));

// Runs body; maps every exception to a status and message. body returns a
// status itself for the rare non-throwing failure.
template <typename Body>
colibri_status_t guarded(const char* function, Body&& body) {
  try {
    t_last_error.clear();
    return body();
  } catch (const colibri::Error& e) {
    return set_error(to_c_status(e.status()), {e.what()});
  } catch (const std::bad_alloc&) {
    return set_error(COLIBRI_ERR_OUT_OF_MEMORY, {function, ": out of memory"});
  } catch (const std::exception& e) {
    return set_error(COLIBRI_ERR_INTERNAL, {function, ": ", e.what()});
  } catch (...) {
    return set_error(COLIBRI_ERR_INTERNAL, {function, ": unknown error"});
  }
}

colibri_status_t null_argument(const char* function, const char* name) {
  return set_error(COLIBRI_ERR_INVALID_ARGUMENT, {function, ": ", name, " is NULL"});
}

constexpr size_t kMaxRouteTextBytes = size_t{1} << 32;  // 4 GiB

}  // namespace

extern "C" {

const char* colibri_last_error(void) { return t_last_error.c_str(); }
const char* colibri_last_warning(void) { return t_last_warning.c_str(); }

const char* colibri_status_name(colibri_status_t status) {
  switch (status) {
    case COLIBRI_OK: return "ok";
    case COLIBRI_ERR_INVALID_ARGUMENT: return "invalid argument";
    case COLIBRI_ERR_IO: return "I/O error";
    case COLIBRI_ERR_FORMAT: return "format error";
    case COLIBRI_ERR_CHECKSUM: return "checksum mismatch";
    case COLIBRI_ERR_OUT_OF_MEMORY: return "out of memory";
    case COLIBRI_ERR_UNSUPPORTED: return "unsupported";
    case COLIBRI_ERR_INTERNAL: return "internal error";
    case COLIBRI_ERR_CANCELLED: return "cancelled";
  }
  return "unknown status";
}

const char* colibri_dtype_name(colibri_dtype_t dtype) {
  switch (dtype) {
    case COLIBRI_DTYPE_F32: return "f32";
    case COLIBRI_DTYPE_F16: return "f16";
    case COLIBRI_DTYPE_BF16: return "bf16";
    case COLIBRI_DTYPE_Q8_0: return "q8_0";
    case COLIBRI_DTYPE_Q4_0: return "q4_0";
    case COLIBRI_DTYPE_Q4_K: return "q4_k";
    case COLIBRI_DTYPE_Q5_K: return "q5_k";
    case COLIBRI_DTYPE_Q6_K: return "q6_k";
    case COLIBRI_DTYPE_MXFP4: return "mxfp4";
    case COLIBRI_DTYPE_Q4_1: return "q4_1";
    case COLIBRI_DTYPE_Q5_0: return "q5_0";
    case COLIBRI_DTYPE_Q5_1: return "q5_1";
    case COLIBRI_DTYPE_IQ4_NL: return "iq4_nl";
    case COLIBRI_DTYPE_IQ4_XS: return "iq4_xs";
    case COLIBRI_DTYPE_Q2_K: return "q2_k";
    case COLIBRI_DTYPE_Q3_K: return "q3_k";
    case COLIBRI_DTYPE_IQ2_XXS: return "iq2_xxs";
    case COLIBRI_DTYPE_IQ3_XXS: return "iq3_xxs";
    case COLIBRI_DTYPE_IQ1_S: return "iq1_s";
    case COLIBRI_DTYPE_IQ1_M: return "iq1_m";
    case COLIBRI_DTYPE_IQ2_XS: return "iq2_xs";
    case COLIBRI_DTYPE_IQ2_S: return "iq2_s";
    case COLIBRI_DTYPE_IQ3_S: return "iq3_s";
    case COLIBRI_DTYPE_FP8_E4M3: return "fp8_e4m3";
    case COLIBRI_DTYPE_TQ1_0: return "tq1_0";
    case COLIBRI_DTYPE_TQ2_0: return "tq2_0";
  }
  return "unknown";
}

const char* colibri_version(void) { return COLIBRI_VERSION_STRING; }

const char* colibri_cpu_isa(void) { return colibri::kernels::isa_name(colibri::kernels::default_isa()); }

namespace {

bool known_dtype(int dtype) { return dtype >= COLIBRI_DTYPE_F32 && dtype <= COLIBRI_DTYPE_TQ2_0; }

// Checks a conversion's arguments; the byte count of its rows.
size_t conversion_bytes(const char* function, int dtype, size_t rows, size_t n) {
  if (!known_dtype(dtype)) {
    colibri::fail(colibri::Status::kInvalidArgument, std::string(function) + ": unknown dtype " + std::to_string(dtype));
  }
  const size_t row = colibri::weight_row_bytes(static_cast<colibri::WeightType>(dtype), n);
  size_t total = 0;
  if (__builtin_mul_overflow(row, rows, &total) || n > (size_t{1} << 40)) {
    colibri::fail(colibri::Status::kInvalidArgument, std::string(function) + ": rows * n too large");
  }
  return total;
}

}  // namespace

size_t colibri_dtype_row_bytes(colibri_dtype_t dtype, size_t n) {
  const int d = colibri::raw_enum(dtype);
  return known_dtype(d) ? colibri::weight_row_bytes(to_weight_type(dtype), n) : 0;
}

colibri_status_t colibri_quantize(colibri_dtype_t dtype, const float* src, size_t rows, size_t n, void* dst,
                                  size_t dst_bytes) {
  return guarded("colibri_quantize", [&] {
    const size_t bytes = conversion_bytes("colibri_quantize", colibri::raw_enum(dtype), rows, n);
    if (rows != 0 && n != 0 && (src == nullptr || dst == nullptr)) {
      colibri::fail(colibri::Status::kInvalidArgument, "colibri_quantize: src or dst is NULL");
    }
    if (dst_bytes < bytes) {
      colibri::fail(colibri::Status::kInvalidArgument, "colibri_quantize: dst holds " + std::to_string(dst_bytes) +
                                                      " bytes, the rows need " + std::to_string(bytes));
    }
    colibri::convert_rows_from_float(to_weight_type(dtype), src, rows, n, dst, colibri::conversion_threads());
    return COLIBRI_OK;
  });
}

colibri_status_t colibri_dequantize(colibri_dtype_t dtype, const void* src, size_t src_bytes, size_t rows, size_t n,
                                    float* dst) {
  return guarded("colibri_dequantize", [&] {
    const size_t bytes = conversion_bytes("colibri_dequantize", colibri::raw_enum(dtype), rows, n);
    if (rows != 0 && n != 0 && (src == nullptr || dst == nullptr)) {
      colibri::fail(colibri::Status::kInvalidArgument, "colibri_dequantize: src or dst is NULL");
    }
    if (src_bytes != bytes) {
      colibri::fail(colibri::Status::kInvalidArgument, "colibri_dequantize: src holds " + std::to_string(src_bytes) +
                                                      " bytes, " + std::to_string(rows) + " rows of " +
                                                      std::to_string(n) + " need " + std::to_string(bytes));
    }
    colibri::convert_rows_to_float(to_weight_type(dtype), src, rows, n, dst);
    return COLIBRI_OK;
  });
}

void colibri_open_options_default(colibri_open_options_t* o) {
  if (o == nullptr) return;
  std::memset(o, 0, sizeof *o);
  o->n_threads = 0;
  o->lock_memory = 1;
  o->huge_pages = 1;
  o->verify_checksums = 1;
  o->pin_threads = 0;
  o->reserve_tokens = 64;
  o->eviction_policy = COLIBRI_EVICT_DECAYED_FREQUENCY;
  o->direct_io = 1;
  o->speculate = 1;
  o->io_engine = COLIBRI_IO_PREAD;
  o->tune_kernels = 1;
}

colibri_status_t colibri_open(const char* path, const colibri_open_options_t* options,
                              colibri_model_t** out_model) {
  if (out_model == nullptr) return null_argument("colibri_open", "out_model");
  *out_model = nullptr;
  if (path == nullptr) return null_argument("colibri_open", "path");
  colibri_open_options_t defaults;
  colibri_open_options_default(&defaults);
  const colibri_open_options_t& o = options != nullptr ? *options : defaults;
  t_last_warning.clear();
  return guarded("colibri_open", [&] {
    std::string warnings;
    auto* model = new colibri_model(path, o, &warnings);
    t_last_warning.set(warnings);
    *out_model = model;
    return COLIBRI_OK;
  });
}

void colibri_router_desc_default(colibri_router_desc_t* r) {
  if (r == nullptr) return;
  std::memset(r, 0, sizeof *r);
  r->family = COLIBRI_ROUTER_NONE;
  r->n_group = 1;
  r->topk_group = 1;
  r->routed_scaling_factor = 1.0f;
}

const char* colibri_router_family_name(colibri_router_family_t family) {
  const int f = colibri::raw_enum(family);
  return f >= 0 && f <= colibri::kLastRouterFamily ? colibri::router_family_name(static_cast<colibri::RouterFamily>(f))
                                                    : "unknown";
}

void colibri_model_desc_default(colibri_model_desc_t* d) {
  if (d == nullptr) return;
  std::memset(d, 0, sizeof *d);
  d->dtype = COLIBRI_DTYPE_F32;
  colibri_router_desc_default(&d->router);
  d->activation = COLIBRI_ACTIVATION_SWIGLU;
  d->swiglu_alpha = 1.702f;
  d->swiglu_limit = 7.0f;
}

colibri_status_t colibri_open_memory(const colibri_model_desc_t* desc, const colibri_open_options_t* options,
                                     colibri_model_t** out_model) {
  if (out_model == nullptr) return null_argument("colibri_open_memory", "out_model");
  *out_model = nullptr;
  if (desc == nullptr) return null_argument("colibri_open_memory", "desc");
  colibri_open_options_t defaults;
  colibri_open_options_default(&defaults);
  const colibri_open_options_t& o = options != nullptr ? *options : defaults;
  t_last_warning.clear();
  return guarded("colibri_open_memory", [&] {
    std::string warnings;
    auto* model = new colibri_model(colibri::api::memory_model(*desc), o, &warnings);
    t_last_warning.set(warnings);
    *out_model = model;
    return COLIBRI_OK;
  });
}

colibri_model_t* colibri_init(const char* path) {
  colibri_model_t* model = nullptr;
  colibri_open(path, nullptr, &model);
  return model;
}

void colibri_free(colibri_model_t* model) { delete model; }

void colibri_infer_default(colibri_infer_t* infer) {
  if (infer != nullptr) std::memset(infer, 0, sizeof *infer);
}

colibri_status_t colibri_infer(colibri_model_t* model, const colibri_infer_t* infer) {
  if (model == nullptr) return null_argument("colibri_infer", "model");
  if (infer == nullptr) return null_argument("colibri_infer", "infer");
  const colibri_infer_t& in = *infer;
  if (in.n_tokens < 0) {
    return set_error(COLIBRI_ERR_INVALID_ARGUMENT,
                     "colibri_infer: n_tokens must be >= 0, got " + std::to_string(in.n_tokens));
  }
  if (in.n_threads < 0) {
    return set_error(COLIBRI_ERR_INVALID_ARGUMENT,
                     "colibri_infer: n_threads must be >= 0, got " + std::to_string(in.n_threads));
  }
  const colibri::Manifest& m = model->impl.manifest();
  if (in.n_tokens > 0) {
    if (in.input == nullptr) return null_argument("colibri_infer", "infer->input");
    if (in.output == nullptr) return null_argument("colibri_infer", "infer->output");
    const size_t bytes = static_cast<size_t>(in.n_tokens) * static_cast<size_t>(m.d_model) * sizeof(float);
    const auto* ib = reinterpret_cast<const char*>(in.input);
    const auto* ob = reinterpret_cast<const char*>(in.output);
    if (ib < ob + bytes && ob < ib + bytes) {
      return set_error(COLIBRI_ERR_INVALID_ARGUMENT, "colibri_infer: output overlaps input");
    }
  }
  colibri::InferArgs a;
  a.layer = in.layer;
  a.n_tokens = in.n_tokens;
  a.input = in.input;
  a.output = in.output;
  a.threads = in.n_threads;
  colibri_status_t status = guarded("colibri_infer", [&] {
    if (in.routing_blob != nullptr) {
      model->impl.engine().infer_blob(a, in.routing_blob, in.routing_blob_size);
      return COLIBRI_OK;
    }
    if (in.n_tokens == 0) {
      // A no-op, whatever the routing fields hold; only the layer must exist.
      model->impl.engine().infer(a);
      return COLIBRI_OK;
    }
    if (in.expert_ids == nullptr && in.expert_weights == nullptr && m.has_router()) {
      model->impl.engine().infer(a);  // the built-in router chooses
      return COLIBRI_OK;
    }
    if (in.expert_ids == nullptr && in.expert_weights == nullptr) {
      colibri::fail(colibri::Status::kInvalidArgument,
                    "colibri_infer: no routing given (expert_ids, expert_weights and routing_blob are NULL) and "
                    "the model has no built-in router");
    }
    if (in.top_k < 1 || in.top_k > m.n_experts) {
      colibri::fail(colibri::Status::kInvalidArgument, "colibri_infer: top_k " + std::to_string(in.top_k) +
                                                      " is out of range [1, " +
                                                      std::to_string(m.n_experts) + "]");
    }
    if (in.n_tokens > 0 && in.expert_ids == nullptr) {
      colibri::fail(colibri::Status::kInvalidArgument, "colibri_infer: infer->expert_ids is NULL (and no routing_blob)");
    }
    if (in.n_tokens > 0 && in.expert_weights == nullptr) {
      colibri::fail(colibri::Status::kInvalidArgument, "colibri_infer: infer->expert_weights is NULL");
    }
    a.top_k = in.top_k;
    a.expert_ids = in.expert_ids;
    a.expert_weights = in.expert_weights;
    model->impl.engine().infer(a);
    return COLIBRI_OK;
  });
  if (status == COLIBRI_OK) model->impl.infer_calls().fetch_add(1, std::memory_order_relaxed);
  return status;
}

colibri_status_t colibri_route(colibri_model_t* model, int32_t layer, int32_t n_tokens, const float* input,
                               int32_t* out_ids, float* out_weights) {
  if (model == nullptr) return null_argument("colibri_route", "model");
  if (n_tokens < 0) {
    return set_error(COLIBRI_ERR_INVALID_ARGUMENT, "colibri_route: n_tokens must be >= 0, got " + std::to_string(n_tokens));
  }
  if (n_tokens > 0) {
    if (input == nullptr) return null_argument("colibri_route", "input");
    if (out_ids == nullptr) return null_argument("colibri_route", "out_expert_ids");
    if (out_weights == nullptr) return null_argument("colibri_route", "out_expert_weights");
  }
  return guarded("colibri_route", [&] {
    model->impl.engine().route(layer, n_tokens, input, out_ids, out_weights, 0);
    return COLIBRI_OK;
  });
}

void colibri_swap_source_default(colibri_swap_source_t* source) {
  if (source != nullptr) std::memset(source, 0, sizeof *source);
}

colibri_status_t colibri_swap_expert(colibri_model_t* model, int32_t layer, int32_t expert,
                                     const colibri_swap_source_t* source) {
  if (model == nullptr) return null_argument("colibri_swap_expert", "model");
  if (source == nullptr) return null_argument("colibri_swap_expert", "source");
  t_last_warning.clear();
  return guarded("colibri_swap_expert", [&] {
    const colibri::Manifest& m = model->impl.manifest();
    const uint64_t* checksum = source->has_checksum != 0 ? &source->checksum : nullptr;
    std::string warnings;
    if (source->path != nullptr) {
      // Read, not mapped: a file truncated while we read it gives a short
      // read and an error, never SIGBUS.
      const std::string bytes = colibri::read_small_file(source->path, m.max_expert_file_bytes());
      model->impl.swap_expert(layer, expert, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                              source->path, checksum, &warnings);
    } else {
      if (source->data == nullptr) {
        colibri::fail(colibri::Status::kInvalidArgument, "colibri_swap_expert: source has neither path nor data");
      }
      const int dtype = colibri::raw_enum(source->dtype);
      // The layer's own type (layers may differ); swap_expert checks the range.
      const colibri::WeightType want = layer >= 0 && layer < m.n_layers ? m.layer_types(layer).dtype : m.dtype;
      if (dtype != static_cast<int>(want)) {
        const bool known = known_dtype(dtype);
        colibri::fail(colibri::Status::kInvalidArgument,
                      std::string("colibri_swap_expert: source dtype ") +
                          (known ? colibri_dtype_name(static_cast<colibri_dtype_t>(dtype)) : std::to_string(dtype)) +
                          " is not the model's " + colibri_dtype_name(to_c_dtype(want)));
      }
      model->impl.swap_expert(layer, expert, static_cast<const uint8_t*>(source->data), source->size,
                              "colibri_swap_expert: source data", checksum, &warnings);
    }
    t_last_warning.set(warnings);
    return COLIBRI_OK;
  });
}

colibri_status_t colibri_model_info(const colibri_model_t* model, colibri_model_info_t* out) {
  if (model == nullptr) return null_argument("colibri_model_info", "model");
  if (out == nullptr) return null_argument("colibri_model_info", "out_info");
  const colibri::Manifest& m = model->impl.manifest();
  out->n_layers = m.n_layers;
  out->n_experts = m.n_experts;
  out->d_model = m.d_model;
  out->d_ff = m.d_ff;
  out->dtype = to_c_dtype(m.dtype);
  out->n_threads = model->impl.threads();
  out->format_version = m.version;
  out->router_family = static_cast<colibri_router_family_t>(m.router.family);
  out->router_top_k = m.has_router() ? m.router.top_k : 0;
  out->shared_d_ff = m.shared_d_ff;
  out->down_dtype = to_c_dtype(m.down_dtype);
  out->activation = m.clamped_swiglu() ? COLIBRI_ACTIVATION_CLAMPED_SWIGLU : COLIBRI_ACTIVATION_SWIGLU;
  out->swiglu_alpha = m.swiglu_alpha;
  out->swiglu_limit = m.swiglu_limit;
  out->expert_bias = m.expert_bias ? 1 : 0;
  t_last_error.clear();
  return COLIBRI_OK;
}

colibri_status_t colibri_layer_dtypes(const colibri_model_t* model, int32_t layer, colibri_dtype_t* out_dtype,
                                      colibri_dtype_t* out_down_dtype) {
  if (model == nullptr) return null_argument("colibri_layer_dtypes", "model");
  if (out_dtype == nullptr) return null_argument("colibri_layer_dtypes", "out_dtype");
  if (out_down_dtype == nullptr) return null_argument("colibri_layer_dtypes", "out_down_dtype");
  return guarded("colibri_layer_dtypes", [&] {
    const colibri::Manifest& m = model->impl.manifest();
    if (layer < 0 || layer >= m.n_layers) {
      colibri::fail(colibri::Status::kInvalidArgument, "colibri_layer_dtypes: layer " + std::to_string(layer) +
                                                           " is out of range [0, " + std::to_string(m.n_layers) + ")");
    }
    const colibri::LayerTypes t = m.layer_types(layer);
    *out_dtype = to_c_dtype(t.dtype);
    *out_down_dtype = to_c_dtype(t.down_dtype);
    return COLIBRI_OK;
  });
}

colibri_status_t colibri_stats(const colibri_model_t* model, colibri_stats_t* out) {
  if (model == nullptr) return null_argument("colibri_stats", "model");
  if (out == nullptr) return null_argument("colibri_stats", "out_stats");
  const colibri::ExpertStore& store = model->impl.store();
  std::memset(out, 0, sizeof *out);
  out->bytes_mapped = store.region().size();
  out->bytes_locked = store.stats().bytes_locked;
  out->bytes_huge_pages = store.stats().bytes_huge_pages;
  out->huge_page_kind = out->bytes_huge_pages > 0 ? to_c_huge_pages(store.region().huge_page_kind()) : COLIBRI_HUGE_PAGES_NONE;
  out->bytes_files = store.stats().bytes_files;
  out->load_seconds = model->impl.load_seconds();
  out->verify_seconds = store.stats().verify_seconds;
  out->infer_calls = model->impl.infer_calls_count();
  out->expert_swaps = model->impl.expert_swaps();
  if (const colibri::ExpertCache* cache = model->impl.cache()) {
    const colibri::CacheStats c = cache->stats();
    out->bytes_mapped += cache->region_bytes();
    out->cache_slots = c.slots;
    out->resident_bytes = cache->region_bytes();
    out->resident_experts = c.resident_experts;
    out->experts_bytes = model->impl.experts_bytes();
    out->cache_hits = c.hits;
    out->cache_misses = c.misses;
    out->cache_evictions = c.evictions;
    out->expert_reads = c.reads;
    out->expert_read_failures = c.read_failures;
    out->bytes_read = c.bytes_read;
    out->direct_reads = c.direct_reads;
    out->uring_reads = c.uring_reads;
    out->read_seconds = c.read_seconds;
    out->checksum_seconds = c.checksum_seconds;
    out->wait_seconds = c.wait_seconds;
    out->prefetch_reads = c.prefetch_reads;
    out->prefetch_used = c.prefetch_used;
    out->predicted = c.predicted;
    out->predicted_used = c.predicted_used;
  }
  t_last_error.clear();
  return COLIBRI_OK;
}

colibri_status_t colibri_prefetch(colibri_model_t* model, int32_t layer, const int32_t* experts, int32_t n,
                                  int32_t* out_started) {
  if (out_started != nullptr) *out_started = 0;
  if (model == nullptr) return null_argument("colibri_prefetch", "model");
  if (n > 0 && experts == nullptr) return null_argument("colibri_prefetch", "experts");
  return guarded("colibri_prefetch", [&] {
    using colibri::Status;
    const colibri::Manifest& m = model->impl.manifest();
    if (n < 0) colibri::fail(Status::kInvalidArgument, "colibri_prefetch: n must be >= 0, got " + std::to_string(n));
    if (layer < 0 || layer >= m.n_layers) {
      colibri::fail(Status::kInvalidArgument, "colibri_prefetch: layer " + std::to_string(layer) +
                                                  " is out of range [0, " + std::to_string(m.n_layers) + ")");
    }
    for (int32_t i = 0; i < n; ++i) {
      if (experts[i] < -1 || experts[i] >= m.n_experts) {
        colibri::fail(Status::kInvalidArgument, "colibri_prefetch: experts[" + std::to_string(i) + "] = " +
                                                    std::to_string(experts[i]) + " is out of range [0, " +
                                                    std::to_string(m.n_experts) + ") (-1 means none)");
      }
    }
    colibri::ExpertCache* cache = model->impl.cache();
    int32_t started = 0;
    for (int32_t i = 0; cache != nullptr && i < n; ++i) {
      if (experts[i] >= 0 && model->impl.store().local(layer, experts[i])) {
        started += cache->prefetch(layer, experts + i, 1);
      }
    }
    if (out_started != nullptr) *out_started = started;
    return COLIBRI_OK;
  });
}

const char* colibri_model_kernels(const colibri_model_t* model) {
  return model != nullptr ? model->impl.kernels_description().c_str() : "";
}

const char* colibri_model_source(const colibri_model_t* model) {
  return model != nullptr ? model->impl.source_description().c_str() : "";
}

int32_t colibri_model_first_block(const colibri_model_t* model) {
  return model != nullptr ? model->impl.first_block() : -1;
}

colibri_status_t colibri_verify_dir(const char* path) {
  if (path == nullptr) return null_argument("colibri_verify_dir", "path");
  return guarded("colibri_verify_dir", [&] {
    colibri::verify_model_dir(path, nullptr);
    return COLIBRI_OK;
  });
}

void colibri_route_compile_options_default(colibri_route_compile_options_t* o) {
  if (o == nullptr) return;
  std::memset(o, 0, sizeof *o);
  o->weight_encoding = COLIBRI_ROUTE_WEIGHTS_F32;
}

}  // extern "C"

// Helpers of the routing entry points below (C++ linkage).
namespace {

colibri::WeightEncoding general_encoding(const colibri_route_weight_encoding_t& field) {
  const int e = colibri::raw_enum(field);
  if (e == COLIBRI_ROUTE_WEIGHTS_F16) return colibri::WeightEncoding::kF16;
  if (e == COLIBRI_ROUTE_WEIGHTS_F32) return colibri::WeightEncoding::kF32;
  colibri::fail(colibri::Status::kInvalidArgument, "weight_encoding " + std::to_string(e) + " is not F32 (1) or F16 (2)");
}

std::vector<uint8_t> compile_text(const char* text, size_t size, const std::string& source,
                                  const colibri_route_compile_options_t& o) {
  colibri::Routing r = colibri::parse_route_text(std::string_view(text, size), source,
                                                 o.n_experts, o.q4_weights != 0);
  return colibri::encode_routing(r, o.compact != 0, general_encoding(o.weight_encoding), source);
}

}  // namespace

extern "C" {

colibri_status_t colibri_route_compile(const char* text, size_t text_size, const char* source_name,
                                       const colibri_route_compile_options_t* options,
                                       void** out_blob, size_t* out_blob_size) {
  if (out_blob == nullptr) return null_argument("colibri_route_compile", "out_blob");
  *out_blob = nullptr;
  if (out_blob_size == nullptr) return null_argument("colibri_route_compile", "out_blob_size");
  *out_blob_size = 0;
  if (text == nullptr && text_size != 0) return null_argument("colibri_route_compile", "text");
  if (options == nullptr) return null_argument("colibri_route_compile", "options");
  return guarded("colibri_route_compile", [&] {
    const std::string source = source_name != nullptr ? source_name : "<route text>";
    std::vector<uint8_t> blob = compile_text(text != nullptr ? text : "", text_size, source, *options);
    void* buffer = std::malloc(blob.empty() ? 1 : blob.size());
    if (buffer == nullptr) throw std::bad_alloc();
    std::memcpy(buffer, blob.data(), blob.size());
    *out_blob = buffer;
    *out_blob_size = blob.size();
    return COLIBRI_OK;
  });
}

colibri_status_t colibri_route_compile_file(const char* route_path, const char* out_path,
                                            const colibri_route_compile_options_t* options) {
  if (route_path == nullptr) return null_argument("colibri_route_compile_file", "route_path");
  if (out_path == nullptr) return null_argument("colibri_route_compile_file", "out_path");
  if (options == nullptr) return null_argument("colibri_route_compile_file", "options");
  return guarded("colibri_route_compile_file", [&] {
    const std::string text = colibri::read_small_file(route_path, kMaxRouteTextBytes);
    const std::vector<uint8_t> blob = compile_text(text.data(), text.size(), route_path, *options);
    colibri::write_file_atomic(out_path, blob.data(), blob.size());
    return COLIBRI_OK;
  });
}

void colibri_buffer_free(void* buffer) { std::free(buffer); }

colibri_status_t colibri_doctor(const char* model_path, int32_t n_threads, char** out_json, size_t* out_size) {
  if (out_json == nullptr) return null_argument("colibri_doctor", "out_json");
  *out_json = nullptr;
  if (out_size != nullptr) *out_size = 0;
  if (n_threads < 0) {
    return set_error(COLIBRI_ERR_INVALID_ARGUMENT, {"colibri_doctor: n_threads must be >= 0 (0 = one per core)"});
  }
  return guarded("colibri_doctor", [&] {
    const std::string report = colibri::doctor_report(model_path != nullptr ? model_path : "", n_threads);
    auto* buffer = static_cast<char*>(std::malloc(report.size() + 1));
    if (buffer == nullptr) throw std::bad_alloc();
    std::memcpy(buffer, report.c_str(), report.size() + 1);
    *out_json = buffer;
    if (out_size != nullptr) *out_size = report.size();
    return COLIBRI_OK;
  });
}

colibri_status_t colibri_routing_decode(const void* blob, size_t blob_size, int32_t n_experts,
                                        const char* source_name, colibri_routing_t** out) {
  if (out == nullptr) return null_argument("colibri_routing_decode", "out_routing");
  *out = nullptr;
  if (blob == nullptr) return null_argument("colibri_routing_decode", "blob");
  return guarded("colibri_routing_decode", [&] {
    const std::string source = source_name != nullptr ? source_name : "<routing blob>";
    auto* r = new colibri_routing{colibri::decode_routing(blob, blob_size, n_experts, source)};
    *out = r;
    return COLIBRI_OK;
  });
}

colibri_status_t colibri_routing_load(const char* path, int32_t n_experts, int32_t q4_weights,
                                      colibri_routing_t** out) {
  if (out == nullptr) return null_argument("colibri_routing_load", "out_routing");
  *out = nullptr;
  if (path == nullptr) return null_argument("colibri_routing_load", "path");
  return guarded("colibri_routing_load", [&] {
    const std::string data = colibri::read_small_file(path, kMaxRouteTextBytes);
    colibri::Routing routing;
    if (colibri::has_routing_magic(data.data(), data.size())) {
      routing = colibri::decode_routing(data.data(), data.size(), n_experts, path);
    } else {
      if (n_experts <= 0) {
        colibri::fail(colibri::Status::kInvalidArgument,
                      std::string(path) + ": a .route text file needs the model's expert count");
      }
      routing = colibri::parse_route_text(data, path, n_experts, q4_weights != 0);
    }
    *out = new colibri_routing{std::move(routing)};
    return COLIBRI_OK;
  });
}

int32_t colibri_routing_n_tokens(const colibri_routing_t* r) { return r ? r->impl.n_tokens : 0; }
int32_t colibri_routing_n_experts(const colibri_routing_t* r) { return r ? r->impl.n_experts : 0; }
int32_t colibri_routing_top_k(const colibri_routing_t* r) { return r ? r->impl.top_k : 0; }
int32_t colibri_routing_is_compact(const colibri_routing_t* r) {
  return r && r->impl.id_encoding == colibri::IdEncoding::kCompact ? 1 : 0;
}
colibri_route_weight_encoding_t colibri_routing_weight_encoding(const colibri_routing_t* r) {
  return r && r->impl.weight_encoding == colibri::WeightEncoding::kF16 ? COLIBRI_ROUTE_WEIGHTS_F16
                                                                       : COLIBRI_ROUTE_WEIGHTS_F32;
}
const int32_t* colibri_routing_expert_ids(const colibri_routing_t* r) {
  return r ? r->impl.ids.data() : nullptr;
}
const float* colibri_routing_expert_weights(const colibri_routing_t* r) {
  return r ? r->impl.weights.data() : nullptr;
}
void colibri_routing_free(colibri_routing_t* r) { delete r; }

void colibri_linear_desc_default(colibri_linear_desc_t* desc) {
  if (desc == nullptr) return;
  *desc = colibri_linear_desc_t{};
  desc->dtype = COLIBRI_DTYPE_F32;
  desc->huge_pages = 1;
  desc->groups = 1;
}

colibri_status_t colibri_linear_create(const colibri_linear_desc_t* desc, colibri_linear_t** out) {
  if (out == nullptr) return null_argument("colibri_linear_create", "out");
  *out = nullptr;
  if (desc == nullptr) return null_argument("colibri_linear_create", "desc");
  t_last_warning.clear();
  return guarded("colibri_linear_create", [&] {
    const std::string name = desc->name != nullptr ? desc->name : "linear";
    if (!known_dtype(colibri::raw_enum(desc->dtype))) {
      colibri::fail(colibri::Status::kInvalidArgument,
                    name + ": unknown dtype " + std::to_string(colibri::raw_enum(desc->dtype)));
    }
    colibri::LinearOptions o;
    o.threads = desc->n_threads;
    o.exact = desc->exact != 0;
    o.huge_pages = desc->huge_pages != 0;
    o.lock_memory = desc->lock_memory != 0;
    o.tune = desc->fixed_kernels == 0;
    std::string warnings;
    *out = new colibri_linear{colibri::Linear(to_weight_type(desc->dtype), desc->out_features, desc->in_features,
                                              desc->weight, desc->weight_size, desc->bias, o, name, &warnings,
                                              desc->groups == 0 ? 1 : desc->groups)};
    if (!warnings.empty()) t_last_warning.set(warnings);
    return COLIBRI_OK;
  });
}

colibri_status_t colibri_linear_forward(colibri_linear_t* linear, int32_t n_tokens, const float* x, float* y) {
  if (linear == nullptr) return null_argument("colibri_linear_forward", "linear");
  if (n_tokens < 0) {
    return set_error(COLIBRI_ERR_INVALID_ARGUMENT, {"colibri_linear_forward: n_tokens is negative"});
  }
  if (n_tokens == 0) return COLIBRI_OK;
  if (x == nullptr) return null_argument("colibri_linear_forward", "x");
  if (y == nullptr) return null_argument("colibri_linear_forward", "y");
  colibri::Linear& l = linear->impl;
  const size_t T = static_cast<size_t>(n_tokens);
  const size_t in = static_cast<size_t>(l.groups()) * static_cast<size_t>(l.in_features());
  const size_t out = static_cast<size_t>(l.groups()) * static_cast<size_t>(l.out_features());
  const auto xb = reinterpret_cast<uintptr_t>(x);
  const auto yb = reinterpret_cast<uintptr_t>(y);
  if (xb < yb + T * out * sizeof(float) && yb < xb + T * in * sizeof(float)) {
    return set_error(COLIBRI_ERR_INVALID_ARGUMENT, {"colibri_linear_forward: y overlaps x"});
  }
  return guarded("colibri_linear_forward", [&] {
    l.forward(n_tokens, x, in, y, out);
    return COLIBRI_OK;
  });
}

const char* colibri_linear_kernels(const colibri_linear_t* linear) {
  return linear != nullptr ? linear->impl.kernels_description().c_str() : "";
}

uint64_t colibri_linear_bytes(const colibri_linear_t* linear) {
  return linear != nullptr ? linear->impl.weight_bytes() : 0;
}

void colibri_linear_free(colibri_linear_t* linear) { delete linear; }

colibri_status_t colibri_rms_norm(const float* x, const float* weight, int32_t rows, int32_t dim, float eps,
                                  float* y) {
  if (rows < 0 || dim < 1) {
    return set_error(COLIBRI_ERR_INVALID_ARGUMENT, {"colibri_rms_norm: rows must be >= 0 and dim >= 1"});
  }
  if (!(eps >= 0.0f) || !std::isfinite(eps)) {
    return set_error(COLIBRI_ERR_INVALID_ARGUMENT, {"colibri_rms_norm: eps must be finite and >= 0"});
  }
  if (rows == 0) return COLIBRI_OK;
  if (x == nullptr) return null_argument("colibri_rms_norm", "x");
  if (weight == nullptr) return null_argument("colibri_rms_norm", "weight");
  if (y == nullptr) return null_argument("colibri_rms_norm", "y");
  const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(dim);
  const auto xb = reinterpret_cast<uintptr_t>(x);
  const auto yb = reinterpret_cast<uintptr_t>(y);
  if (xb != yb && xb < yb + n * sizeof(float) && yb < xb + n * sizeof(float)) {
    return set_error(COLIBRI_ERR_INVALID_ARGUMENT, {"colibri_rms_norm: y overlaps x without being x"});
  }
  colibri::rms_norm_rows(x, static_cast<size_t>(dim), weight, rows, dim, eps, y);
  return COLIBRI_OK;
}

}  // extern "C"

namespace {

// The shared pool of the last thread count asked for, held here so a
// caller without models or linear layers does not start threads per call.
std::shared_ptr<colibri::ThreadPool> attention_pool(int threads) {
  static std::mutex mutex;
  static std::shared_ptr<colibri::ThreadPool> held;
  std::lock_guard<std::mutex> lock(mutex);
  if (held == nullptr || held->size() != threads) held = colibri::shared_thread_pool(threads, false);
  return held;
}

}  // namespace

extern "C" {

colibri_status_t colibri_rope(const colibri_rope_desc_t* d) {
  if (d == nullptr) return null_argument("colibri_rope", "desc");
  const auto invalid = [](const std::string& what) {
    return set_error(COLIBRI_ERR_INVALID_ARGUMENT, {"colibri_rope: " + what});
  };
  if (d->batch < 0 || d->heads < 0 || d->tokens < 0 || d->head_dim < 1) {
    return invalid("batch, heads and tokens must be >= 0 and head_dim >= 1");
  }
  if (d->rotary_dim < 2 || d->rotary_dim > d->head_dim || d->rotary_dim % 2 != 0) {
    return invalid("rotary_dim (" + std::to_string(d->rotary_dim) + ") must be even and in [2, head_dim = " +
                   std::to_string(d->head_dim) + "]");
  }
  for (int i = 0; i < 3; ++i) {
    if (d->x_stride[i] < 0 || d->out_stride[i] < 0 || (i < 2 && d->table_stride[i] < 0)) {
      return invalid("strides must be >= 0");
    }
  }
  if (static_cast<int64_t>(d->batch) * d->heads * d->tokens == 0) return COLIBRI_OK;
  if (d->x == nullptr) return null_argument("colibri_rope", "x");
  if (d->out == nullptr) return null_argument("colibri_rope", "out");
  if (d->cos == nullptr) return null_argument("colibri_rope", "cos");
  if (d->sin == nullptr) return null_argument("colibri_rope", "sin");
  if (d->out == d->x && (d->out_stride[0] != d->x_stride[0] || d->out_stride[1] != d->x_stride[1] ||
                         d->out_stride[2] != d->x_stride[2])) {
    return invalid("out is x with other strides");
  }
  colibri::RopeArgs a;
  a.batch = d->batch;
  a.heads = d->heads;
  a.tokens = d->tokens;
  a.head_dim = d->head_dim;
  a.rotary_dim = d->rotary_dim;
  a.half_table = d->half_table != 0;
  a.x = d->x;
  a.out = d->out;
  a.cos = d->cos;
  a.sin = d->sin;
  for (int i = 0; i < 3; ++i) {
    a.x_stride[i] = d->x_stride[i];
    a.out_stride[i] = d->out_stride[i];
  }
  a.table_stride[0] = d->table_stride[0];
  a.table_stride[1] = d->table_stride[1];
  colibri::rope(a);
  return COLIBRI_OK;
}

void colibri_attention_desc_default(colibri_attention_desc_t* desc) {
  if (desc == nullptr) return;
  *desc = colibri_attention_desc_t{};
  desc->scale = 1.0f;
}

colibri_status_t colibri_attention(const colibri_attention_desc_t* d) {
  if (d == nullptr) return null_argument("colibri_attention", "desc");
  const auto invalid = [](const std::string& what) {
    return set_error(COLIBRI_ERR_INVALID_ARGUMENT, {"colibri_attention: " + what});
  };
  if (d->batch < 0 || d->heads < 1 || d->kv_heads < 1 || d->q_len < 0 || d->kv_len < 0 || d->qk_dim < 1 ||
      d->v_dim < 1) {
    return invalid("batch, q_len and kv_len must be >= 0, heads, kv_heads, qk_dim and v_dim >= 1");
  }
  if (d->heads % d->kv_heads != 0) {
    return invalid("heads (" + std::to_string(d->heads) + ") is not a multiple of kv_heads (" +
                   std::to_string(d->kv_heads) + ")");
  }
  if (d->mask != nullptr && d->additive_mask != nullptr) return invalid("both mask and additive_mask are set");
  if (d->mask == nullptr && d->additive_mask == nullptr && d->q_len > d->kv_len) {
    return invalid("the causal mask needs q_len (" + std::to_string(d->q_len) + ") <= kv_len (" +
                   std::to_string(d->kv_len) + ")");
  }
  if (d->window < 0 || d->n_threads < 0) return invalid("window and n_threads must be >= 0");
  if (d->qk2_dim < 0 || (d->qk2_dim > 0) != (d->k2 != nullptr)) {
    return invalid("k2 and qk2_dim > 0 go together");
  }
  if (!std::isfinite(d->scale)) return invalid("scale must be finite");
  for (int i = 0; i < 3; ++i) {
    if (d->q_stride[i] < 0 || d->k_stride[i] < 0 || d->v_stride[i] < 0 || d->mask_stride[i] < 0 ||
        d->k2_stride[i] < 0) {
      return invalid("strides must be >= 0");
    }
  }
  if (static_cast<int64_t>(d->batch) * d->q_len == 0) return COLIBRI_OK;
  if (d->q == nullptr) return null_argument("colibri_attention", "q");
  if (d->out == nullptr) return null_argument("colibri_attention", "out");
  if (d->kv_len > 0 && d->k == nullptr) return null_argument("colibri_attention", "k");
  if (d->kv_len > 0 && d->v == nullptr) return null_argument("colibri_attention", "v");
  return guarded("colibri_attention", [&] {
    colibri::AttentionArgs a;
    a.batch = d->batch;
    a.heads = d->heads;
    a.kv_heads = d->kv_heads;
    a.q_len = d->q_len;
    a.kv_len = d->kv_len;
    a.qk_dim = d->qk_dim;
    a.v_dim = d->v_dim;
    a.q = d->q;
    a.k = d->k;
    a.v = d->v;
    a.mask = d->mask;
    a.additive_mask = d->additive_mask;
    for (int i = 0; i < 3; ++i) {
      a.q_stride[i] = d->q_stride[i];
      a.k_stride[i] = d->k_stride[i];
      a.v_stride[i] = d->v_stride[i];
      a.mask_stride[i] = d->mask_stride[i];
      a.k2_stride[i] = d->k2_stride[i];
    }
    a.k2 = d->k2;
    a.qk2_dim = d->qk2_dim;
    a.window = d->window;
    a.sinks = d->sinks;
    a.scale = d->scale;
    a.out = d->out;
    const int threads = d->n_threads > 0 ? d->n_threads : colibri::online_cores();
    colibri::attention(a, colibri::kernels::default_isa(), attention_pool(threads).get());
    return COLIBRI_OK;
  });
}

}  // extern "C"
