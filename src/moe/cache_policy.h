// Which resident expert an expert cache evicts (moe/expert_cache.h). Pure
// bookkeeping over integer keys (layer * n_experts + expert), no I/O, so
// tests and the trace simulator in colibri.routing check it against the
// same rules:
//
//  - kLru: the least recently used evictable key.
//  - kDecayedFrequency (default): a clock advances by one at every lookup
//    (before the lookup is scored); every key ever looked up keeps
//    (score, last) while not resident too, so an expert coming back is
//    recognised as hot. A lookup sets score = score * 0.5^((now - last) / H)
//    + 1 and last = now. The victim is the evictable key of smallest decayed
//    score score * 0.5^((now - last) / H), then older last, then smaller key.
//    H (the half-life, in lookups) defaults to 4x the cache's slots: an
//    expert used once per token of a k-of-E layer outlives a scan through
//    the other layers' cold experts, which is what LRU loses on MoE traces.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace colibri {

enum class EvictionPolicy { kDecayedFrequency, kLru };

class CachePolicy {
 public:
  CachePolicy() = default;
  CachePolicy(EvictionPolicy policy, size_t n_keys, double half_life)
      : policy_(policy), score_(n_keys, 0.0), last_(n_keys, 0), inv_half_life_(1.0 / half_life) {}

  EvictionPolicy policy() const { return policy_; }

  // A lookup of `key` (hit or miss).
  void touch(size_t key) {
    ++now_;
    score_[key] = decayed(key) + 1.0;
    last_[key] = now_;
  }

  // True when `a` should be evicted before `b`.
  bool before(size_t a, size_t b) const {
    if (policy_ == EvictionPolicy::kDecayedFrequency) {
      const double sa = decayed(a), sb = decayed(b);
      if (sa != sb) return sa < sb;
    }
    if (last_[a] != last_[b]) return last_[a] < last_[b];
    return a < b;
  }

 private:
  double decayed(size_t key) const {
    if (last_[key] == 0) return 0.0;
    return score_[key] * std::exp2(-static_cast<double>(now_ - last_[key]) * inv_half_life_);
  }

  EvictionPolicy policy_ = EvictionPolicy::kDecayedFrequency;
  std::vector<double> score_;
  std::vector<uint64_t> last_;
  uint64_t now_ = 0;
  double inv_half_life_ = 0.0;
};

}  // namespace colibri
