// colibri infer | bench | demo
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "commands.h"
#include "common.h"
#include "io/manifest.h"
#include "lib/model_writer.h"
#include "lib/routing_trace.h"
#include "io/verify.h"
#include "util/error.h"

namespace colibri_cli {

namespace {

using Clock = std::chrono::steady_clock;

// ------------------------------------------------------------------ infer

struct InferArgs {
  std::string model, routing, input, output, precision = "default";
  int layer = 0, threads = 0;
  bool q4 = false;
  CacheFlags cache;
};

void run_infer(const InferArgs& a) {
  ModelHandle h;
  open_model(a.model, a.threads, true, &h, a.precision, a.cache);
  const colibri_model_info_t info = model_info(h);
  RoutingHandle r;
  const std::vector<uint8_t> x = read_file(a.input);
  const uint64_t row_bytes = static_cast<uint64_t>(info.d_model) * 4;
  int32_t T = 0;
  if (!a.routing.empty()) {
    check(colibri_routing_load(a.routing.c_str(), info.n_experts, a.q4 ? 1 : 0, &r.routing), "infer");
    T = colibri_routing_n_tokens(r.routing);
  } else if (info.router_family == COLIBRI_ROUTER_NONE) {
    throw CliError("infer: " + a.model + " has no built-in router: give --routing FILE");
  } else {
    // The model routes by itself; the input's size gives the token count.
    if (x.size() % row_bytes != 0 || x.size() / row_bytes > static_cast<uint64_t>(INT32_MAX)) {
      throw CliError(a.input + ": input is " + std::to_string(x.size()) + " bytes, not a whole number of rows of d_model*4 = " +
                     std::to_string(row_bytes));
    }
    T = static_cast<int32_t>(x.size() / row_bytes);
  }
  const uint64_t want = static_cast<uint64_t>(T) * row_bytes;
  if (x.size() != want) {
    throw CliError(a.input + ": input is " + std::to_string(x.size()) + " bytes, expected T*d_model*4 = " +
                   std::to_string(T) + "*" + std::to_string(info.d_model) + "*4 = " + std::to_string(want));
  }
  std::vector<float> in(static_cast<size_t>(T) * static_cast<size_t>(info.d_model));
  std::vector<float> out(in.size());
  if (!in.empty()) std::memcpy(in.data(), x.data(), x.size());
  colibri_infer_t req;
  colibri_infer_default(&req);
  req.layer = a.layer;
  req.n_tokens = T;
  req.input = in.data();
  req.output = out.data();
  if (r.routing != nullptr) {
    req.top_k = colibri_routing_top_k(r.routing);
    req.expert_ids = colibri_routing_expert_ids(r.routing);
    req.expert_weights = colibri_routing_expert_weights(r.routing);
  }
  check(colibri_infer(h.model, &req), "infer");
  write_file(a.output, out.data(), out.size() * sizeof(float));
}

// ------------------------------------------------------------------ bench

struct BenchResult {
  LatencySummary latency;
  double tokens_per_s = 0, gbytes_per_s = 0, gflop_per_s = 0;
  double bytes_per_call = 0, flop_per_call = 0;
  // With compare_threads: the calls at that thread count, and the median
  // over iterations of (its time / the main call's time) for the two calls
  // of each iteration.
  LatencySummary compare_latency;
  double pair_speedup = 0;
};

struct BenchSetup {
  int32_t T = 0, layer = 0, iters = 100, warmup = 5, threads = 0;
  // When > 0, every iteration also runs the call at this many threads,
  // back to back with the main one (order alternating): on a host whose
  // speed drifts with other tenants' load, only calls this close together
  // compare thread counts fairly.
  int32_t compare_threads = 0;
  const void* blob = nullptr;  // routing.bin path instead of arrays
  size_t blob_size = 0;
  std::vector<Routing> routings;  // cycled through, one per iteration
  std::function<void(int, double)> progress;
  SwapStress* swapper = nullptr;  // told of every call when set
};

BenchResult bench(const ModelHandle& h, const BenchSetup& s) {
  const colibri_model_info_t info = model_info(h);
  const size_t n = static_cast<size_t>(s.T) * static_cast<size_t>(info.d_model);
  std::vector<float> in(n), out(n);
  std::mt19937_64 rng(12345);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& v : in) v = u(rng);

