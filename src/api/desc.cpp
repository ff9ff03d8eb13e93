#include "api/desc.h"

#include <algorithm>
#include <string>

#include "moe/router.h"
#include "util/c_enum.h"
#include "util/error.h"

namespace colibri::api {

OpenOptions open_options(const colibri_open_options_t& o) {
  OpenOptions r;
  r.threads = o.n_threads;
  r.lock_memory = o.lock_memory != 0;
  r.huge_pages = o.huge_pages != 0;
  r.verify_checksums = o.verify_checksums != 0;
  r.pin_threads = o.pin_threads != 0;
  r.reserve_tokens = o.reserve_tokens;
  r.bf16_compute = o.bf16_compute != 0;
  r.exact_prefill = o.exact_prefill != 0;
  r.max_resident_bytes = o.max_resident_bytes;
  r.max_resident_percent = static_cast<double>(o.max_resident_percent);
  r.io_threads = o.io_threads;
  if (o.eviction_policy != COLIBRI_EVICT_DECAYED_FREQUENCY && o.eviction_policy != COLIBRI_EVICT_LRU) {
    fail(Status::kInvalidArgument, "options.eviction_policy must be 0 (decayed frequency) or 1 (LRU), got " +
                                       std::to_string(o.eviction_policy));
  }
  r.eviction = o.eviction_policy == COLIBRI_EVICT_LRU ? EvictionPolicy::kLru : EvictionPolicy::kDecayedFrequency;
  r.direct_io = o.direct_io != 0;
  if (o.io_engine != COLIBRI_IO_PREAD && o.io_engine != COLIBRI_IO_URING) {
    fail(Status::kInvalidArgument, "options.io_engine must be 0 (pread) or 1 (io_uring), got " +
                                       std::to_string(o.io_engine));
  }
  r.io_engine = o.io_engine == COLIBRI_IO_URING ? IoEngine::kIoUring : IoEngine::kPread;
  r.speculate = o.speculate != 0;
  r.tune_kernels = o.tune_kernels != 0;
  if (o.local_experts_len < 0 || (o.local_experts_len > 0 && o.local_experts == nullptr) ||
      (o.local_experts != nullptr && o.local_experts_len == 0)) {
    fail(Status::kInvalidArgument, "options.local_experts and local_experts_len must be both set or both unset "
                                   "(local_experts_len " + std::to_string(o.local_experts_len) + ")");
  }
  if (o.local_experts != nullptr) r.local_experts.assign(o.local_experts, o.local_experts + o.local_experts_len);
  r.skip_shared = o.skip_shared_expert != 0;
  if (o.progress != nullptr) {
    r.progress = [fn = o.progress, user = o.progress_user_data](float fraction) { return fn(fraction, user) != 0; };
  }
  return r;
}

namespace {

[[noreturn]] void bad_desc(const std::string& what) {
  fail(Status::kInvalidArgument, "colibri_open_memory: " + what);
}

ExpertBuffers expert_buffers(const colibri_expert_weights_t& w, const std::string& name, bool biased) {
  if (w.gate == nullptr) bad_desc(name + ".gate is NULL");
  if (w.up == nullptr) bad_desc(name + ".up is NULL");
  if (w.down == nullptr) bad_desc(name + ".down is NULL");
  ExpertBuffers b{w.gate, w.up, w.down};
  if (biased) {
    b.gate_bias = w.gate_bias;
    b.up_bias = w.up_bias;
    b.down_bias = w.down_bias;
  }
  return b;
}

// The manifest a directory holding `desc` would have: the same limits apply.
Manifest manifest_of(const colibri_model_desc_t& d) {
  if (d.layers == nullptr) bad_desc("desc->layers is NULL");
  const int dtype = raw_enum(d.dtype);
  if (dtype < 0 || dtype >= kWeightTypeCount) {
    bad_desc("dtype " + std::to_string(dtype) + " is not a known dtype (" + dtype_names() + ")");
  }
  const auto type = static_cast<WeightType>(dtype);  // colibri_dtype_t's values are WeightType's
  const bool quantized = weight_format(type).quantized;
  const int down_dtype = quantized ? raw_enum(d.down_dtype) : dtype;
  if (down_dtype < 0 || down_dtype >= kWeightTypeCount) {
    bad_desc("down_dtype " + std::to_string(down_dtype) + " is not a known dtype (" + dtype_names() + ")");
  }
  const auto down_type = static_cast<WeightType>(down_dtype);
  if (const std::string why = dtype_pair_problem(type, down_type); !why.empty()) bad_desc(why);
  const int family = raw_enum(d.router.family);
  if (family < 0 || family > kLastRouterFamily) {
    bad_desc("router.family " + std::to_string(family) + " is not a known router family");
  }
  if (d.shared_d_ff < 0) bad_desc("shared_d_ff must be >= 0, got " + std::to_string(d.shared_d_ff));
  const int activation = raw_enum(d.activation);
  if (activation != COLIBRI_ACTIVATION_SWIGLU && activation != COLIBRI_ACTIVATION_CLAMPED_SWIGLU) {
    bad_desc("activation " + std::to_string(activation) + " is not a known activation");
  }
  if (d.expert_bias != 0 && d.expert_bias != 1) bad_desc("expert_bias must be 0 or 1");
  Manifest m;
  m.n_layers = d.n_layers;
  m.n_experts = d.n_experts;
  m.d_model = d.d_model;
  m.d_ff = d.d_ff;
  m.dtype = type;
  m.down_dtype = down_type;
  m.router.family = static_cast<RouterFamily>(family);
  m.router.top_k = d.router.top_k;
  m.router.norm_topk_prob = d.router.norm_topk_prob;
  m.router.n_group = d.router.n_group;
  m.router.topk_group = d.router.topk_group;
  m.router.routed_scaling_factor = d.router.routed_scaling_factor;
  m.shared_d_ff = d.shared_d_ff;
  if (activation == COLIBRI_ACTIVATION_CLAMPED_SWIGLU) {
    m.activation = "clamped_swiglu";
    m.swiglu_alpha = d.swiglu_alpha;
    m.swiglu_limit = d.swiglu_limit;
  }
  m.expert_bias = d.expert_bias == 1;
  m.version = std::max(m.minimum_version(), 2);
  // Dimension and size limits first (the manifest parser holds them), so
  // the loops of memory_model never walk past what the caller could have
  // allocated.
  try {
    parse_manifest(manifest_to_json(m), "colibri_open_memory: desc");
  } catch (const Error& e) {
    fail(Status::kInvalidArgument, e.what());
  }
  validate_router(m.router, d.n_experts, "colibri_open_memory: router", Status::kInvalidArgument);
  return m;
}

}  // namespace

MemoryModel memory_model(const colibri_model_desc_t& d) {
  MemoryModel out;
  out.manifest = manifest_of(d);
  Manifest& m = out.manifest;
  bool any_gate = false, all_gate = true;
  out.layers.resize(static_cast<size_t>(d.n_layers));
  for (int64_t l = 0; l < d.n_layers; ++l) {
    const colibri_layer_weights_t& lw = d.layers[l];
    LayerBuffers& buffers = out.layers[static_cast<size_t>(l)];
    const std::string layer = "layers[" + std::to_string(l) + "]";
    if (d.fetch_expert != nullptr) {
      if (lw.experts != nullptr) bad_desc(layer + ".experts must be NULL when fetch_expert supplies the experts");
    } else {
      if (lw.experts == nullptr) bad_desc(layer + ".experts is NULL");
      buffers.experts.reserve(static_cast<size_t>(d.n_experts));
      for (int64_t e = 0; e < d.n_experts; ++e) {
        buffers.experts.push_back(
            expert_buffers(lw.experts[e], layer + ".experts[" + std::to_string(e) + "]", m.expert_bias));
      }
    }
    if (m.has_router() && lw.router == nullptr) bad_desc(layer + ".router is NULL (the model has a router)");
    buffers.router = lw.router;
    buffers.router_bias = lw.router_bias;
    if (m.has_shared()) {
      buffers.shared = expert_buffers(lw.shared, layer + ".shared", false);
      buffers.shared_gate = lw.shared_gate;
      any_gate |= lw.shared_gate != nullptr;
      all_gate &= lw.shared_gate != nullptr;
    }
  }
  if (any_gate && !all_gate) bad_desc("shared_gate must be given for every layer or for none");
  m.shared_gate = m.has_shared() && any_gate;
  if (d.fetch_expert != nullptr) {
    // Called while the store packs, in (layer, expert) order; what it
    // returns is validated as a given buffer would be.
    out.fetch = [fetch = d.fetch_expert, user = d.fetch_user, biased = m.expert_bias](int32_t l, int32_t e) {
      colibri_expert_weights_t w{};
      const std::string name = "layers[" + std::to_string(l) + "].experts[" + std::to_string(e) + "]";
      const int32_t status = fetch(user, l, e, &w);
      if (status != 0) bad_desc("fetch_expert for " + name + " returned " + std::to_string(status));
      return expert_buffers(w, name + " (from fetch_expert)", biased);
    };
  }
  return out;
}

}  // namespace colibri::api
