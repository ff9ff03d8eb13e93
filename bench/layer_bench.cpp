// colibri_layer_bench: one MoE layer against the machine's limit of the same
// moment. This host's read bandwidth and FMA/tile rates swing by 2-5x within
// seconds, so a layer's time divided by a probe taken minutes earlier mixes
// two states of the machine. Here every iteration runs the layer call and,
// right before or after it (the order alternating), one of colibri_probe's
// loops on as many threads for about as long; the figure is the median over
// iterations of (the call's bytes or FLOP per second) / (the loop's rate).
//
//   colibri_layer_bench --model DIR (--routing FILE.bin | --tokens T --top-k K)
//                       --against read|fma|tiles
//                       [--threads N] [--iters N] [--warmup N] [--read-mib M]
//
// --routing: the same routing every call; --tokens/--top-k: 8 random
// routings taken in turn, a new one each call, as `colibri bench` does (a
// decode loop's experts change every token; a fixed top-k of a small model
// stays in the LLC and would be measured against DRAM).
//
// read:  bytes of the active experts' weights (each read once per call)
//        against the read-only streaming loop over huge-page arrays far
//        larger than the LLC, continuing where the previous window stopped
// fma:   2 x 3 x d_model x d_ff FLOP per routed slot against the fp32 FMA loop
// tiles: the same FLOP against the AMX tdpbf16ps loop
//
// Prints one JSON object on stdout.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "colibri.h"
#include "common.h"
#include "probe_kernels.h"
#include "probe_runtime.h"

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;
using colibri_probe::Buffer;
using colibri_probe::Team;

struct Options {
  std::string model, routing, against, precision = "default";
  int threads = 0, iters = 50, warmup = 3, streams = 4, tokens = 0, top_k = 0;
  size_t read_mib = 1024;
};

// CLI11 (as the colibri CLI); exits with its usage message on bad input.
Options parse(int argc, char** argv) {
  Options o;
  CLI::App app{"One MoE layer against the machine's limit of the same moment; prints JSON"};
  app.add_option("--model", o.model, "Model directory")->required();
  auto* routing = app.add_option("--routing", o.routing, "routing.bin or .route file (the same every call)");
  auto* tokens = app.add_option("--tokens", o.tokens, "Tokens per call (8 random routings in turn)")
                     ->check(CLI::Range(1, 1 << 24));
  routing->excludes(tokens);
  app.add_option("--top-k", o.top_k, "Experts per token (random routings)")->check(CLI::Range(1, 65536))->needs(tokens);
  tokens->needs("--top-k");
  app.add_option("--against", o.against, "The limit: read bandwidth, fp32 FMA or AMX tile peak")
      ->required()
      ->check(CLI::IsMember({"read", "fma", "tiles"}));
  app.add_option("--threads", o.threads, "Threads (0 = one per core)")->check(CLI::NonNegativeNumber);
  app.add_option("--iters", o.iters, "Timed iterations")->check(CLI::Range(1, 1000000));
  app.add_option("--warmup", o.warmup, "Untimed iterations first")->check(CLI::Range(0, 1000000));
  app.add_option("--precision", o.precision, colibri_cli::kPrecisionHelp)
      ->check(CLI::IsMember(colibri_cli::precision_names()));
  app.add_option("--read-mib", o.read_mib, "Size of the read loop's arrays")->check(CLI::Range(64, 1 << 20));
  try {
    app.parse(argc, argv);
    if (o.routing.empty() && o.tokens == 0) throw CLI::RequiredError("--routing or --tokens");
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e));
  }
  return o;
}

volatile float g_sink;

// A routing with the work it asks of the machine.
struct Call {
  colibri_cli::Routing routing;
  colibri_cli::RoutingWork work;
};

Call load_call(const std::string& path, const colibri_model_info_t& info) {
  colibri_cli::RoutingHandle decoded;
  colibri_cli::check(colibri_routing_load(path.c_str(), info.n_experts, 0, &decoded.routing), "routing");
  Call c;
  const int32_t T = colibri_routing_n_tokens(decoded.routing);
  c.routing.k = colibri_routing_top_k(decoded.routing);
  const size_t n = static_cast<size_t>(T) * static_cast<size_t>(c.routing.k);
  const int32_t* ids = colibri_routing_expert_ids(decoded.routing);
  const float* weights = colibri_routing_expert_weights(decoded.routing);
  c.routing.ids.assign(ids, ids + n);
  c.routing.weights.assign(weights, weights + n);
  c.work = colibri_cli::routing_work(info, T, c.routing.k, ids);
  return c;
}

