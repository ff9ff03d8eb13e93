// Single-thread throughput of each kernel table on one expert, by tokens per
// expert: the measurement behind the engine's decode/prefill crossover
// (docs/KERNELS.md). One iteration = phase 1 over all d_ff rows, then phase 2
// over all d_model rows, for n tokens. Reports GFLOP/s (2 * 3 * D * F * n
// per iteration).
//
//   build/bench/colibri_kernel_bench --benchmark_filter='f16/1024x4096'
//
// paired/<table>/...: each iteration runs the kernel, then the table's peak
// loop (colibri_probe's register-only tdpbf16ps or fp32 FMA loop) for about
// as long; of_ceiling is the median over iterations of kernel rate / (loop
// rate / products per multiply-add), the kernel's efficiency against the
// peak of the same moment. This host's tile and FMA rates swing by 2-5x
// within seconds (other tenants), so a peak measured minutes apart, as the
// suite's probe is, says little about one kernel.
//
// Names: <table>/<dtype>/<D>x<F>/n:<tokens>. Shapes are the benchmark
// suite's (seed, qwen3-moe, olmoe); the weights of one expert stay in the
// last-level cache, so this measures the kernels' compute, not DRAM. The
// Mixtral expert (4096x14336, f16 only, prefill tables of 32 tokens and
// more) is 352 MB, larger than this machine's 300 MiB L3: every iteration
// streams its weights from memory, as a layer does.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "probe_kernels.h"
#include "kernels/amx.h"
#include "kernels/gemm.h"
#include "kernels/kernels.h"
#include "util/half.h"

namespace {

using colibri::kernels::ExpertShape;
using colibri::kernels::KernelTable;
using colibri::kernels::WeightType;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint8_t, FreeDeleter>;

Buffer aligned_bytes(size_t n) {
  return Buffer(static_cast<uint8_t*>(std::aligned_alloc(64, (n + 63) / 64 * 64)));
}

// Random weights in the packed layout (kernels.h), padding zero.
Buffer random_rows(size_t rows, size_t cols, size_t stride, WeightType t, std::mt19937* rng) {
  const size_t elem = colibri::weight_format(t).block_bytes;
  Buffer b = aligned_bytes(rows * stride * elem);
  std::memset(b.get(), 0, rows * stride * elem);
  std::uniform_real_distribution<float> dist(-0.05f, 0.05f);
  for (size_t r = 0; r < rows; ++r) {
    for (size_t c = 0; c < cols; ++c) {
      const float v = dist(*rng);
      uint8_t* at = b.get() + (r * stride + c) * elem;
      if (t == WeightType::kF32) {
        std::memcpy(at, &v, 4);
      } else {
        const uint16_t h = t == WeightType::kF16 ? colibri::float_to_f16(v) : colibri::float_to_bf16(v);
        std::memcpy(at, &h, 2);
      }
    }
  }
  return b;
}

// One expert's packed weights per (type, D, F), made on first use: the
// Mixtral expert takes seconds to fill, once for all its benchmarks.
struct ExpertWeights {
  Buffer gate_up, down;
};
const ExpertWeights& expert_weights(const ExpertShape& s) {
  static std::map<std::string, ExpertWeights> cache;
  const std::string key = std::to_string(static_cast<int>(s.weight_type)) + "/" + std::to_string(s.d_model) + "x" +
                          std::to_string(s.d_ff);
  auto it = cache.find(key);
  if (it == cache.end()) {
    std::mt19937 rng(42);
    ExpertWeights w;
    w.gate_up = random_rows(2 * static_cast<size_t>(s.d_ff), static_cast<size_t>(s.d_model), s.gate_up_stride,
                            s.weight_type, &rng);
    w.down = random_rows(static_cast<size_t>(s.d_model), static_cast<size_t>(s.d_ff), s.down_stride, s.weight_type,
                         &rng);
    it = cache.emplace(key, std::move(w)).first;
  }
  return it->second;
}

// One iteration's work: phase 1 over all d_ff rows, then phase 2 over all
// d_model rows, for n tokens gathered from a larger call (as the engine
// does), on the shape's cached weights.
struct ExpertCall {
  ExpertCall(WeightType t, int32_t D, int32_t F, int32_t tokens)
      : s(colibri::kernels::make_expert_shape(D, F, t)), weights(expert_weights(s)), n(tokens) {
    std::mt19937 rng(43);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    const size_t call_tokens = 4 * static_cast<size_t>(n);
    x.resize(call_tokens * static_cast<size_t>(D));
    for (float& v : x) v = dist(rng);
    y.assign(call_tokens * static_cast<size_t>(D), 0.0f);
    index.resize(static_cast<size_t>(n));
    for (int32_t i = 0; i < n; ++i) index[static_cast<size_t>(i)] = 4 * i + 1;
    weight.assign(static_cast<size_t>(n), 0.5f);
    h.resize(static_cast<size_t>(n) * ldh());
  }
  size_t ldh() const { return (static_cast<size_t>(s.d_ff) + 15) / 16 * 16; }
  double flops() const { return 6.0 * s.d_model * s.d_ff * n; }
  void run(const KernelTable& table) {
    const size_t D = static_cast<size_t>(s.d_model);
    table.gate_up(s, weights.gate_up.get(), x.data(), D, index.data(), n, 0, s.d_ff, h.data(), ldh(), &scratch);
    table.down(s, weights.down.get(), h.data(), ldh(), index.data(), weight.data(), n, 0, s.d_model, y.data(), D,
               &scratch);
    benchmark::ClobberMemory();
  }