  std::vector<double> bytes_per_routing, flop_per_routing;
  auto account = [&](int32_t k, const int32_t* ids) {
    const RoutingWork w = routing_work(info, s.T, k, ids);
    bytes_per_routing.push_back(w.bytes);
    flop_per_routing.push_back(w.flop);
  };
  RoutingHandle decoded;
  if (s.blob != nullptr) {
    check(colibri_routing_decode(s.blob, s.blob_size, info.n_experts, "routing", &decoded.routing), "bench");
    account(colibri_routing_top_k(decoded.routing), colibri_routing_expert_ids(decoded.routing));
  } else {
    for (const Routing& r : s.routings) account(r.k, r.ids.data());
  }

  std::vector<double> seconds, compare_seconds, ratios;
  double bytes = 0, flop = 0;
  for (int it = -s.warmup; it < s.iters; ++it) {
    const size_t which = static_cast<size_t>(it + s.warmup) % bytes_per_routing.size();
    colibri_infer_t req;
    colibri_infer_default(&req);
    req.layer = s.layer;
    req.n_tokens = s.T;
    req.input = in.data();
    req.output = out.data();
    if (s.blob != nullptr) {
      req.routing_blob = s.blob;
      req.routing_blob_size = s.blob_size;
    } else {
      req.top_k = s.routings[which].k;
      req.expert_ids = s.routings[which].ids.data();
      req.expert_weights = s.routings[which].weights.data();
    }
    auto timed_call = [&](int32_t threads) {
      req.n_threads = threads;
      const auto t0 = Clock::now();
      check(colibri_infer(h.model, &req), "bench");
      const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
      if (s.swapper != nullptr) s.swapper->request_done();
      return dt;
    };
    const bool compare = s.compare_threads > 0, compare_first = compare && (it & 1) != 0;
    double dt_compare = compare_first ? timed_call(s.compare_threads) : 0;
    const double dt = timed_call(s.threads);
    if (compare && !compare_first) dt_compare = timed_call(s.compare_threads);
    if (it >= 0) {
      seconds.push_back(dt);
      if (compare) {
        compare_seconds.push_back(dt_compare);
        ratios.push_back(dt_compare / dt);
      }
      bytes += bytes_per_routing[which];
      flop += flop_per_routing[which];
      if (s.progress) s.progress(it + 1, dt);
    }
  }
  BenchResult r;
  r.latency = summarize(seconds);
  if (s.compare_threads > 0) {
    r.compare_latency = summarize(compare_seconds);
    r.pair_speedup = percentile(ratios, 0.50);  // the same median as the latencies'
  }
  r.bytes_per_call = bytes / s.iters;
  r.flop_per_call = flop / s.iters;
  const double p50 = r.latency.p50_ms / 1e3;
  r.tokens_per_s = s.T / p50;
  r.gbytes_per_s = r.bytes_per_call / p50 / 1e9;
  r.gflop_per_s = r.flop_per_call / p50 / 1e9;
  return r;
}

void print_bench(const BenchResult& r, const char* isa) {
  std::printf("kernels      %s\n", isa);
  std::printf("latency ms   p50 %.3f  p90 %.3f  p99 %.3f  min %.3f  mean %.3f  max %.3f\n",
              r.latency.p50_ms, r.latency.p90_ms, r.latency.p99_ms, r.latency.min_ms,
              r.latency.mean_ms, r.latency.max_ms);
  std::printf("throughput   %.1f tokens/s\n", r.tokens_per_s);
  std::printf("weights      %.2f GB/s (%.1f MB of expert weights per call, at p50)\n", r.gbytes_per_s,
              r.bytes_per_call / 1e6);
  std::printf("compute      %.2f GFLOP/s (%.2f GFLOP per call, at p50)\n", r.gflop_per_s,
              r.flop_per_call / 1e9);
}

nlohmann::json bench_json(const BenchResult& r) {
  return {{"p50_ms", r.latency.p50_ms},     {"p90_ms", r.latency.p90_ms},
          {"p99_ms", r.latency.p99_ms},     {"min_ms", r.latency.min_ms},
          {"mean_ms", r.latency.mean_ms},   {"max_ms", r.latency.max_ms},
          {"tokens_per_s", r.tokens_per_s}, {"gbytes_per_s", r.gbytes_per_s},
          {"gflop_per_s", r.gflop_per_s},   {"bytes_per_call", r.bytes_per_call},
          {"flop_per_call", r.flop_per_call}};
}

struct BenchArgs {
  std::string model, routing, isa, precision = "default";
  int tokens = 0, top_k = 0, iters = 100, warmup = 5, threads = 0, layer = 0, swap_every = 0, compare_threads = 0;
  uint64_t seed = 1;
  bool json = false, no_verify = false;
  CacheFlags cache;
  std::string trace;  // replay a .ctrace instead
};

void set_isa(const std::string& isa) {
  if (isa.empty()) return;
  // Read once by the library when the first model opens.
  ::setenv("COLIBRI_ISA", isa.c_str(), 1);
}

// --trace: every step of a routing trace as one call, in order (decode
// steps of one token, prefill steps of many), weights 1/k; the first
// --warmup steps untimed. Decode tokens/s counts layer-0 steps of one
// token over the time of all one-token steps (one token through every
// layer), prefill likewise with its tokens.
void run_trace_bench(const BenchArgs& a, const ModelHandle& h, const colibri_model_info_t& info) {
  colibri::RoutingTrace t;
  try {
    t = colibri::read_routing_trace(a.trace);
  } catch (const colibri::Error& e) {
    throw CliError(e.what());
  }
  if (t.n_experts != info.n_experts || t.n_layers > info.n_layers) {
    throw CliError("bench: " + a.trace + " has " + std::to_string(t.n_layers) + " layers of " +
                   std::to_string(t.n_experts) + " experts; the model " + std::to_string(info.n_layers) + " of " +
                   std::to_string(info.n_experts));
  }
  std::mt19937_64 rng(a.seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> in, out;
  std::vector<float> weights;
  std::vector<double> decode_s, prefill_s;
  double decode_total = 0, prefill_total = 0;
  int64_t decode_tokens = 0, prefill_tokens = 0;
  colibri_stats_t before{};
  const size_t warmup = std::min(t.steps.size(), static_cast<size_t>(std::max(0, a.warmup)));
  for (size_t i = 0; i < t.steps.size(); ++i) {
    if (i == warmup) check(colibri_stats(h.model, &before), "bench");
    const colibri::TraceStep& st = t.steps[i];
    const size_t n = static_cast<size_t>(st.n_tokens) * static_cast<size_t>(info.d_model);
    if (in.size() < n) {
      in.resize(n);
      for (float& v : in) v = u(rng);
      out.resize(n);
    }
    weights.assign(st.ids.size(), 1.0f / static_cast<float>(t.top_k));
    colibri_infer_t c;
    colibri_infer_default(&c);
    c.layer = st.layer;
    c.n_tokens = st.n_tokens;
    c.input = in.data();
    c.output = out.data();
    c.top_k = t.top_k;
    c.expert_ids = st.ids.data();
    c.expert_weights = weights.data();
    c.n_threads = a.threads;
    const auto t0 = std::chrono::steady_clock::now();
    check(colibri_infer(h.model, &c), "bench: trace step " + std::to_string(i));
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i < warmup) continue;
    if (st.n_tokens == 1) {
      decode_s.push_back(dt);
      decode_total += dt;
      decode_tokens += st.layer == 0 ? 1 : 0;
    } else {
      prefill_s.push_back(dt);
      prefill_total += dt;
      prefill_tokens += st.layer == 0 ? st.n_tokens : 0;
    }
  }
  colibri_stats_t after{};
  check(colibri_stats(h.model, &after), "bench");
  const uint64_t hits = after.cache_hits - before.cache_hits, misses = after.cache_misses - before.cache_misses;
  const uint64_t bytes = after.bytes_read - before.bytes_read;
  const double wait = after.wait_seconds - before.wait_seconds;
  const LatencySummary d = summarize(decode_s), p = summarize(prefill_s);
  const double decode_tps = decode_total > 0 ? static_cast<double>(decode_tokens) / decode_total : 0.0;
  const double prefill_tps = prefill_total > 0 ? static_cast<double>(prefill_tokens) / prefill_total : 0.0;
  const double tokens = static_cast<double>(decode_tokens + prefill_tokens);
  if (a.json) {
    nlohmann::json doc;
    doc["model"] = a.model;
    doc["trace"] = a.trace;
    doc["steps"] = t.steps.size();
    doc["warmup_steps"] = warmup;
    doc["threads"] = info.n_threads;
    doc["kernels"] = colibri_model_kernels(h.model);
    doc["decode"] = {{"steps", decode_s.size()}, {"tokens", decode_tokens}, {"seconds", decode_total},
                     {"tokens_per_second", decode_tps}, {"step_p50_ms", d.p50_ms}, {"step_p99_ms", d.p99_ms},
                     {"step_mean_ms", d.mean_ms}};
    doc["prefill"] = {{"steps", prefill_s.size()}, {"tokens", prefill_tokens}, {"seconds", prefill_total},
                      {"tokens_per_second", prefill_tps}, {"step_p50_ms", p.p50_ms}, {"step_mean_ms", p.mean_ms}};
    doc["timed"] = {{"hits", hits}, {"misses", misses}, {"bytes_read", bytes}, {"wait_seconds", wait},
                    {"bytes_read_per_token", tokens > 0 ? static_cast<double>(bytes) / tokens : 0.0}};
    doc["cache"] = nlohmann::json::parse(cache_stats_json(after));
    std::printf("%s\n", doc.dump(2).c_str());
    return;
  }
  std::printf("trace        %s: %zu steps (%zu untimed), %d threads, kernels %s\n", a.trace.c_str(), t.steps.size(),
              warmup, info.n_threads, colibri_model_kernels(h.model));
  if (!decode_s.empty()) {
    std::printf("decode       %.2f tokens/s (%lld tokens through %d layers); per step p50 %.3f ms, mean %.3f ms\n",
                decode_tps, static_cast<long long>(decode_tokens), t.n_layers, d.p50_ms, d.mean_ms);
  }
  if (!prefill_s.empty()) {
    std::printf("prefill      %.1f tokens/s (%lld tokens); per step p50 %.3f ms\n", prefill_tps,
                static_cast<long long>(prefill_tokens), p.p50_ms);
  }
  if (after.cache_slots > 0) {
    std::printf("timed        %llu hits, %llu misses (%.1f%%), %s read (%s per token), waited %.3f s\n",
                static_cast<unsigned long long>(hits), static_cast<unsigned long long>(misses),
                hits + misses > 0 ? 100.0 * static_cast<double>(hits) / static_cast<double>(hits + misses) : 0.0,
                human_bytes(bytes).c_str(), human_bytes(tokens > 0 ? static_cast<uint64_t>(bytes / tokens) : 0).c_str(),
                wait);
  }
  print_cache_stats(after);
}

void run_bench(const BenchArgs& a) {
  set_isa(a.isa);
  ModelHandle h;
  open_model(a.model, a.threads, !a.no_verify, &h, a.precision, a.cache);
  const colibri_model_info_t info = model_info(h);
  if (!a.trace.empty()) {
    run_trace_bench(a, h, info);
    return;
  }
  BenchSetup s;
  s.layer = a.layer;
  s.iters = a.iters;
  s.warmup = a.warmup;
  s.threads = a.threads;
  s.compare_threads = a.compare_threads;
  std::vector<uint8_t> blob;
  if (!a.routing.empty()) {
    RoutingHandle r;
    check(colibri_routing_load(a.routing.c_str(), info.n_experts, 0, &r.routing), "bench");
    s.T = colibri_routing_n_tokens(r.routing);
    Routing fixed;
    fixed.k = colibri_routing_top_k(r.routing);
    fixed.ids.assign(colibri_routing_expert_ids(r.routing), colibri_routing_expert_ids(r.routing) + s.T * fixed.k);
    fixed.weights.assign(colibri_routing_expert_weights(r.routing),
                         colibri_routing_expert_weights(r.routing) + s.T * fixed.k);
    s.routings.push_back(std::move(fixed));
  } else {
    if (a.tokens < 1 || a.top_k < 1) throw CliError("bench: give --routing FILE, or --tokens T and --top-k K");
    if (a.top_k > info.n_experts) {
      throw CliError("bench: --top-k " + std::to_string(a.top_k) + " exceeds the model's " +
                     std::to_string(info.n_experts) + " experts");
    }
    s.T = a.tokens;
    std::mt19937_64 rng(a.seed);
    // Several routings, cycled, so caches and branch predictors see varied
    // expert choices as in real decoding.
    for (int i = 0; i < 8; ++i) s.routings.push_back(random_routing(s.T, a.top_k, info.n_experts, rng));
  }
  // --swap-every N: the first routing's first expert is swapped (with its
  // own bytes) after every N calls, concurrently with the timed calls.
  std::unique_ptr<SwapStress> swapper;
  if (a.swap_every > 0) {
    const int32_t expert = s.routings[0].ids[0] >= 0 ? s.routings[0].ids[0] : 0;
    const colibri::Manifest m = colibri::load_manifest(a.model);
    swapper = std::make_unique<SwapStress>(h.model, a.layer, expert,
                                           read_file(a.model + "/" + m.expert_file(a.layer, expert)), info.dtype,
                                           a.swap_every);
    s.swapper = swapper.get();
  }
  const BenchResult r = bench(h, s);
  if (swapper) {
    swapper->stop();
    if (swapper->failures() > 0) throw CliError("bench: expert swap failed: " + swapper->first_error());
  }
  const char* isa = colibri_cpu_isa();
  const char* kernels = colibri_model_kernels(h.model);
  if (a.json) {
    nlohmann::json doc = bench_json(r);
    doc["model"] = a.model;
    doc["tokens"] = s.T;
    doc["iters"] = a.iters;
    doc["threads"] = info.n_threads;
    doc["isa"] = isa;
    doc["kernels"] = kernels;
    if (swapper) doc["swaps"] = swapper->swaps();
    colibri_stats_t stats;
    check(colibri_stats(h.model, &stats), "bench");
    doc["cache"] = nlohmann::json::parse(cache_stats_json(stats));
    if (a.compare_threads > 0) {
      doc["compare"] = {{"threads", a.compare_threads},
                        {"p50_ms", r.compare_latency.p50_ms},
                        {"p99_ms", r.compare_latency.p99_ms},
                        {"pair_speedup_median", r.pair_speedup}};
    }
    std::printf("%s\n", doc.dump(2).c_str());
  } else {
    std::printf("model        %s (%d experts, d_model %d, d_ff %d, %s), %d tokens, %d iterations, %d threads\n",
                a.model.c_str(), info.n_experts, info.d_model, info.d_ff, colibri_dtype_name(info.dtype),
                s.T, a.iters, info.n_threads);
    print_bench(r, kernels);
    colibri_stats_t stats;
    check(colibri_stats(h.model, &stats), "bench");
    print_cache_stats(stats);
    if (swapper) std::printf("swaps        %ld (expert swapped every %d calls, concurrently)\n", swapper->swaps(), a.swap_every);
    if (a.compare_threads > 0) {
      std::printf("compare      %d threads: p50 %.3f ms; each iteration's %d-thread call took %.2fx its %d-thread call "
                  "(median over iterations, calls back to back)\n",
                  a.compare_threads, r.compare_latency.p50_ms, a.compare_threads, r.pair_speedup, info.n_threads);
    }
  }
}

// ------------------------------------------------------------------- demo

struct DemoArgs {
  std::string cache_dir;
  int iters = 100, threads = 0;
};

std::string default_cache_dir() {
  if (const char* c = std::getenv("COLIBRI_CACHE_DIR"); c && *c) return c;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/colibri";
  if (const char* home = std::getenv("HOME"); home && *home) return std::string(home) + "/.cache/colibri";
  return "/tmp/colibri-cache";
}

bool model_ok(const std::string& dir) {
  try {
    colibri::verify_model_dir(dir, nullptr);
    return true;
  } catch (const colibri::Error&) {
    return false;
  }
}

void run_demo(const DemoArgs& a) {
  // The seed's demo: 16 experts, d_model 1024, d_ff 4096, f16; batch 8 x
  // seq_len 128 tokens, top-2.
  constexpr int kExperts = 16, kDModel = 1024, kDFF = 4096, kBatch = 8, kSeq = 128, kTopK = 2;
  const std::string root = a.cache_dir.empty() ? default_cache_dir() : a.cache_dir;
  const std::string dir = root + "/demo-e16-d1024-f4096-f16";
  try {
    colibri::make_directories(root);
    if (!model_ok(dir)) {
      std::printf("generating demo model in %s (once) ...\n", dir.c_str());
      std::fflush(stdout);
      colibri::ModelWriteSpec spec;
      spec.n_experts = kExperts;
      spec.d_model = kDModel;
      spec.d_ff = kDFF;
      spec.dtype = colibri::WeightType::kF16;
      colibri::write_random_model(dir, spec, 2024);
    }
  } catch (const colibri::Error& e) {
    throw CliError(std::string("demo: ") + e.what());
  }

  // Routing as PyTorch would export it: .route text, compiled to routing.bin.
  const int T = kBatch * kSeq;
  std::mt19937_64 rng(7);
  const Routing r = random_routing(T, kTopK, kExperts, rng);
  std::string text = "# demo routing: batch 8 x seq_len 128, top-2 of 16 experts\n";
  char line[128];
  for (int t = 0; t < T; ++t) {
    std::snprintf(line, sizeof line, "%d, %d, %d, %.6f, %.6f\n", t, r.ids[2 * t], r.ids[2 * t + 1],
                  static_cast<double>(r.weights[2 * t]), static_cast<double>(r.weights[2 * t + 1]));
    text += line;
  }
  const std::string route_path = dir + "/demo.route", bin_path = dir + "/routing.bin";
  write_file(route_path, text.data(), text.size());
  colibri_route_compile_options_t co;
  colibri_route_compile_options_default(&co);
  co.n_experts = kExperts;
  check(colibri_route_compile_file(route_path.c_str(), bin_path.c_str(), &co), "demo");
  const std::vector<uint8_t> blob = read_file(bin_path);

  ModelHandle h;
  open_model(dir, a.threads, true, &h);
  const colibri_model_info_t info = model_info(h);
  colibri_stats_t stats;
  check(colibri_stats(h.model, &stats), "demo");
  std::printf("model    %s\n", dir.c_str());
  std::printf("shape    %d experts, d_model %d, d_ff %d, f16; %d tokens (batch %d x seq %d), top-%d\n",
              kExperts, kDModel, kDFF, T, kBatch, kSeq, kTopK);
  std::printf("loader   %s packed, huge pages %s (%s), locked %s, load %.2f s\n",
              human_bytes(stats.bytes_mapped).c_str(), human_bytes(stats.bytes_huge_pages).c_str(),
              huge_page_kind_name(stats.huge_page_kind), human_bytes(stats.bytes_locked).c_str(),
              stats.load_seconds);
  std::printf("engine   %d threads, kernels: %s; routing from %s (%zu bytes)\n", info.n_threads,
              colibri_model_kernels(h.model),
              bin_path.c_str(), blob.size());
  std::fflush(stdout);

  BenchSetup s;
  s.T = T;
  s.iters = a.iters;
  s.warmup = 2;
  s.blob = blob.data();
  s.blob_size = blob.size();
  // On a terminal one line updated in place; otherwise (a log, a pipe) a
  // plain line at every quarter, so the log does not get a hundred
  // carriage-return updates on one line.
  const bool terminal = ::isatty(STDERR_FILENO) != 0;
  s.progress = [&, terminal](int done, double dt) {
    if (terminal) {
      std::fprintf(stderr, "\r  inference %3d/%d  %8.2f ms", done, a.iters, dt * 1e3);
      if (done == a.iters) std::fprintf(stderr, "\n");
    } else if (done == a.iters || done % std::max(1, a.iters / 4) == 0) {
      std::fprintf(stderr, "  inference %3d/%d  %8.2f ms\n", done, a.iters, dt * 1e3);
    }
  };
  const BenchResult b = bench(h, s);
  std::printf("\n| metric | value |\n|---|---|\n");
  std::printf("| p50 latency | %.2f ms |\n| p90 latency | %.2f ms |\n| p99 latency | %.2f ms |\n",
              b.latency.p50_ms, b.latency.p90_ms, b.latency.p99_ms);
  std::printf("| p99 / p50 | %.3f |\n", b.latency.p99_ms / b.latency.p50_ms);
  std::printf("| throughput | %.0f tokens/s |\n", b.tokens_per_s);
  std::printf("| compute | %.1f GFLOP/s |\n", b.gflop_per_s);
  std::printf("| huge pages | %s (%s) |\n| locked | %s of %s |\n", human_bytes(stats.bytes_huge_pages).c_str(),
              huge_page_kind_name(stats.huge_page_kind), human_bytes(stats.bytes_locked).c_str(),
              human_bytes(stats.bytes_mapped).c_str());
}

}  // namespace