// One of the probe's loops on every member of the team, for a chosen amount
// of work; returns the rate (bytes or FLOP per second) it ran at.
class Limit {
 public:
  Limit(const Options& o, Team& team) : team_(team), kind_(o.against), streams_(o.streams) {
    // The loops are the probe's AVX-512 ones (what the kernels it is
    // compared with run on); the OS must also save the ZMM state.
    if (!__builtin_cpu_supports("avx512f")) throw std::runtime_error("needs AVX-512");
    const colibri_probe::Kernels k = colibri_probe::avx512_kernels();
    read_ = k.read;
    fma_ = k.fma;
    fma_flop_ = 2.0 * k.fma_accumulators * (k.vector_bits / 32);
    if (kind_ == "tiles" && !colibri_probe::amx_enable()) throw std::runtime_error("no AMX tile state");
    if (kind_ == "read") {
      buffer_ = std::make_unique<Buffer>(o.read_mib * colibri_probe::kMiB, true);
      // Each member owns streams_ lanes of its share; touched by their owners.
      lane_floats_ = buffer_->floats() / static_cast<size_t>(team.size() * streams_) / 1024 * 1024;
      team_.run([&](int id) {
        float* p = buffer_->data() + static_cast<size_t>(id * streams_) * lane_floats_;
        const size_t n = lane_floats_ * static_cast<size_t>(streams_);
        for (size_t i = 0; i < n; ++i) p[i] = 1e-3f * static_cast<float>(i & 1023);
      });
    }
  }

  // Runs about `seconds` of the loop (calibrated on the previous run) and
  // returns its rate.
  double run_for(double seconds) {
    // At least 2 ms: waking the team costs tens of microseconds, which in a
    // shorter run would show as a lower rate.
    const double amount = std::max(1.0, std::min(rate_per_amount_ * std::max(seconds, 2e-3), 1e12));
    double rate = 0;
    if (kind_ == "read") {
      // Windows of 64 KiB per lane, walked from where the last run stopped,
      // so no run finds the previous one's lines in the LLC.
      constexpr size_t kWindow = 16384;
      const size_t windows = std::max<size_t>(1, static_cast<size_t>(amount));
      const double s = team_.run([&](int id) {
        const float* base = buffer_->data() + static_cast<size_t>(id * streams_) * lane_floats_;
        float acc = 0;
        size_t at = cursor_;
        for (size_t w = 0; w < windows; ++w) {
          if (at + kWindow > lane_floats_) at = 0;
          const float* ptrs[8];
          for (int l = 0; l < streams_; ++l) ptrs[l] = base + static_cast<size_t>(l) * lane_floats_ + at;
          acc += read_(ptrs, streams_, kWindow);
          at += kWindow;
        }
        if (id == 0) next_cursor_ = at;
        g_sink = g_sink + acc;
      });
      cursor_ = next_cursor_;
      const double bytes = static_cast<double>(windows) * kWindow * sizeof(float) * streams_ * team_.size();
      rate = bytes / s;
      rate_per_amount_ = static_cast<double>(windows) / s;
    } else {
      const uint64_t iters = static_cast<uint64_t>(amount);
      const bool tiles = kind_ == "tiles";
      const double s = team_.run([&](int) {
        g_sink = g_sink + (tiles ? colibri_probe::amx_bf16_dot(iters) : fma_(iters));
      });
      const double flop_per_iter = tiles ? colibri_probe::kAmxFlopPerIter : fma_flop_;
      rate = flop_per_iter * static_cast<double>(iters) * team_.size() / s;
      rate_per_amount_ = static_cast<double>(iters) / s;
    }
    return rate;
  }

 private:
  Team& team_;
  std::string kind_;
  int streams_;
  float (*read_)(const float* const*, int, size_t) = nullptr;
  float (*fma_)(uint64_t) = nullptr;
  double fma_flop_ = 0;
  std::unique_ptr<Buffer> buffer_;
  size_t lane_floats_ = 0, cursor_ = 0, next_cursor_ = 0;
  double rate_per_amount_ = 1000;  // first run: a short calibration
};

