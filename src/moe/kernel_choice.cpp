#include "moe/kernel_choice.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "io/mapped_file.h"
#include "kernels/quant_dot.h"
#include "util/error.h"
#include "util/weight_format.h"

#ifndef COLIBRI_VERSION_STRING
#define COLIBRI_VERSION_STRING "unknown"
#endif

namespace colibri {

namespace {

using kernels::Isa;
using kernels::KernelPlan;
using kernels::KernelTable;

// Tokens per expert of the many-token measurement: below every format's AMX
// tier but well into the int8 kernels' many-token passes, where the levels
// differ most (docs/KERNELS.md).
constexpr int32_t kManyTokens = 16;
// From where the many-token winner takes over when it is not the decode one
// (the registry's kTokensMinTokens: up to 4 tokens the decode passes run).
constexpr int32_t kManyFromTokens = 5;
// The registry's choice stays unless another is at least this much faster:
// on a shared host the medians of tables running identical code (the amx
// and avx512 levels' at one token) still differ by up to 4%.
constexpr double kKeepMargin = 1.05;
// Rounds of every candidate, interleaved, as many as about 0.2 s allows.
constexpr int kMaxRounds = 31;
constexpr int kMinRounds = 5;
constexpr double kRoundsBudgetSeconds = 0.2;
constexpr const char* kCacheHeader = "# colibri kernel choices v1";

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::string(v) : std::string();
}

// One level's plan for a shape.
struct Candidate {
  Isa level;
  KernelPlan plan;
};

// The plan that decodes with decode_plan's table and runs many-token calls
// with many_plan's up to kManyTokens, the registry's tiers above that (a
// tier that started at or below kManyTokens, such as q2_k's AMX tier from
// 10 tokens, now from kManyTokens + 1: the measurement only says which is
// faster at kManyTokens).
KernelPlan compose(const KernelPlan& top, const KernelPlan& decode_plan, const KernelPlan& many_plan) {
  KernelPlan p = top;
  p.decode = decode_plan.decode;
  const KernelTable* many = &many_plan.pick(kManyTokens);
  if (many == &p.pick(kManyTokens)) return p;
  kernels::PrefillTiers tiers;
  tiers.tier[tiers.count++] = {many, kManyFromTokens};
  for (int i = 0; i < top.prefill.count; ++i) {
    kernels::PrefillTier t = top.prefill.tier[i];
    if (t.table == many) continue;
    if (tiers.count == 2) return p;  // no room: the registry's tiers stay
    t.min_tokens = std::max(t.min_tokens, kManyTokens + 1);
    tiers.tier[tiers.count++] = t;
  }
  p.prefill = tiers;
  return p;
}

// Median seconds of each plan's calls, rounds interleaved (the order
// rotating), as many rounds as about kRoundsBudgetSeconds allows.
std::vector<double> median_seconds(const std::vector<const KernelPlan*>& plans, int32_t tokens, const PlanTimer& time) {
  const size_t n = plans.size();
  std::vector<std::vector<double>> seconds(n);
  for (size_t c = 0; c < n; ++c) time(*plans[c], tokens);  // warm-up: scratch sized, code paged in
  double round = 0.0;
  for (size_t c = 0; c < n; ++c) round += time(*plans[c], tokens);
  const int rounds =
      std::clamp(static_cast<int>(kRoundsBudgetSeconds / std::max(round, 1e-9)), kMinRounds, kMaxRounds);
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < n; ++i) {
      const size_t c = (i + static_cast<size_t>(r)) % n;
      seconds[c].push_back(time(*plans[c], tokens));
    }
  }
  std::vector<double> out(n);
  for (size_t c = 0; c < n; ++c) {
    std::sort(seconds[c].begin(), seconds[c].end());
    out[c] = seconds[c][seconds[c].size() / 2];
  }
  return out;
}

// An MoE layer's calls, each on experts the previous calls did not touch.
class ExpertTimer {
 public:
  ExpertTimer(Engine& engine, int32_t layer, const kernels::ExpertShape& shape, const KernelChoiceRequest& r)
      : engine_(engine), layer_(layer), E_(r.n_experts), k_(std::min(r.top_k, r.n_experts)) {
    const size_t D = static_cast<size_t>(shape.d_model);
    x_.resize(static_cast<size_t>(kManyTokens) * D);
    y_.resize(x_.size());
    uint32_t state = 12345u;
    for (float& v : x_) {
      state = state * 1664525u + 1013904223u;
      v = static_cast<float>(static_cast<int32_t>(state >> 8) - (1 << 23)) / static_cast<float>(1 << 23);
    }
    ids_.resize(static_cast<size_t>(kManyTokens) * static_cast<size_t>(k_));
    weights_.assign(ids_.size(), 1.0f / static_cast<float>(k_));
  }

