// colibri loadtest: N caller threads against one model, every output
// checked against a float64 reference, optionally with hot swaps going on.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "common.h"
#include "io/manifest.h"
#include "lib/float64_reference.h"
#include "util/error.h"

namespace colibri_cli {

namespace {

using Clock = std::chrono::steady_clock;

struct LoadArgs {
  std::string model, callers = "1,2,4,8";
  int requests = 200, tokens = 1, top_k = 2, routings = 8, threads = 0, layer = 0;
  int swap_every = 0;
  uint64_t seed = 7;
  bool json = false;
  CacheFlags cache;
};

// Resident set size from /proc/self/status, in bytes.
uint64_t rss_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) {
      std::istringstream in(line.substr(6));
      uint64_t kb = 0;
      in >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

std::vector<int> parse_callers(const std::string& text) {
  std::vector<int> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 1 || v > 256) {
      throw CliError("loadtest: --callers: \"" + item + "\" is not a caller count in [1, 256]");
    }
    out.push_back(static_cast<int>(v));
  }
  if (out.empty()) throw CliError("loadtest: --callers is empty");
  return out;
}

struct Case {
  Routing routing;
  std::vector<float> input;
  std::vector<double> expected;
};

struct Row {
  int callers = 0;
  long requests = 0, failed = 0, wrong = 0, swaps = 0;
  double seconds = 0, worst_error = 0;
  LatencySummary latency;
  uint64_t rss_start = 0, rss_end = 0;
};

void run_loadtest(const LoadArgs& a) {
  const std::vector<int> caller_counts = parse_callers(a.callers);
  ModelHandle h;
  open_model(a.model, a.threads, true, &h, "default", a.cache);
  colibri_model_info_t info;
  check(colibri_model_info(h.model, &info), "loadtest");
  if (a.layer >= info.n_layers) throw CliError("loadtest: --layer " + std::to_string(a.layer) + " is out of range");
  if (a.top_k > info.n_experts) throw CliError("loadtest: --top-k exceeds the model's experts");
  if (info.shared_d_ff > 0) {
    throw CliError("loadtest: the float64 reference covers routed experts only; this model has a shared expert");
  }
  // The precision contracts (docs/PRECISION.md): fp32-grade for f32
  // weights, bf16 rounding of activations for 16-bit ones in prefill, int8
  // activations for the block formats.
  const bool quantized = info.dtype >= COLIBRI_DTYPE_Q8_0;
  const double tol = quantized ? 2e-2 : info.dtype == COLIBRI_DTYPE_F32 ? 1e-5 : 5e-3;

  // A pool of routings and inputs with their float64 references; requests
  // cycle through it, so consecutive calls read different experts.
  std::mt19937_64 rng(a.seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<Case> cases(static_cast<size_t>(a.routings));
  std::fprintf(stderr, "loadtest: computing %d float64 references...\n", a.routings);
  for (Case& c : cases) {
    c.routing = random_routing(a.tokens, a.top_k, info.n_experts, rng);
    c.input.resize(static_cast<size_t>(a.tokens) * static_cast<size_t>(info.d_model));
    for (float& v : c.input) v = nd(rng);
    c.expected = colibri::reference_layer(a.model, a.layer, a.tokens, c.input.data(), a.top_k, c.routing.ids.data(),
                                          c.routing.weights.data());
  }
  // For --swap-every: the expert swapped is replaced by its own bytes, so
  // the references stay valid and any torn or stale read shows as an error.
  const colibri::Manifest manifest = colibri::load_manifest(a.model);
  std::vector<uint8_t> swap_bytes;
  if (a.swap_every > 0) swap_bytes = read_file(a.model + "/" + manifest.expert_file(a.layer, cases[0].routing.ids[0]));

  std::vector<Row> rows;
  for (const int callers : caller_counts) {
    Row row;
    row.callers = callers;
    row.rss_start = rss_bytes();
    std::atomic<long> failed{0}, wrong{0};
    std::vector<std::vector<double>> latencies(static_cast<size_t>(callers));
    std::vector<double> worst(static_cast<size_t>(callers), 0.0);
    std::unique_ptr<SwapStress> swapper;
    if (a.swap_every > 0) {
      swapper = std::make_unique<SwapStress>(h.model, a.layer, cases[0].routing.ids[0], swap_bytes, info.dtype,
                                             a.swap_every);
    }
    const auto t0 = Clock::now();
    std::vector<std::thread> threads;
    for (int c = 0; c < callers; ++c) {
      threads.emplace_back([&, c] {
        std::vector<float> out(cases[0].input.size());
        auto& lat = latencies[static_cast<size_t>(c)];
        lat.reserve(static_cast<size_t>(a.requests));
        for (int i = 0; i < a.requests; ++i) {
          const Case& cs = cases[static_cast<size_t>(i * callers + c) % cases.size()];
          colibri_infer_t req;
          colibri_infer_default(&req);
          req.layer = a.layer;
          req.n_tokens = a.tokens;
          req.input = cs.input.data();
          req.output = out.data();
          req.top_k = a.top_k;
          req.expert_ids = cs.routing.ids.data();
          req.expert_weights = cs.routing.weights.data();
          const auto s0 = Clock::now();
          const colibri_status_t st = colibri_infer(h.model, &req);
          lat.push_back(std::chrono::duration<double>(Clock::now() - s0).count());
          if (swapper) swapper->request_done();
          if (st != COLIBRI_OK) {
            failed.fetch_add(1);
            continue;
          }
          const double err = colibri::relative_l2(out.data(), cs.expected);
          worst[static_cast<size_t>(c)] = std::max(worst[static_cast<size_t>(c)], err);
          if (!(err <= tol)) wrong.fetch_add(1);
        }
      });
    }
    for (std::thread& t : threads) t.join();
    row.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    if (swapper) {
      swapper->stop();
      row.swaps = swapper->swaps();
      row.failed += swapper->failures();
      if (swapper->failures() > 0) std::fprintf(stderr, "loadtest: swap failed: %s\n", swapper->first_error().c_str());
    }
    std::vector<double> all;
    for (const auto& l : latencies) all.insert(all.end(), l.begin(), l.end());
    row.latency = summarize(all);
    row.requests = static_cast<long>(all.size());
    row.failed += failed.load();
    row.wrong = wrong.load();
    row.worst_error = *std::max_element(worst.begin(), worst.end());
    row.rss_end = rss_bytes();
    rows.push_back(row);
  }

  bool ok = true;
  for (const Row& r : rows) ok = ok && r.failed == 0 && r.wrong == 0;
  if (a.json) {
    nlohmann::json out;
    out["model"] = a.model;
    out["tokens"] = a.tokens;
    out["top_k"] = a.top_k;
    out["requests_per_caller"] = a.requests;
    out["swap_every"] = a.swap_every;
    out["tolerance"] = tol;
    for (const Row& r : rows) {
      out["rows"].push_back({{"callers", r.callers},
                             {"requests", r.requests},
                             {"failed", r.failed},
                             {"wrong", r.wrong},
                             {"swaps", r.swaps},
                             {"worst_rel_l2", r.worst_error},
                             {"requests_per_s", static_cast<double>(r.requests) / r.seconds},
                             {"tokens_per_s", static_cast<double>(r.requests) * a.tokens / r.seconds},
                             {"p50_ms", r.latency.p50_ms},
                             {"p99_ms", r.latency.p99_ms},
                             {"rss_start", r.rss_start},
                             {"rss_end", r.rss_end}});
    }
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    std::printf("model %s, T=%d, top-%d, %d requests per caller, every output checked (rel. L2 <= %g)%s\n",
                a.model.c_str(), a.tokens, a.top_k, a.requests, tol,
                a.swap_every > 0 ? (", expert swapped every " + std::to_string(a.swap_every) + " requests").c_str() : "");
    std::printf("%8s %9s %7s %6s %6s %11s %10s %10s %10s %12s %12s\n", "callers", "requests", "failed", "wrong",
                "swaps", "requests/s", "p50 ms", "p99 ms", "worst err", "RSS start", "RSS end");
    for (const Row& r : rows) {
      std::printf("%8d %9ld %7ld %6ld %6ld %11.1f %10.3f %10.3f %10.2e %12s %12s\n", r.callers, r.requests, r.failed,
                  r.wrong, r.swaps, static_cast<double>(r.requests) / r.seconds, r.latency.p50_ms, r.latency.p99_ms,
                  r.worst_error, human_bytes(r.rss_start).c_str(), human_bytes(r.rss_end).c_str());
    }
  }
  if (!ok) throw CliError("loadtest: some requests failed or gave wrong outputs (see the table)");
}

}  // namespace