int run(const Options& o) {
  using colibri_cli::percentile;
  colibri_cli::ModelHandle h;
  colibri_cli::open_model(o.model, o.threads, false, &h, o.precision);
  const colibri_model_info_t info = colibri_cli::model_info(h);
  const int threads = info.n_threads;

  std::vector<Call> calls;
  const int32_t T = o.routing.empty() ? o.tokens : 0;
  if (!o.routing.empty()) {
    calls.push_back(load_call(o.routing, info));
  } else {
    if (o.top_k > info.n_experts) throw std::runtime_error("--top-k is larger than the number of experts");
    std::mt19937_64 rng(4242);
    for (int i = 0; i < 8; ++i) {
      Call c;
      c.routing = colibri_cli::random_routing(T, o.top_k, info.n_experts, rng);
      c.work = colibri_cli::routing_work(info, T, o.top_k, c.routing.ids.data());
      calls.push_back(std::move(c));
    }
  }
  const int32_t tokens = static_cast<int32_t>(calls[0].routing.ids.size() / static_cast<size_t>(calls[0].routing.k));
  const bool by_bytes = o.against == "read";

  std::vector<float> in(static_cast<size_t>(tokens) * info.d_model), out(in.size());
  for (size_t i = 0; i < in.size(); ++i) in[i] = std::sin(0.001f * static_cast<float>(i));
  colibri_infer_t req;
  colibri_infer_default(&req);
  req.n_tokens = tokens;
  req.input = in.data();
  req.output = out.data();

  Team team(threads, false);
  Limit limit(o, team);
  std::vector<double> call_s, rates, fractions;
  double last_call = 0.01;
  for (int it = -o.warmup; it < o.iters; ++it) {
    const Call& c = calls[static_cast<size_t>(it + o.warmup) % calls.size()];
    req.top_k = c.routing.k;
    req.expert_ids = c.routing.ids.data();
    req.expert_weights = c.routing.weights.data();
    auto call = [&] {
      const auto t0 = Clock::now();
      colibri_cli::check(colibri_infer(h.model, &req), "infer");
      return std::chrono::duration<double>(Clock::now() - t0).count();
    };
    // The engine's workers spin for a moment after a call before they sleep;
    // a pause keeps them off the cores the loop runs on.
    auto settle = [] { std::this_thread::sleep_for(std::chrono::milliseconds(2)); };
    double dt = 0, rate = 0;
    if ((it & 1) == 0) {
      dt = call();
      settle();
      rate = limit.run_for(dt);
    } else {
      rate = limit.run_for(last_call);
      dt = call();
      settle();
    }
    last_call = dt;
    if (it < 0) continue;
    call_s.push_back(dt);
    rates.push_back(rate);
    fractions.push_back((by_bytes ? c.work.bytes : c.work.flop) / dt / rate);
  }

  json doc;
  doc["model"] = o.model;
  doc["routing"] = o.routing.empty() ? json("random, " + std::to_string(calls.size()) + " in turn") : json(o.routing);
  doc["against"] = o.against;
  doc["threads"] = threads;
  doc["iters"] = o.iters;
  doc["kernels"] = colibri_model_kernels(h.model);
  doc["tokens"] = tokens;
  doc["top_k"] = calls[0].routing.k;
  doc["bytes_per_call"] = calls[0].work.bytes;
  doc["flop_per_call"] = calls[0].work.flop;
  doc["p50_ms"] = percentile(call_s, 0.50) * 1e3;
  doc["p99_ms"] = percentile(call_s, 0.99) * 1e3;
  const char* unit = by_bytes ? "gbytes" : "gflop";
  doc[std::string("limit_") + unit + "_per_s_median"] = percentile(rates, 0.50) * 1e-9;
  doc[std::string("limit_") + unit + "_per_s_max"] = percentile(rates, 1.0) * 1e-9;
  doc["fraction_median"] = percentile(fractions, 0.50);
  doc["fraction_p25"] = percentile(fractions, 0.25);
  doc["fraction_p75"] = percentile(fractions, 0.75);
  doc["sink"] = std::isfinite(g_sink) ? 0 : 1;
  std::printf("%s\n", doc.dump(2).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "colibri_layer_bench: %s\n", e.what());
    return 1;
  }
}