  double call(const KernelPlan& plan, int32_t tokens) {
    engine_.set_plan(layer_, plan);
    for (int32_t t = 0; t < tokens; ++t) {
      for (int32_t j = 0; j < k_; ++j) {
        ids_[static_cast<size_t>(t) * static_cast<size_t>(k_) + static_cast<size_t>(j)] = (cursor_ + j) % E_;
      }
    }
    cursor_ = (cursor_ + k_) % E_;
    InferArgs a;
    a.layer = layer_;
    a.n_tokens = tokens;
    a.input = x_.data();
    a.output = y_.data();
    a.top_k = k_;
    a.expert_ids = ids_.data();
    a.expert_weights = weights_.data();
    const auto t0 = std::chrono::steady_clock::now();
    engine_.infer(a);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

 private:
  Engine& engine_;
  int32_t layer_;
  int32_t E_;
  int32_t k_;
  int32_t cursor_ = 0;
  std::vector<float> x_, y_, weights_;
  std::vector<int32_t> ids_;
};

// The distinct tables among the candidates at `tokens` tokens per expert,
// first seen first (the registry's own level leads).
std::vector<size_t> distinct_at(const std::vector<Candidate>& candidates, int32_t tokens) {
  std::vector<size_t> out;
  for (size_t c = 0; c < candidates.size(); ++c) {
    const KernelTable* t = &candidates[c].plan.pick(tokens);
    bool seen = false;
    for (const size_t o : out) seen |= &candidates[o].plan.pick(tokens) == t;
    if (!seen) out.push_back(c);
  }
  return out;
}

std::string ms(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f ms", seconds * 1e3);
  return buf;
}

struct Remembered {
  Isa decode = Isa::kScalar;
  Isa many = Isa::kScalar;
  std::string timings;
};

// The cache file: a header line, then "key \t decode level \t many level \t
// timings" lines. Anything else and the whole file is ignored (and
// rewritten by the next measurement).
std::map<std::string, Remembered> read_cache(const std::string& path, std::string* warning) {
  std::map<std::string, Remembered> out;
  std::ifstream in(path);
  if (!in) return out;  // none yet
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (number == 1) {
      if (line != kCacheHeader) {
        *warning = "kernel choice cache " + path + ": line 1 is not \"" + kCacheHeader +
                   "\"; the file is ignored and will be rewritten";
        return {};
      }
      continue;
    }
    if (line.empty()) continue;
    std::vector<std::string> fields;
    std::stringstream ss(line);
    for (std::string f; std::getline(ss, f, '\t');) fields.push_back(f);
    Remembered r;
    if (fields.size() != 4 || fields[0].empty() || !kernels::parse_isa(fields[1].c_str(), &r.decode) ||
        !kernels::parse_isa(fields[2].c_str(), &r.many)) {
      *warning = "kernel choice cache " + path + ": line " + std::to_string(number) +
                 " is not \"key<TAB>level<TAB>level<TAB>timings\"; the file is ignored and will be rewritten";
      return {};
    }
    r.timings = fields[3];
    out[fields[0]] = r;
  }
  return out;
}

// The header and a line per entry, written through write_file_atomic (a
// temporary file and rename: a reader never sees half a file; concurrent
// writers each leave a whole one).
bool write_cache(const std::string& path, const std::map<std::string, Remembered>& entries, std::string* why) {
  std::string text = std::string(kCacheHeader) + "\n";
  for (const auto& [key, r] : entries) {
    text += key + "\t" + kernels::isa_name(r.decode) + "\t" + kernels::isa_name(r.many) + "\t" + r.timings + "\n";
  }
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  if (ec) {
    *why = "cannot create its directory: " + ec.message();
    return false;
  }
  try {
    write_file_atomic(path, text.data(), text.size());
  } catch (const Error& e) {
    *why = e.what();
    return false;
  }
  return true;
}

const char* precision_name(kernels::PrefillPrecision p) {
  switch (p) {
    case kernels::PrefillPrecision::kDefault:
      return "default";
    case kernels::PrefillPrecision::kExact:
      return "exact";
    case kernels::PrefillPrecision::kBf16:
      return "bf16";
  }
  return "?";
}

// Each level's plan from the request's down to avx2, the request's own first.
std::vector<Candidate> candidates_for(const KernelChoiceRequest& request, const kernels::ExpertShape& shape,
                                      const KernelPlan& top) {
  std::vector<Candidate> candidates;
  for (int l = static_cast<int>(request.isa); l >= static_cast<int>(Isa::kAvx2); --l) {
    const Isa level = static_cast<Isa>(l);
    if (!kernels::isa_supported(level)) continue;
    candidates.push_back(
        {level, l == static_cast<int>(request.isa) ? top : kernels::plan_kernels(level, shape, request.precision)});
  }
  return candidates;
}