void add_load_commands(CLI::App& app) {
  auto la = std::make_shared<LoadArgs>();
  CLI::App* l = app.add_subcommand("loadtest", "Several caller threads against one model, every output checked");
  l->add_option("--model", la->model, "Model directory or GGUF file")->required();
  l->add_option("--callers", la->callers, "Comma-separated caller thread counts (default 1,2,4,8)");
  l->add_option("--requests", la->requests, "Inferences per caller")->check(CLI::Range(1, 10000000));
  l->add_option("--tokens", la->tokens, "Tokens per request")->check(CLI::Range(1, 65536));
  l->add_option("--top-k", la->top_k, "Experts per token")->check(CLI::Range(1, 65536));
  l->add_option("--routings", la->routings, "Distinct routings (with float64 references) cycled through")
      ->check(CLI::Range(1, 1024));
  l->add_option("--threads", la->threads, "Engine threads (0 = one per core)")->check(CLI::NonNegativeNumber);
  l->add_option("--layer", la->layer, "Layer index")->check(CLI::NonNegativeNumber);
  l->add_option("--swap-every", la->swap_every, "Hot-swap an expert (with its own bytes) every N requests")
      ->check(CLI::NonNegativeNumber);
  l->add_option("--seed", la->seed, "Seed for routings and inputs");
  l->add_flag("--json", la->json, "JSON output");
  add_cache_flags(l, &la->cache);
  l->callback([la] { run_loadtest(*la); });
}

}  // namespace colibri_cli