  ExpertShape s;
  const ExpertWeights& weights;
  int32_t n;
  std::vector<float> x, y, weight, h;
  colibri::kernels::KernelScratch scratch;
  std::vector<int32_t> index;
};

void run_expert(benchmark::State& state, const KernelTable* table, WeightType t, int32_t D, int32_t F) {
  ExpertCall call(t, D, F, static_cast<int32_t>(state.range(0)));
  for (auto _ : state) call.run(*table);
  state.counters["GFLOP/s"] =
      benchmark::Counter(call.flops() * 1e-9 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

#if defined(COLIBRI_PROBE_X86)
// The peak loop a table is measured against and its multiply-adds per FLOP
// of useful work: the AMX tables run on the tile unit (the split table five
// tile products per multiply-add); the others on the fp32 FMA units.
struct Ceiling {
  float (*loop)(uint64_t);
  double flop_per_iter;
  double products;
};

Ceiling ceiling_for(const KernelTable& table) {
  const std::string name = table.name;
  if (name == "amx-bf16") return {colibri_probe::amx_bf16_dot, colibri_probe::kAmxFlopPerIter, 1.0};
  if (name == "amx-f16-split") return {colibri_probe::amx_bf16_dot, colibri_probe::kAmxFlopPerIter, 5.0};
  const colibri_probe::Kernels k = colibri_probe::avx512_kernels();
  return {k.fma, 2.0 * k.fma_accumulators * (k.vector_bits / 32), 1.0};
}

volatile float g_sink;

void run_paired(benchmark::State& state, const KernelTable* table, WeightType t, int32_t D, int32_t F) {
  ExpertCall call(t, D, F, static_cast<int32_t>(state.range(0)));
  const Ceiling c = ceiling_for(*table);
  if (c.loop == colibri_probe::amx_bf16_dot && !colibri_probe::amx_enable()) {
    state.SkipWithError("no tile state");
    return;
  }
  using Clock = std::chrono::steady_clock;
  uint64_t loop_iters = 1 << 12;
  std::vector<double> ratios, kernel_rates, peak_rates;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    call.run(*table);
    const auto t1 = Clock::now();
    g_sink = c.loop(loop_iters);
    const auto t2 = Clock::now();
    const double kernel_s = std::chrono::duration<double>(t1 - t0).count();
    const double loop_s = std::chrono::duration<double>(t2 - t1).count();
    const double peak = c.flop_per_iter * static_cast<double>(loop_iters) / loop_s / c.products;
    kernel_rates.push_back(call.flops() / kernel_s);
    peak_rates.push_back(peak);
    ratios.push_back(call.flops() / kernel_s / peak);
    // Next loop about as long as this kernel call.
    const double want = static_cast<double>(loop_iters) * kernel_s / loop_s;
    loop_iters = static_cast<uint64_t>(std::max(256.0, std::min(want, 1e9)));
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  state.counters["GFLOP/s"] = median(kernel_rates) * 1e-9;
  state.counters["ceiling_GFLOP/s"] = median(peak_rates) * 1e-9;
  state.counters["of_ceiling"] = median(ratios);
}
#endif

const char* dtype_name(WeightType t) {
  return t == WeightType::kF32 ? "f32" : t == WeightType::kF16 ? "f16" : "bf16";
}

}  // namespace

int main(int argc, char** argv) {
  using namespace colibri::kernels;
  std::vector<const KernelTable*> tables{&kernel_table(default_isa())};
#if defined(COLIBRI_HAVE_X86_KERNELS)
  if (isa_supported(Isa::kAvx512)) {
    tables.push_back(&avx512_gemm_kernels());
    tables.push_back(&avx512_tokens_kernels());
    if (bf16_compute_available(default_isa())) {
      tables.push_back(&avx512_bf16_kernels());
      tables.push_back(&avx512_bf16_split_kernels());
    }
    if (amx_available()) {
      tables.push_back(&amx_bf16_kernels());
      tables.push_back(&amx_f16_split_kernels());
    }
  }
#endif
  const int32_t shapes[][2] = {{1024, 4096}, {2048, 768}, {2048, 1024}};
  for (const KernelTable* table : tables) {
    for (WeightType t : {WeightType::kF16, WeightType::kBF16, WeightType::kF32}) {
      for (const auto& shape : shapes) {
        const std::string name = std::string(table->name) + "/" + dtype_name(t) + "/" + std::to_string(shape[0]) +
                                 "x" + std::to_string(shape[1]);
        benchmark::RegisterBenchmark(name.c_str(), run_expert, table, t, shape[0], shape[1])
            ->ArgName("n")
            ->Arg(1)->Arg(2)->Arg(4)->Arg(5)->Arg(6)->Arg(7)->Arg(8)->Arg(12)->Arg(16)->Arg(24)->Arg(32)->Arg(48)->Arg(64)->Arg(96)->Arg(128)->Arg(192)->Arg(256)
            ->Unit(benchmark::kMicrosecond)
            ->MeasureProcessCPUTime()
            ->UseRealTime();
      }
    }
  }
  // The Mixtral-sized expert, streamed from memory: the prefill tables for
  // f16 weights where the split table's crossover is decided.
  for (const KernelTable* table : tables) {
    const std::string name_prefix = table->name;
    if (name_prefix != "avx512-tokens" && name_prefix != "amx-f16-split") continue;
    const std::string name = name_prefix + "/f16/4096x14336";
    benchmark::RegisterBenchmark(name.c_str(), run_expert, table, WeightType::kF16, 4096, 14336)
        ->ArgName("n")
        ->Arg(32)->Arg(48)->Arg(64)->Arg(96)->Arg(128)->Arg(256)
        ->Unit(benchmark::kMillisecond)
        ->MeasureProcessCPUTime()
        ->UseRealTime();
  }
#if defined(COLIBRI_PROBE_X86)
  // Paired with the peak of the same moment, at the prefill sizes each
  // table runs at in the engine.
  for (const KernelTable* table : tables) {
    const std::string name = table->name;
    if (name != "avx512-tokens" && name != "avx512-gemm" && name != "amx-bf16" && name != "amx-f16-split") continue;
    const WeightType t = name == "amx-bf16" ? WeightType::kBF16 : WeightType::kF16;
    for (const auto& shape : shapes) {
      const std::string bench_name =
          "paired/" + name + "/" + dtype_name(t) + "/" + std::to_string(shape[0]) + "x" + std::to_string(shape[1]);
      benchmark::RegisterBenchmark(bench_name.c_str(), run_paired, table, t, shape[0], shape[1])
          ->ArgName("n")
          ->Arg(8)->Arg(16)->Arg(32)->Arg(40)->Arg(64)->Arg(128)->Arg(256)
          ->Unit(benchmark::kMicrosecond);
    }
  }
#endif
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