void add_cache_flags(CLI::App* c, CacheFlags* f) {
  c->add_option("--max-resident", f->max_resident,
                "Memory budget for expert weights: bytes (K, M, G, T suffixes, x1024) or a percentage of the "
                "experts such as 25%; the rest stay on disk and are read on demand (docs/CACHE.md)");
  c->add_option("--eviction", f->eviction, "Under a budget: freq (decayed frequency, default) or lru")
      ->check(CLI::IsMember({"freq", "lru"}));
  c->add_option("--io-threads", f->io_threads,
                "Under a budget: reader threads (0 = enough for about 128 MiB in flight, 2 to 8)")
      ->check(CLI::Range(0, 64));
  c->add_option("--io-engine", f->io_engine,
                "Under a budget: pread (default; one expert in flight per reader) or io_uring (each expert's "
                "reads in 2 MiB pieces, all in flight)")
      ->check(CLI::IsMember({"pread", "io_uring"}));
  c->add_flag("--buffered-io", f->buffered_io, "Under a budget: read through the page cache, not O_DIRECT");
  c->add_flag("--no-speculate", f->no_speculate,
              "Under a budget: do not prefetch the next layer's experts its router predicts");
  c->add_flag("--no-tune", f->no_tune,
              "Keep the registry's kernels: do not time the instruction-set levels on the experts at open "
              "(docs/KERNELS.md)");
}

