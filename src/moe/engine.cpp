#include "moe/engine.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "moe/routing.h"
#include "util/error.h"

namespace colibri {

namespace {

int32_t round_up(int32_t n, int32_t to) { return (n + to - 1) / to * to; }

// Rows per work item: enough items that a thread finishing early can take
// more (about 16 per thread), yet big enough that per-item overhead and the
// re-reading of activations stay small.
int32_t rows_per_item(int64_t total_rows, int threads, int32_t max_rows) {
  const int64_t want_items = 16LL * threads;
  int64_t rows = (total_rows + want_items - 1) / want_items;
  rows = std::clamp<int64_t>(rows, 16, 512);
  rows = (rows + 15) / 16 * 16;
  return static_cast<int32_t>(std::min<int64_t>(rows, max_rows));
}

}  // namespace

Engine::Engine(const ExpertStore& store, int32_t n_layers, int32_t n_experts, ThreadPool& pool,
               std::vector<kernels::KernelPlan> plans)
    : store_(store), n_layers_(n_layers), n_experts_(n_experts), pool_(pool), plans_(std::move(plans)) {
  for (int32_t l = 0; l < n_layers; ++l) {
    const kernels::ExpertShape& s = store.shape(l);
    bool seen = false;
    for (const int32_t d : distinct_layers_) {
      seen |= store.shape(d).weight_type == s.weight_type && store.shape(d).down_type == s.down_type;
    }
    if (!seen) distinct_layers_.push_back(l);
  }
  expert_offsets_.resize(static_cast<size_t>(n_experts) + 1);
  kernel_scratch_ = std::make_unique<kernels::KernelScratch[]>(static_cast<size_t>(pool.size()));
  active_experts_.reserve(static_cast<size_t>(n_experts));
  prepared_offset_.resize(static_cast<size_t>(n_experts));
  prepare_jobs_.reserve(static_cast<size_t>(n_experts) + 1);
  expert_base_.resize(static_cast<size_t>(n_experts));
  cached_ids_.resize(static_cast<size_t>(n_experts));
  cached_index_.resize(static_cast<size_t>(n_experts));
  cached_bases_.resize(static_cast<size_t>(n_experts));
  speculated_.resize(static_cast<size_t>(n_experts));
  spec_mark_.resize(static_cast<size_t>(n_experts));
}

void Engine::set_plan(int32_t layer, const kernels::KernelPlan& plan) {
  check_layer(layer);
  std::lock_guard<FairMutex> lock(call_mutex_);
  plans_[static_cast<size_t>(layer)] = plan;
}

void Engine::set_router(const RouterDesc& desc) {
  std::lock_guard<FairMutex> lock(call_mutex_);
  router_ = RouterRule(desc, n_experts_);
  // Router weights are f32 and computed in fp32 whatever the experts' type:
  // the choice of experts should not depend on the weight format.
  router_plan_ = kernels::plan_kernels(plans_[0].isa, store_.router_shape(), kernels::PrefillPrecision::kExact);
}

// Grows the per-token scratch (router logits, shared expert) to `tokens`.
void Engine::reserve_tokens_locked(int32_t tokens) {
  const size_t T = static_cast<size_t>(tokens);
  if (identity_.size() < T) {
    const size_t old = identity_.size();
    identity_.resize(T);
    for (size_t t = old; t < T; ++t) identity_[t] = static_cast<int32_t>(t);
    ones_.assign(T, 1.0f);
  }
  if (has_router()) {
    const size_t slots = T * static_cast<size_t>(router_.top_k());
    if (logits_.size() < T * static_cast<size_t>(n_experts_)) logits_.resize(T * static_cast<size_t>(n_experts_));
    if (blob_ids_.size() < slots) {
      blob_ids_.resize(slots);
      blob_weights_.resize(slots);
    }
  }
  const int32_t Fs = store_.shared_shape().d_ff;
  if (Fs > 0) {
    if (shared_scale_.size() < T) shared_scale_.resize(T);
    const size_t need = T * static_cast<size_t>(round_up(Fs, 16));
    if (shared_hidden_.size() < need) shared_hidden_.resize(need);
  }
}

void Engine::check_layer(int32_t layer) const {
  if (layer < 0 || layer >= n_layers_) {
    fail(Status::kInvalidArgument, "layer " + std::to_string(layer) +
                                           " is out of range [0, " + std::to_string(n_layers_) + ")");
  }
}

void Engine::route_locked(int32_t layer, int32_t n_tokens, const float* input, int threads, int32_t* ids,
                          float* weights) {
  reserve_tokens_locked(n_tokens);
  const int32_t E = n_experts_;
  const kernels::ExpertShape& rs = store_.router_shape();
  const size_t T = static_cast<size_t>(n_tokens);
  std::fill(logits_.begin(), logits_.begin() + static_cast<std::ptrdiff_t>(T * static_cast<size_t>(E)), 0.0f);
  // logits[t][e] = router_e . x_t: the router is the "down" block of an
  // expert with E output rows, so the down kernels compute it, split over
  // rows of E.
  const kernels::KernelTable& table = router_plan_.pick(n_tokens);
  if (static_cast<double>(T) * E * rs.d_ff < 262144.0) threads = 1;
  const int32_t rows = rows_per_item(E, threads, E);
  const uint8_t* w = store_.router(layer);
  pool_.parallel_for((E + rows - 1) / rows, threads, [&](int64_t item, int thread) {
    kernels::KernelScratch* const scratch = &kernel_scratch_[static_cast<size_t>(thread)];
    const int32_t e0 = static_cast<int32_t>(item) * rows;
    table.down(rs, w, input, static_cast<size_t>(rs.d_ff), identity_.data(), ones_.data(), n_tokens, e0,
               std::min(E, e0 + rows), logits_.data(), static_cast<size_t>(E), scratch);
  });
  const float* bias = store_.router_bias(layer);
  const size_t k = static_cast<size_t>(router_.top_k());
  for (size_t t = 0; t < T; ++t) {
    router_.select(logits_.data() + t * static_cast<size_t>(E), bias, ids + t * k, weights + t * k);
  }
}

void Engine::route(int32_t layer, int32_t n_tokens, const float* input, int32_t* ids, float* weights, int threads) {
  check_layer(layer);
  if (!has_router()) fail(Status::kInvalidArgument, "this model has no built-in router");
  if (n_tokens == 0) return;
  std::lock_guard<FairMutex> lock(call_mutex_);
  if (threads <= 0 || threads > pool_.size()) threads = pool_.size();
  reserve_tokens_locked(n_tokens);  // before taking blob_ids_'s pointer
  route_locked(layer, n_tokens, input, threads, blob_ids_.data(), blob_weights_.data());
  const size_t slots = static_cast<size_t>(n_tokens) * static_cast<size_t>(router_.top_k());
  std::copy(blob_ids_.begin(), blob_ids_.begin() + static_cast<std::ptrdiff_t>(slots), ids);
  std::copy(blob_weights_.begin(), blob_weights_.begin() + static_cast<std::ptrdiff_t>(slots), weights);
}

// s[t] = sigmoid(shared_gate . x_t) (Qwen2-MoE), or 1 without a gate.
void Engine::compute_shared_scale(const InferArgs& a) {
  const float* g = store_.shared_gate(a.layer);
  const size_t D = static_cast<size_t>(store_.shape().d_model);
  for (int32_t t = 0; t < a.n_tokens; ++t) {
    if (g == nullptr) {
      shared_scale_[static_cast<size_t>(t)] = 1.0f;
      continue;
    }
    const float* x = a.input + static_cast<size_t>(t) * D;
    // Four partial sums: shorter dependency chains, and the compiler may
    // keep them in one vector.
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    size_t d = 0;
    for (; d + 4 <= D; d += 4) {
      for (size_t j = 0; j < 4; ++j) acc[j] += g[d + j] * x[d + j];
    }
    for (; d < D; ++d) acc[0] += g[d] * x[d];
    const float dot = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    shared_scale_[static_cast<size_t>(t)] = 1.0f / (1.0f + std::exp(-dot));
  }
}

void Engine::reserve(int32_t tokens, int32_t top_k) {
  std::lock_guard<FairMutex> lock(call_mutex_);
  const size_t slots = static_cast<size_t>(tokens) * static_cast<size_t>(top_k);
  const int32_t F = store_.shape().d_ff;
  const size_t ldh = static_cast<size_t>(round_up(F, 16));
  if (slot_token_.size() < slots) {
    slot_token_.resize(slots);
    slot_weight_.resize(slots);
  }
  if (blob_ids_.size() < slots) {
    blob_ids_.resize(slots);
    blob_weights_.resize(slots);
  }
  if (hidden_.size() < slots * ldh) hidden_.resize(slots * ldh);
  reserve_tokens_locked(tokens);
  const size_t prepared = prepared_bound(slots, tokens);
  if (prepared_.size() < prepared) prepared_.resize(prepared);
  // At most one phase-1 item per 16 rows of each active expert, and no
  // more experts are active than there are slots.
  const size_t active = std::min(static_cast<size_t>(n_experts_), slots);
  const size_t shared_rows = static_cast<size_t>(store_.shared_shape().d_ff);
  const size_t max_items = active * static_cast<size_t>((F + 15) / 16) + (shared_rows + 15) / 16;
  if (phase1_items_.capacity() < max_items) phase1_items_.reserve(max_items);
  reserve_kernel_scratch(tokens);
}

void Engine::reserve_kernel_scratch(int32_t tokens) {
  // An expert can get every token of a call; row ranges are at most a
  // whole matrix. Dimensions are the same in every layer, types may differ.
  const kernels::ExpertShape& router = store_.router_shape();
  const int32_t rows = std::max({store_.shape().d_model, store_.shape().d_ff, store_.shared_shape().d_ff, router.d_model});
  for (int t = 0; t < pool_.size(); ++t) {
    kernels::KernelScratch* scratch = &kernel_scratch_[static_cast<size_t>(t)];
    // A failed reservation is not an error: the kernels fall back to the
    // decode kernels when a call finds no scratch.
    // The decode table too: the block-format tables (ffn_quant.cpp) serve
    // every token count and keep their quantised activations there.
    for (const int32_t layer : distinct_layers_) {
      const kernels::KernelPlan& plan = plans_[static_cast<size_t>(layer)];
      const kernels::ExpertShape& shape = store_.shape(layer);
      const kernels::ExpertShape& shared = store_.shared_shape(layer);
      for (int i = -1; i < plan.prefill.count; ++i) {
        const kernels::KernelTable& table = i < 0 ? *plan.decode : *plan.prefill.tier[i].table;
        if (table.reserve == nullptr) continue;
        (void)table.reserve(shape, tokens, rows, scratch);
        if (shared.d_ff > 0) (void)table.reserve(shared, tokens, rows, scratch);
      }
    }
    if (has_router()) {
      for (int i = 0; i < router_plan_.prefill.count; ++i) {
        const kernels::KernelTable& table = *router_plan_.prefill.tier[i].table;
        if (table.reserve != nullptr) (void)table.reserve(router, tokens, rows, scratch);
      }
    }
  }
}

size_t Engine::prepared_bound(size_t slots, int32_t tokens) const {
  // Each region is rounded up to a cache line (at most 64 bytes more per
  // region); one region per active expert and one for the shared expert;
  // the larger of the two phases (the buffer is reused), of any layer.
  const size_t active = std::min(static_cast<size_t>(n_experts_), slots);
  const int32_t n = static_cast<int32_t>(std::min<size_t>(slots, INT32_MAX));
  size_t bound = 0;
  for (const int32_t layer : distinct_layers_) {
    const kernels::KernelPlan& plan = plans_[static_cast<size_t>(layer)];
    const kernels::ExpertShape& shape = store_.shape(layer);
    const kernels::ExpertShape& shared = store_.shared_shape(layer);
    for (int i = -1; i < plan.prefill.count; ++i) {
      const kernels::KernelTable& table = i < 0 ? *plan.decode : *plan.prefill.tier[i].table;
      if (table.prepared_bytes == nullptr || slots == 0) continue;
      for (const kernels::Phase phase : {kernels::Phase::kGateUp, kernels::Phase::kDown}) {
        size_t bytes = table.prepared_bytes(shape, phase, n) + active * (table.prepared_bytes(shape, phase, 1) + 64);
        if (shared.d_ff > 0 && tokens > 0) bytes += table.prepared_bytes(shared, phase, tokens) + 64;
        bound = std::max(bound, bytes);
      }
    }
  }
  return bound;
}

void Engine::prepare_inputs(kernels::Phase phase, const InferArgs& a, int threads, size_t i0, size_t i1, bool routed,
                            bool shared) {
  const kernels::ExpertShape& shape = store_.shape(a.layer);
  const kernels::ExpertShape& shared_shape = store_.shared_shape(a.layer);
  const bool has_shared = store_.shared_gate_up(a.layer) != nullptr;
  const bool up = phase == kernels::Phase::kGateUp;
  const size_t ldh = static_cast<size_t>(round_up(shape.d_ff, 16));
  const size_t ldh_s = static_cast<size_t>(round_up(shared_shape.d_ff, 16));
  size_t total = 0;
  prepare_jobs_.clear();
  auto plan = [&](int32_t active, const kernels::KernelTable& table, const kernels::ExpertShape& s, int32_t n) {
    const size_t bytes = table.prepared_bytes != nullptr ? table.prepared_bytes(s, phase, n) : 0;
    if (bytes == 0) return kNotPrepared;
    const size_t offset = total;
    total += (bytes + 63) / 64 * 64;
    prepare_jobs_.push_back({active, offset});
    return offset;
  };
  shared_prepared_offset_ =
      has_shared && shared ? plan(-1, table_for(a.layer, a.n_tokens), shared_shape, a.n_tokens) : kNotPrepared;
  for (size_t i = i0; i < i1; ++i) {
    const int32_t e = active_experts_[i];
    const int32_t n = expert_offsets_[static_cast<size_t>(e) + 1] - expert_offsets_[static_cast<size_t>(e)];
    prepared_offset_[i] = routed ? plan(static_cast<int32_t>(i), table_for(a.layer, n), shape, n) : kNotPrepared;
  }
  if (prepare_jobs_.empty()) return;
  if (prepared_.size() < total) prepared_.resize(total);
  const size_t D = static_cast<size_t>(shape.d_model);
  pool_.parallel_for(static_cast<int64_t>(prepare_jobs_.size()), threads, [&](int64_t item, int /*thread*/) {
    const PrepareJob& job = prepare_jobs_[static_cast<size_t>(item)];
    uint8_t* out = prepared_.data() + job.offset;
    if (job.active < 0) {
      if (up) {
        table_for(a.layer, a.n_tokens).prepare(shared_shape, phase, a.input, D, nullptr, a.n_tokens, out);
      } else {
        table_for(a.layer, a.n_tokens).prepare(shared_shape, phase, shared_hidden_.data(), ldh_s, nullptr, a.n_tokens, out);
      }
      return;
    }
    const int32_t e = active_experts_[static_cast<size_t>(job.active)];
    const int32_t begin = expert_offsets_[static_cast<size_t>(e)];
    const int32_t n = expert_offsets_[static_cast<size_t>(e) + 1] - begin;
    if (up) {
      table_for(a.layer, n).prepare(shape, phase, a.input, D, slot_token_.data() + begin, n, out);
    } else {
      table_for(a.layer, n).prepare(shape, phase, hidden_.data() + static_cast<size_t>(begin) * ldh, ldh, nullptr, n, out);
    }
  });
}

void Engine::bucket(const InferArgs& a) {
  const size_t slots = static_cast<size_t>(a.n_tokens) * static_cast<size_t>(a.top_k);
  std::fill(expert_offsets_.begin(), expert_offsets_.end(), 0);
  // Count, validating every id before anything is written to the output.
  for (size_t s = 0; s < slots; ++s) {
    const int32_t e = a.expert_ids[s];
    if (e == -1) continue;
    if (e < 0 || e >= n_experts_) {
      fail(Status::kInvalidArgument,
           "expert_ids[" + std::to_string(s) + "] (token " + std::to_string(s / a.top_k) +
               ", slot " + std::to_string(s % a.top_k) + ") = " + std::to_string(e) +
               " is out of range [0, " + std::to_string(n_experts_) + ") (-1 means no expert)");
    }
    // Another process's expert (expert parallelism) adds nothing here.
    if (!store_.local(a.layer, e)) continue;
    ++expert_offsets_[static_cast<size_t>(e) + 1];
  }
  active_experts_.clear();
  for (int32_t e = 0; e < n_experts_; ++e) {
    if (expert_offsets_[static_cast<size_t>(e) + 1] != 0) active_experts_.push_back(e);
    expert_offsets_[static_cast<size_t>(e) + 1] += expert_offsets_[static_cast<size_t>(e)];
  }
  const size_t used = static_cast<size_t>(expert_offsets_[static_cast<size_t>(n_experts_)]);
  if (slot_token_.size() < used) {
    slot_token_.resize(used);
    slot_weight_.resize(used);
  }
  // Stable fill: within an expert, slots stay in token order, so results are
  // reproducible for a given routing.
  for (size_t s = 0; s < slots; ++s) {
    const int32_t e = a.expert_ids[s];
    if (e == -1 || !store_.local(a.layer, e)) continue;
    const int32_t at = expert_offsets_[static_cast<size_t>(e)]++;
    slot_token_[static_cast<size_t>(at)] = static_cast<int32_t>(s / static_cast<size_t>(a.top_k));
    slot_weight_[static_cast<size_t>(at)] = a.expert_weights[s];
  }
  // The fill advanced each offset to its end; shift back to starts.
  for (int32_t e = n_experts_; e > 0; --e) {
    expert_offsets_[static_cast<size_t>(e)] = expert_offsets_[static_cast<size_t>(e) - 1];
  }
  expert_offsets_[0] = 0;
}

template <class RunExperts>
void Engine::run_cached(const InferArgs& a, const RunExperts& run_experts) {
  const size_t n_active = active_experts_.size();
  cache_->score_prediction(a.layer, active_experts_.data(), static_cast<int32_t>(n_active));
  if (n_active == 0) {  // the shared expert alone
    run_experts(0, 0, true, true);
    return;
  }
  // The experts the cache serves (swapped-in ones live in the store) into
  // cached_ids_, their places in active_experts_ into cached_index_.
  size_t n_cached = 0;
  for (size_t i = 0; i < n_active; ++i) {
    const int32_t e = active_experts_[i];
    if (const uint8_t* p = store_.packed_expert(a.layer, e)) {
      expert_base_[i] = p;
      continue;
    }
    cached_index_[n_cached] = static_cast<int32_t>(i);
    cached_ids_[n_cached++] = e;
  }
  // The call streams through the pool: up to a pool's worth of its experts
  // pinned at once (reading or resident); each run of leading experts that
  // has landed is computed, released, and its slots start the next ones'
  // reads. So compute overlaps the reads that remain, and any budget of one
  // expert and up serves any call. Passes go in ascending expert order, so
  // the sums are those of one pass over all experts.
  const size_t window = std::min(n_cached, static_cast<size_t>(cache_->slots()));
  struct Pinned {  // [released, begun) of cached_ids_
    ExpertCache* cache;
    int32_t layer;
    const int32_t* ids;
    size_t released = 0;
    size_t begun = 0;
    ~Pinned() {
      if (begun > released) cache->release(layer, ids + released, static_cast<int32_t>(begun - released));
    }
  } pinned{cache_, a.layer, cached_ids_.data()};
  cache_->begin(a.layer, cached_ids_.data(), static_cast<int32_t>(window));
  pinned.begun = window;
  if (window == n_cached && n_speculated_ > 0) {
    // The whole call pinned (decode): the next layer's predicted experts
    // load while this one computes.
    cache_->predict(a.layer + 1, speculated_.data(), n_speculated_);
    cache_->prefetch(a.layer + 1, speculated_.data(), n_speculated_);
  }
  size_t computed = 0;  // of active_experts_
  while (computed < n_active) {
    const size_t c0 = pinned.released;
    size_t ready = 0;
    if (c0 < n_cached) {
      ready = static_cast<size_t>(cache_->wait_ready(a.layer, cached_ids_.data() + c0,
                                                     static_cast<int32_t>(pinned.begun - c0), cached_bases_.data() + c0));
      for (size_t j = c0; j < c0 + ready; ++j) expert_base_[static_cast<size_t>(cached_index_[j])] = cached_bases_[j];
    }
    const size_t end = c0 + ready < n_cached ? static_cast<size_t>(cached_index_[c0 + ready]) : n_active;
    run_experts(computed, end, computed == 0, end == n_active);
    computed = end;
    if (ready == 0) continue;
    cache_->release(a.layer, cached_ids_.data() + c0, static_cast<int32_t>(ready));
    pinned.released += ready;
    const size_t more = std::min(ready, n_cached - pinned.begun);
    if (more > 0) {
      cache_->begin(a.layer, cached_ids_.data() + pinned.begun, static_cast<int32_t>(more));
      pinned.begun += more;
    }
  }
}

void Engine::run_locked(const InferArgs& a) {
  bucket(a);
  const kernels::ExpertShape& shape = store_.shape(a.layer);
  const int32_t D = shape.d_model;
  const int32_t F = shape.d_ff;
  int threads = (a.threads <= 0 || a.threads > pool_.size()) ? pool_.size() : a.threads;
  const size_t ldh = static_cast<size_t>(round_up(F, 16));
  const size_t slots = static_cast<size_t>(expert_offsets_[static_cast<size_t>(n_experts_)]);
  // Handing work to another thread costs a few microseconds (more when the
  // core is busy with something else); a call this small finishes sooner on
  // the caller alone.
  const kernels::ExpertShape& shared_shape = store_.shared_shape(a.layer);
  const uint8_t* shared_gate_up = store_.shared_gate_up(a.layer);
  const int32_t Fs = shared_gate_up != nullptr ? shared_shape.d_ff : 0;
  const size_t ldh_s = static_cast<size_t>(round_up(Fs, 16));
  constexpr double kSingleThreadMacs = 262144.0;
  if ((static_cast<double>(slots) * F + static_cast<double>(a.n_tokens) * Fs) * 3.0 * D < kSingleThreadMacs) {
    threads = 1;
  }

  if (active_experts_.empty() && Fs == 0) {
    std::fill(a.output, a.output + static_cast<size_t>(a.n_tokens) * static_cast<size_t>(D), 0.0f);
    return;
  }
  if (hidden_.size() < slots * ldh) hidden_.resize(slots * ldh);
  if (Fs > 0) {
    reserve_tokens_locked(a.n_tokens);
    compute_shared_scale(a);
  }

  // The prefill kernels convert the activations of a call's tokens once per
  // kernel call, a cost of the same order as their tile math per row block;
  // so when they run, phase 1's items are made coarse (about 8 per thread)
  // and each call covers many rows. The decode kernels have no such cost and
  // prefer fine items for balance in phase 1 (one expert's rows each).
  // Phase 2's items run every expert over their rows of d_model, so a fine
  // item reads short pieces of each expert's down matrix: each piece starts
  // a new stream the prefetches have not reached and ends with prefetches of
  // rows it will not read. Both kinds run 2 items per thread there (at 64
  // rows, 16 per thread, decode read 0.88-0.91x as fast on Zen 5: colibri
  // bench --tokens 1, olmoe and qwen3-moe q4_K).
  int32_t max_tokens = 0;
  for (const int32_t e : active_experts_) {
    max_tokens = std::max(max_tokens, expert_offsets_[static_cast<size_t>(e) + 1] - expert_offsets_[static_cast<size_t>(e)]);
  }
  if (Fs > 0) max_tokens = std::max(max_tokens, a.n_tokens);
  const kernels::PrefillTiers& tiers = plans_[static_cast<size_t>(a.layer)].prefill;
  const bool coarse = tiers.count > 0 && max_tokens >= tiers.tier[0].min_tokens;

  // Phase 1: (expert, block of d_ff rows), the shared expert's blocks first
  // (it is the longest job when present). Sized by the experts of each
  // run_experts pass, so a pass of a few experts (a call streaming through
  // the cache) still spreads over every thread.
  const auto phase1_rows = [&](int64_t experts, int32_t f_shared) {
    const int64_t jobs = experts + (f_shared > 0 ? 1 : 0);
    if (!coarse) return rows_per_item(experts * F + f_shared, threads, std::max(F, f_shared));
    const int64_t splits = std::max<int64_t>(1, (8LL * threads + jobs - 1) / jobs);
    return round_up(static_cast<int32_t>((std::max(F, f_shared) + splits - 1) / splits), 16);
  };
  const int32_t d_rows = std::min(D, round_up((D + 2 * threads - 1) / (2 * threads), 16));
  const bool several_blocks = d_rows < D;

  // Experts [i0, i1) of active_experts_, their packed bytes in
  // expert_base_[i]. The first pass also zeroes the output and runs the
  // shared expert's phase 1, the last its phase 2; passes go in ascending
  // expert order, so the sums are the same as in one pass.
  const auto run_experts = [&](size_t i0, size_t i1, bool first, bool last) {
    const int32_t f_shared = first ? Fs : 0;
    const int32_t f_rows = phase1_rows(static_cast<int64_t>(i1 - i0), f_shared);
    phase1_items_.clear();
    for (int32_t f = 0; f < f_shared; f += f_rows) phase1_items_.push_back({-1, f});
    for (size_t i = i0; i < i1; ++i) {
      for (int32_t f = 0; f < F; f += f_rows) phase1_items_.push_back({static_cast<int32_t>(i), f});
    }
    // The gathered inputs in each table's own layout, once per expert, where
    // an expert spans more than one item (else its one item converts them).
    prepare_inputs(kernels::Phase::kGateUp, a, threads, i0, i1, F > f_rows, f_shared > f_rows);
    pool_.parallel_for(static_cast<int64_t>(phase1_items_.size()), threads, [&](int64_t item, int thread) {
      kernels::KernelScratch* const scratch = &kernel_scratch_[static_cast<size_t>(thread)];
      const Phase1Item& it = phase1_items_[static_cast<size_t>(item)];
      if (it.active < 0) {
        const kernels::KernelTable& table = table_for(a.layer, a.n_tokens);
        const int32_t f_end = std::min(Fs, it.f_begin + f_rows);
        if (shared_prepared_offset_ != kNotPrepared) {
          table.gate_up_prepared(shared_shape, shared_gate_up, a.input, static_cast<size_t>(D), identity_.data(),
                                 prepared_.data() + shared_prepared_offset_, a.n_tokens, it.f_begin, f_end,
                                 shared_hidden_.data(), ldh_s, scratch);
        } else {
          table.gate_up(shared_shape, shared_gate_up, a.input, static_cast<size_t>(D), identity_.data(), a.n_tokens,
                        it.f_begin, f_end, shared_hidden_.data(), ldh_s, scratch);
        }
        return;
      }
      const int32_t e = active_experts_[static_cast<size_t>(it.active)];
      const int32_t begin = expert_offsets_[static_cast<size_t>(e)];
      const int32_t n = expert_offsets_[static_cast<size_t>(e) + 1] - begin;
      const kernels::KernelTable& table = table_for(a.layer, n);
      const int32_t f_end = std::min(F, it.f_begin + f_rows);
      float* h = hidden_.data() + static_cast<size_t>(begin) * ldh;
      const size_t prepared_at = prepared_offset_[static_cast<size_t>(it.active)];
      const uint8_t* packed = expert_base_[static_cast<size_t>(it.active)];
      const kernels::ExpertShape expert_shape = store_.expert_shape_at(a.layer, packed);  // with its biases
      if (prepared_at != kNotPrepared) {
        table.gate_up_prepared(expert_shape, packed, a.input, static_cast<size_t>(D), slot_token_.data() + begin,
                               prepared_.data() + prepared_at, n, it.f_begin, f_end, h, ldh, scratch);
      } else {
        table.gate_up(expert_shape, packed, a.input, static_cast<size_t>(D), slot_token_.data() + begin, n,
                      it.f_begin, f_end, h, ldh, scratch);
      }
    });

    // Phase 2's inputs likewise; phase 2 runs every expert in every row
    // block, so whenever there is more than one block.
    const int32_t f_shared_down = last ? Fs : 0;
    prepare_inputs(kernels::Phase::kDown, a, threads, i0, i1, several_blocks, several_blocks && f_shared_down > 0);

    // Phase 2: blocks of d_model rows, every active expert in ascending order.
    const int64_t d_items = (D + d_rows - 1) / d_rows;
    pool_.parallel_for(d_items, threads, [&](int64_t item, int thread) {
      kernels::KernelScratch* const scratch = &kernel_scratch_[static_cast<size_t>(thread)];
      const int32_t d_begin = static_cast<int32_t>(item) * d_rows;
      const int32_t d_end = std::min(D, d_begin + d_rows);
      if (first) {
        for (int32_t t = 0; t < a.n_tokens; ++t) {
          float* row = a.output + static_cast<size_t>(t) * static_cast<size_t>(D);
          std::fill(row + d_begin, row + d_end, 0.0f);
        }
      }
      for (size_t i = i0; i < i1; ++i) {
        const int32_t e = active_experts_[i];
        const int32_t begin = expert_offsets_[static_cast<size_t>(e)];
        const int32_t n = expert_offsets_[static_cast<size_t>(e) + 1] - begin;
        const kernels::KernelTable& table = table_for(a.layer, n);
        const float* h = hidden_.data() + static_cast<size_t>(begin) * ldh;
        const uint8_t* packed = expert_base_[i];
        const uint8_t* down = packed + store_.gate_up_bytes(a.layer);
        const kernels::ExpertShape expert_shape = store_.expert_shape_at(a.layer, packed);
        if (prepared_offset_[i] != kNotPrepared) {
          table.down_prepared(expert_shape, down, h, ldh, prepared_.data() + prepared_offset_[i],
                              slot_token_.data() + begin, slot_weight_.data() + begin, n, d_begin, d_end, a.output,
                              static_cast<size_t>(D), scratch);
        } else {
          table.down(expert_shape, down, h, ldh, slot_token_.data() + begin, slot_weight_.data() + begin, n, d_begin,
                     d_end, a.output, static_cast<size_t>(D), scratch);
        }
      }
      if (f_shared_down > 0) {
        const kernels::KernelTable& table = table_for(a.layer, a.n_tokens);
        if (shared_prepared_offset_ != kNotPrepared) {
          table.down_prepared(shared_shape, store_.shared_down(a.layer), shared_hidden_.data(), ldh_s,
                              prepared_.data() + shared_prepared_offset_, identity_.data(), shared_scale_.data(),
                              a.n_tokens, d_begin, d_end, a.output, static_cast<size_t>(D), scratch);
        } else {
          table.down(shared_shape, store_.shared_down(a.layer), shared_hidden_.data(), ldh_s, identity_.data(),
                     shared_scale_.data(), a.n_tokens, d_begin, d_end, a.output, static_cast<size_t>(D), scratch);
        }
      }
    });
  };

  const size_t n_active = active_experts_.size();
  if (cache_ == nullptr) {
    for (size_t i = 0; i < n_active; ++i) expert_base_[i] = store_.packed_expert(a.layer, active_experts_[i]);
    run_experts(0, n_active, true, true);
    return;
  }
  run_cached(a, run_experts);
}

void Engine::speculate_locked(int32_t layer, int32_t n_tokens, const float* input, int threads) {
  n_speculated_ = 0;
  if (cache_ == nullptr || !speculate_ || layer + 1 >= n_layers_) return;
  const size_t slots = static_cast<size_t>(n_tokens) * static_cast<size_t>(router_.top_k());
  if (spec_ids_.size() < slots) {
    spec_ids_.resize(slots);
    spec_weights_.resize(slots);
  }
  route_locked(layer + 1, n_tokens, input, threads, spec_ids_.data(), spec_weights_.data());
  std::fill(spec_mark_.begin(), spec_mark_.end(), 0);
  for (size_t s = 0; s < slots; ++s) {
    const int32_t e = spec_ids_[s];
    if (e < 0 || spec_mark_[static_cast<size_t>(e)] != 0 || !store_.local(layer + 1, e)) continue;
    spec_mark_[static_cast<size_t>(e)] = 1;
    speculated_[static_cast<size_t>(n_speculated_++)] = e;
  }
  // A guess larger than half the pool would evict what this call and the
  // next need (a prefill touches most experts anyway).
  if (n_speculated_ > cache_->slots() / 2) n_speculated_ = 0;
}

void Engine::set_cache(ExpertCache* cache, bool speculate) {
  std::lock_guard<FairMutex> lock(call_mutex_);
  cache_ = cache;
  speculate_ = speculate;
}

void Engine::infer(const InferArgs& args) {
  check_layer(args.layer);
  if (args.n_tokens == 0) return;
  if (args.expert_ids == nullptr && !has_router()) {
    fail(Status::kInvalidArgument, "no routing given (expert_ids and routing_blob are NULL) and this model "
                                       "has no built-in router");
  }
  std::lock_guard<FairMutex> lock(call_mutex_);
  if (args.expert_ids != nullptr) {
    n_speculated_ = 0;
    run_locked(args);
    return;
  }
  int threads = (args.threads <= 0 || args.threads > pool_.size()) ? pool_.size() : args.threads;
  reserve_tokens_locked(args.n_tokens);  // before taking blob_ids_'s pointer
  route_locked(args.layer, args.n_tokens, args.input, threads, blob_ids_.data(), blob_weights_.data());
  speculate_locked(args.layer, args.n_tokens, args.input, threads);
  InferArgs a = args;
  a.top_k = router_.top_k();
  a.expert_ids = blob_ids_.data();
  a.expert_weights = blob_weights_.data();
  run_locked(a);
}

void Engine::infer_blob(const InferArgs& args, const void* blob, size_t blob_size) {
  check_layer(args.layer);
  const RoutingHeader header = parse_routing_header(blob, blob_size, n_experts_, "routing blob");
  if (header.n_tokens != args.n_tokens) {
    fail(Status::kInvalidArgument, "routing blob: has " + std::to_string(header.n_tokens) +
                                           " tokens but n_tokens is " + std::to_string(args.n_tokens));
  }
  if (args.n_tokens == 0) return;
  std::lock_guard<FairMutex> lock(call_mutex_);
  const size_t slots = static_cast<size_t>(header.n_tokens) * static_cast<size_t>(header.top_k);
  if (blob_ids_.size() < slots) {
    blob_ids_.resize(slots);
    blob_weights_.resize(slots);
  }
  decode_routing_payload(header, blob, blob_ids_.data(), blob_weights_.data(), "routing blob");
  n_speculated_ = 0;
  InferArgs a = args;
  a.top_k = header.top_k;
  a.expert_ids = blob_ids_.data();
  a.expert_weights = blob_weights_.data();
  run_locked(a);
}

}  // namespace colibri