// `what` tells apart the calls measured on one shape: "top-k 8" for an MoE
// layer, "linear" (and its groups) for a dense one.
std::string choice_key(const KernelChoiceRequest& request, const kernels::ExpertShape& shape, const std::string& what,
                       const std::vector<Candidate>& candidates) {
  std::string key = std::string("colibri ") + COLIBRI_VERSION_STRING + "|" + kernels::cpu_signature() +
                    "|threads " + std::to_string(request.threads) + "|level " + kernels::isa_name(request.isa) +
                    "|prefetch " + (kernels::far_prefetch_nta() ? "nta" : "l2") + "|precision " +
                    precision_name(request.precision) + "|" + weight_format(shape.weight_type).name +
                    "/" + weight_format(shape.down_type).name + " " + std::to_string(shape.d_model) + "x" +
                    std::to_string(shape.d_ff) + (shape.epilogue.plain() ? "" : " epilogue") + "|" + what + "|tables";
  // The integer-dot kernels under each level's table too: the same table
  // name runs other kernels where the library learns new ones (the AVX2
  // level's EVEX ymm kernels), and an old timing must not decide for them.
  for (const Candidate& c : candidates) {
    key += std::string(" ") + c.plan.decode->name;
    for (const WeightType t : {shape.weight_type, shape.down_type}) {
      if (const kernels::QuantDotKernels* q = kernels::quant_dot_kernels(t, c.level)) key += std::string(":") + q->name;
    }
  }
  return key;
}

// Choices measured in this process where no cache file keeps them (no cache
// directory, or one that cannot be written): colibri.torch.from_pretrained
// opens a model per block, which would otherwise measure every block.
struct Memo {
  std::mutex mutex;
  std::map<std::string, Remembered> choices;
  std::set<std::string> unwritable;  // cache paths a write failed on
};
Memo& memo() {
  static Memo m;
  return m;
}

}  // namespace

std::string remembered_kernel_choice(const KernelChoiceRequest& request, const kernels::ExpertShape& shape) {
  if (request.cache_path.empty()) return "";
  const KernelPlan top = kernels::plan_kernels(request.isa, shape, request.precision);
  const std::vector<Candidate> candidates = candidates_for(request, shape, top);
  std::string warning;
  const std::map<std::string, Remembered> cache = read_cache(request.cache_path, &warning);
  const auto hit = cache.find(choice_key(request, shape, "top-k " + std::to_string(request.top_k), candidates));
  if (hit == cache.end()) return "";
  return std::string("decode ") + kernels::isa_name(hit->second.decode) + " level, many tokens " +
         kernels::isa_name(hit->second.many) + " level (" + hit->second.timings + ")";
}

std::string kernel_choice_cache_path() {
  std::string dir = env("COLIBRI_CACHE_DIR");
  if (dir.empty()) {
    const std::string xdg = env("XDG_CACHE_HOME");
    const std::string home = env("HOME");
    if (!xdg.empty()) {
      dir = xdg + "/colibri";
    } else if (!home.empty()) {
      dir = home + "/.cache/colibri";
    }
  }
  return dir.empty() ? std::string() : dir + "/kernels.tsv";
}

bool kernel_choice_allowed_by_environment() {
  if (!env("COLIBRI_ISA").empty()) return false;
  const std::string tune = env("COLIBRI_TUNE");
  return tune != "0" && tune != "off" && tune != "false";
}

