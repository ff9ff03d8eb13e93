#include "moe/engine.h"

#include <algorithm>
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
               const kernels::KernelTable& kernels)
    : store_(store), n_layers_(n_layers), n_experts_(n_experts), pool_(pool), kernels_(&kernels) {
  expert_offsets_.resize(static_cast<size_t>(n_experts) + 1);
  active_experts_.reserve(static_cast<size_t>(n_experts));
}

void Engine::reserve(int32_t tokens, int32_t top_k) {
  std::lock_guard<std::mutex> lock(call_mutex_);
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
  // At most one phase-1 item per 16 rows of each active expert, and no
  // more experts are active than there are slots.
  const size_t active = std::min(static_cast<size_t>(n_experts_), slots);
  const size_t max_items = active * static_cast<size_t>((F + 15) / 16);
  if (phase1_items_.capacity() < max_items) phase1_items_.reserve(max_items);
}

void Engine::bucket(const InferArgs& a) {
  const size_t slots = static_cast<size_t>(a.n_tokens) * static_cast<size_t>(a.top_k);
  std::fill(expert_offsets_.begin(), expert_offsets_.end(), 0);
  // Count, validating every id before anything is written to the output.
  for (size_t s = 0; s < slots; ++s) {
    const int32_t e = a.expert_ids[s];
    if (e == -1) continue;
    if (e < 0 || e >= n_experts_) {
      fail(COLIBRI_ERR_INVALID_ARGUMENT,
           "expert_ids[" + std::to_string(s) + "] (token " + std::to_string(s / a.top_k) +
               ", slot " + std::to_string(s % a.top_k) + ") = " + std::to_string(e) +
               " is out of range [0, " + std::to_string(n_experts_) + ") (-1 means no expert)");
    }
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
    if (e == -1) continue;
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

void Engine::run_locked(const InferArgs& a) {
  bucket(a);
  const kernels::ExpertShape& shape = store_.shape();
  const int32_t D = shape.d_model;
  const int32_t F = shape.d_ff;
  int threads = (a.threads <= 0 || a.threads > pool_.size()) ? pool_.size() : a.threads;
  const size_t ldh = static_cast<size_t>(round_up(F, 16));
  const size_t slots = static_cast<size_t>(expert_offsets_[static_cast<size_t>(n_experts_)]);
  // Handing work to another thread costs a few microseconds (more when the
  // core is busy with something else); a call this small finishes sooner on
  // the caller alone.
  constexpr double kSingleThreadMacs = 262144.0;
  if (static_cast<double>(slots) * 3.0 * D * F < kSingleThreadMacs) threads = 1;

  if (active_experts_.empty()) {
    std::fill(a.output, a.output + static_cast<size_t>(a.n_tokens) * static_cast<size_t>(D), 0.0f);
    return;
  }
  if (hidden_.size() < slots * ldh) hidden_.resize(slots * ldh);

  // The prefill kernels convert the activations of a call's tokens once per
  // kernel call, a cost of the same order as their tile math per row block;
  // so when they run, items are made coarse (about 8 per thread in phase 1,
  // 2 per thread in phase 2) and each call covers many rows. The decode
  // kernels have no such cost and prefer fine items for balance.
  int32_t max_tokens = 0;
  for (const int32_t e : active_experts_) {
    max_tokens = std::max(max_tokens, expert_offsets_[static_cast<size_t>(e) + 1] - expert_offsets_[static_cast<size_t>(e)]);
  }
  const bool coarse = prefill_ != nullptr && max_tokens >= prefill_min_tokens_;
  const int64_t active = static_cast<int64_t>(active_experts_.size());

  // Phase 1: (expert, block of d_ff rows).
  int32_t f_rows = rows_per_item(active * F, threads, F);
  if (coarse) {
    const int64_t splits = std::max<int64_t>(1, (8LL * threads + active - 1) / active);
    f_rows = std::min(F, round_up(static_cast<int32_t>((F + splits - 1) / splits), 16));
  }
  phase1_items_.clear();
  for (size_t i = 0; i < active_experts_.size(); ++i) {
    for (int32_t f = 0; f < F; f += f_rows) phase1_items_.push_back({static_cast<int32_t>(i), f});
  }
  pool_.parallel_for(static_cast<int64_t>(phase1_items_.size()), threads, [&](int64_t item, int) {
    const Phase1Item& it = phase1_items_[static_cast<size_t>(item)];
    const int32_t e = active_experts_[static_cast<size_t>(it.active)];
    const int32_t begin = expert_offsets_[static_cast<size_t>(e)];
    const int32_t n = expert_offsets_[static_cast<size_t>(e) + 1] - begin;
    table_for(n).gate_up(shape, store_.gate_up(a.layer, e), a.input, static_cast<size_t>(D),
              slot_token_.data() + begin, n, it.f_begin, std::min(F, it.f_begin + f_rows),
              hidden_.data() + static_cast<size_t>(begin) * ldh, ldh);
  });

  // Phase 2: blocks of d_model rows, every active expert in ascending order.
  int32_t d_rows = rows_per_item(D, threads, D);
  if (coarse) d_rows = std::min(D, round_up((D + 2 * threads - 1) / (2 * threads), 16));
  const int64_t d_items = (D + d_rows - 1) / d_rows;
  pool_.parallel_for(d_items, threads, [&](int64_t item, int) {
    const int32_t d_begin = static_cast<int32_t>(item) * d_rows;
    const int32_t d_end = std::min(D, d_begin + d_rows);
    for (int32_t t = 0; t < a.n_tokens; ++t) {
      float* row = a.output + static_cast<size_t>(t) * static_cast<size_t>(D);
      std::fill(row + d_begin, row + d_end, 0.0f);
    }
    for (const int32_t e : active_experts_) {
      const int32_t begin = expert_offsets_[static_cast<size_t>(e)];
      const int32_t n = expert_offsets_[static_cast<size_t>(e) + 1] - begin;
      table_for(n).down(shape, store_.down(a.layer, e), hidden_.data() + static_cast<size_t>(begin) * ldh, ldh,
             slot_token_.data() + begin, slot_weight_.data() + begin, n, d_begin, d_end, a.output,
             static_cast<size_t>(D));
    }
  });
}

void Engine::infer(const InferArgs& a) {
  if (a.layer < 0 || a.layer >= n_layers_) {
    fail(COLIBRI_ERR_INVALID_ARGUMENT, "layer " + std::to_string(a.layer) +
                                           " is out of range [0, " + std::to_string(n_layers_) + ")");
  }
  if (a.n_tokens == 0) return;
  std::lock_guard<std::mutex> lock(call_mutex_);
  run_locked(a);
}

void Engine::infer_blob(const InferArgs& args, const void* blob, size_t blob_size) {
  if (args.layer < 0 || args.layer >= n_layers_) {
    fail(COLIBRI_ERR_INVALID_ARGUMENT, "layer " + std::to_string(args.layer) +
                                           " is out of range [0, " + std::to_string(n_layers_) + ")");
  }
  const RoutingHeader header = parse_routing_header(blob, blob_size, n_experts_, "routing blob");
  if (header.n_tokens != args.n_tokens) {
    fail(COLIBRI_ERR_INVALID_ARGUMENT, "routing blob: has " + std::to_string(header.n_tokens) +
                                           " tokens but n_tokens is " + std::to_string(args.n_tokens));
  }
  if (args.n_tokens == 0) return;
  std::lock_guard<std::mutex> lock(call_mutex_);
  const size_t slots = static_cast<size_t>(header.n_tokens) * static_cast<size_t>(header.top_k);
  if (blob_ids_.size() < slots) {
    blob_ids_.resize(slots);
    blob_weights_.resize(slots);
  }
  decode_routing_payload(header, blob, blob_ids_.data(), blob_weights_.data(), "routing blob");
  InferArgs a = args;
  a.top_k = header.top_k;
  a.expert_ids = blob_ids_.data();
  a.expert_weights = blob_weights_.data();
  run_locked(a);
}

}  // namespace colibri