void add_run_commands(CLI::App& app) {
  auto ia = std::make_shared<InferArgs>();
  CLI::App* infer = app.add_subcommand("infer", "Run one MoE layer on raw float32 input");
  infer->add_option("--model", ia->model, "Model directory or GGUF file")->required();
  infer->add_option("--routing", ia->routing,
                    "routing.bin or .route file (optional for a model with a built-in router)");
  infer->add_option("--input", ia->input, "Raw little-endian float32 [T][d_model]")->required();
  infer->add_option("--output", ia->output, "Output file, same form")->required();
  infer->add_option("--layer", ia->layer, "Layer index")->check(CLI::NonNegativeNumber);
  infer->add_option("--threads", ia->threads, "Threads (0 = one per core)")->check(CLI::NonNegativeNumber);
  infer->add_flag("--q4-weights", ia->q4, "For .route text: weights are 4-bit codes");
  infer->add_option("--precision", ia->precision, kPrecisionHelp)->check(CLI::IsMember(precision_names()));
  add_cache_flags(infer, &ia->cache);
  infer->callback([ia] { run_infer(*ia); });

  auto ba = std::make_shared<BenchArgs>();
  CLI::App* b = app.add_subcommand("bench", "Measure latency and throughput of one MoE layer");
  b->add_option("--model", ba->model, "Model directory or GGUF file")->required();
  auto* routing = b->add_option("--routing", ba->routing, "routing.bin or .route file");
  auto* tokens = b->add_option("--tokens", ba->tokens, "Tokens per call (random routing)")->check(CLI::Range(1, 1 << 24));
  routing->excludes(tokens);
  b->add_option("--top-k", ba->top_k, "Experts per token (random routing)")->check(CLI::Range(1, 65536));
  b->add_option("--seed", ba->seed, "Seed for random routing and input");
  b->add_option("--iters", ba->iters, "Timed iterations")->check(CLI::Range(1, 1000000));
  b->add_option("--warmup", ba->warmup, "Untimed iterations first")->check(CLI::Range(0, 1000000));
  b->add_option("--threads", ba->threads, "Threads (0 = one per core)")->check(CLI::NonNegativeNumber);
  b->add_option("--layer", ba->layer, "Layer index")->check(CLI::NonNegativeNumber);
  b->add_option("--isa", ba->isa, "Force a lower kernel level: scalar, avx2, avx512, amx (avx512 with AMX tiles for prefill)")
      ->check(CLI::IsMember({"scalar", "avx2", "avx512", "amx"}));
  b->add_option("--precision", ba->precision, kPrecisionHelp)->check(CLI::IsMember(precision_names()));
  b->add_flag("--no-verify", ba->no_verify, "Skip checksum verification at open");
  b->add_flag("--json", ba->json, "JSON output");
  b->add_option("--swap-every", ba->swap_every,
                "Stress: hot-swap an expert (with its own bytes) after every N calls, from another thread")
      ->check(CLI::NonNegativeNumber);
  b->add_option("--compare-threads", ba->compare_threads,
                "Also run every iteration at this many threads, back to back with the main call, and report the "
                "median per-iteration ratio")
      ->check(CLI::PositiveNumber);
  auto* trace = b->add_option("--trace", ba->trace,
                               "Replay a routing trace (.ctrace, docs/FORMAT.md): every step one call, in order");
  trace->excludes(routing);
  trace->excludes(tokens);
  add_cache_flags(b, &ba->cache);
  b->callback([ba] { run_bench(*ba); });

  auto da = std::make_shared<DemoArgs>();
  CLI::App* d = app.add_subcommand("demo", "The seed's demo: 16 experts, batch 8 x 128 tokens, top-2, 100 runs");
  d->add_option("--cache-dir", da->cache_dir, "Where the demo model is generated once");
  d->add_option("--iters", da->iters, "Inferences")->check(CLI::Range(1, 1000000));
  d->add_option("--threads", da->threads, "Threads (0 = one per core)")->check(CLI::NonNegativeNumber);
  d->callback([da] { run_demo(*da); });
}

}  // namespace colibri_cli