PlanChoice choose_plan_by_measurement(const KernelChoiceRequest& request, const kernels::ExpertShape& shape,
                                      const KernelPlan& top, const std::string& what, const PlanTimer& time) {
  PlanChoice out;
  out.plan = top;
  const std::vector<Candidate> candidates = candidates_for(request, shape, top);
  const std::vector<size_t> decode_set = distinct_at(candidates, 1);
  const std::vector<size_t> many_set = distinct_at(candidates, kManyTokens);
  if (decode_set.size() < 2 && many_set.size() < 2) return out;
  out.had_choice = true;
  const std::string key = choice_key(request, shape, what, candidates);

  std::map<std::string, Remembered> cache;
  if (!request.cache_path.empty()) cache = read_cache(request.cache_path, &out.warning);
  Remembered choice;
  bool from_cache = false, from_memo = false;
  bool use_memo;
  {
    std::lock_guard<std::mutex> lock(memo().mutex);
    use_memo = request.cache_path.empty() || memo().unwritable.count(request.cache_path) != 0;
    const auto m = use_memo ? memo().choices.find(key) : memo().choices.end();
    if (m != memo().choices.end()) {
      choice = m->second;
      from_memo = true;
    }
  }
  const auto hit = cache.find(key);
  const auto level_index = [&](Isa level) {
    for (size_t c = 0; c < candidates.size(); ++c) {
      if (candidates[c].level == level) return static_cast<int>(c);
    }
    return -1;
  };
  if (from_memo) {
    // measured by an earlier open of this process
  } else if (hit != cache.end() && level_index(hit->second.decode) >= 0 && level_index(hit->second.many) >= 0) {
    choice = hit->second;
    from_cache = true;
  } else {
    std::string timings;
    const auto pick = [&](const std::vector<size_t>& set, int32_t tokens, const std::string& label) {
      if (set.size() < 2) return candidates[set[0]].level;
      std::vector<const KernelPlan*> plans;
      plans.reserve(set.size());
      for (const size_t c : set) plans.push_back(&candidates[c].plan);
      const std::vector<double> t = median_seconds(plans, tokens, time);
      size_t best = 0;
      for (size_t i = 1; i < t.size(); ++i) {
        if (t[i] < t[best]) best = i;
      }
      if (t[0] <= t[best] * kKeepMargin) best = 0;
      if (!timings.empty()) timings += ", ";
      timings += label;
      for (size_t i = 0; i < t.size(); ++i) {
        timings += std::string(i == 0 ? " " : " / ") + candidates[set[i]].plan.pick(tokens).name + " " + ms(t[i]);
      }
      return candidates[set[best]].level;
    };
    const std::string per = what.rfind("top-k", 0) == 0 ? "/expert" : "";
    choice.decode = pick(decode_set, 1, "1 token" + per);
    choice.many = pick(many_set, kManyTokens, std::to_string(kManyTokens) + " tokens" + per);
    choice.timings = timings;
    {
      std::lock_guard<std::mutex> lock(memo().mutex);
      memo().choices[key] = choice;
    }
    if (!request.cache_path.empty()) {
      // Re-read just before writing: another layer or process may have added lines since.
      std::string ignored;
      cache = read_cache(request.cache_path, &ignored);
      cache[key] = choice;
      std::string why;
      if (!write_cache(request.cache_path, cache, &why)) {
        if (!out.warning.empty()) out.warning += "; ";
        out.warning += "kernel choice cache " + request.cache_path + " not written: " + why;
        std::lock_guard<std::mutex> lock(memo().mutex);
        memo().unwritable.insert(request.cache_path);
      }
    }
  }
  out.plan = compose(top, candidates[static_cast<size_t>(level_index(choice.decode))].plan,
                     candidates[static_cast<size_t>(level_index(choice.many))].plan);
  out.description = std::string("measured ") +
                    (from_cache  ? "earlier (" + request.cache_path + ")"
                     : from_memo ? std::string("earlier in this process")
                                 : std::string("now")) +
                    ", " + choice.timings;
  return out;
}

std::string choose_kernels_by_measurement(Engine& engine, const ExpertStore& store, int32_t n_layers,
                                          const KernelChoiceRequest& request, std::string* warnings) {
  const auto warn = [warnings](const std::string& w) {
    if (warnings == nullptr || w.empty()) return;
    if (!warnings->empty()) *warnings += "; ";
    *warnings += w;
  };
  std::vector<bool> done(static_cast<size_t>(n_layers), false);
  std::string description;
  for (int32_t rep = 0; rep < n_layers; ++rep) {
    if (done[static_cast<size_t>(rep)]) continue;
    const kernels::ExpertShape& shape = store.shape(rep);
    const KernelPlan top = engine.plan(rep);
    // The layers sharing this shape take the same choice.
    std::vector<int32_t> layers;
    for (int32_t l = rep; l < n_layers; ++l) {
      const kernels::ExpertShape& s = store.shape(l);
      if (s.weight_type == shape.weight_type && s.down_type == shape.down_type && s.d_model == shape.d_model &&
          s.d_ff == shape.d_ff && s.epilogue.plain() == shape.epilogue.plain()) {
        layers.push_back(l);
        done[static_cast<size_t>(l)] = true;
      }
    }
    if (!weight_format(shape.weight_type).quantized || !weight_format(shape.down_type).quantized) continue;
    bool resident = true;
    for (int32_t e = 0; e < request.n_experts && resident; ++e) resident = store.packed_expert(rep, e) != nullptr;
    if (!resident) continue;
    ExpertTimer timer(engine, rep, shape, request);
    const PlanChoice choice = choose_plan_by_measurement(
        request, shape, top, "top-k " + std::to_string(request.top_k),
        [&timer](const KernelPlan& plan, int32_t tokens) { return timer.call(plan, tokens); });
    engine.set_plan(rep, top);
    warn(choice.warning);
    if (!choice.had_choice) continue;
    for (const int32_t l : layers) engine.set_plan(l, choice.plan);
    if (!description.empty()) description += "; ";
    description += std::string(weight_format(shape.weight_type).name) + "/" + weight_format(shape.down_type).name +
                   " " + std::to_string(shape.d_model) + "x" + std::to_string(shape.d_ff) + ": " + choice.description;
  }
  return description;
}

}  // namespace colibri
