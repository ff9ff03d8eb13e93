// Single-thread throughput of the block formats' integer dot products
// (src/kernels/quant_dot.h), each instruction set's table called directly,
// so that tables the engine would not pick on this CPU (plain AVX2 where
// AVX-VNNI exists) run in the same process as the one it picks.
//
// One iteration: one expert's three matrices, dot_rows over the 2F gate/up
// rows of D elements and the D down rows of F elements, for n tokens
// quantised once outside the loop. Weights are quantised from random floats
// by the format's reference quantiser; one expert of the suite's shapes
// (2.6-5 MB) stays in the last-level cache, so this measures the kernels'
// compute, not DRAM. Reports GOP/s (2 * 3 * D * F * n per iteration).
//
// Names: <table>/<format>/<D>x<F>/n:<tokens>. The tables side by side, in
// random order so that the host's drift meets both:
//   build/bench/colibri_qdot_bench --benchmark_filter='avx2.*/q4_k/2048x768/n:(1|8)$'
//     --benchmark_enable_random_interleaving=true --benchmark_repetitions=6
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/amx.h"
#include "kernels/quant_dot.h"
#include "util/half.h"
#include "util/weight_format.h"

namespace {

using colibri::WeightType;
using colibri::kernels::QuantDotKernels;

// rows x n weights of type t, quantised from N(0, 0.02).
std::vector<uint8_t> random_weights(WeightType t, size_t rows, size_t n, std::mt19937* rng) {
  const colibri::WeightFormat& f = colibri::weight_format(t);
  if (f.from_float == nullptr) {
    // A format read, not made (iq2_xxs): random blocks, each led by an f16 scale of 1e-3.
    std::vector<uint8_t> w(rows * colibri::weight_row_bytes(t, n));
    for (uint8_t& b : w) b = static_cast<uint8_t>((*rng)());
    const uint16_t d = colibri::float_to_f16(1e-3f);
    for (size_t o = 0; o < w.size(); o += f.block_bytes) std::memcpy(w.data() + o, &d, sizeof d);
    return w;
  }
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> x(rows * n);
  for (float& v : x) v = normal(*rng);
  std::vector<uint8_t> w(rows * colibri::weight_row_bytes(t, n));
  colibri::convert_rows_from_float(t, x.data(), rows, n, w.data(), colibri::conversion_threads());
  return w;
}

// n tokens of `len` elements quantised by `q` into activation rows.
std::vector<uint8_t> random_acts(const QuantDotKernels& q, WeightType t, int32_t n, size_t len, std::mt19937* rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t bytes = colibri::kernels::act_row_bytes(t, len);
  std::vector<uint8_t> act(bytes * static_cast<size_t>(n));
  std::vector<float> x(len);
  for (int32_t i = 0; i < n; ++i) {
    for (float& v : x) v = normal(*rng);
    q.quantize_act(x.data(), len, len, act.data() + static_cast<size_t>(i) * bytes);
  }
  return act;
}

void run_expert(benchmark::State& state, const QuantDotKernels* q, WeightType t, int32_t D, int32_t F) {
  const auto n = static_cast<int32_t>(state.range(0));
  const auto d = static_cast<size_t>(D);
  const auto f = static_cast<size_t>(F);
  std::mt19937 rng(42);
  const std::vector<uint8_t> gate_up = random_weights(t, 2 * f, d, &rng);
  const std::vector<uint8_t> down = random_weights(t, d, f, &rng);
  const std::vector<uint8_t> x = random_acts(*q, t, n, d, &rng);
  const std::vector<uint8_t> h = random_acts(*q, t, n, f, &rng);
  std::vector<float> out_gate_up(2 * f * static_cast<size_t>(n));
  std::vector<float> out_down(d * static_cast<size_t>(n));
  for (auto _ : state) {
    q->dot_rows(gate_up.data(), colibri::weight_row_bytes(t, d), 2 * F, x.data(), colibri::kernels::act_row_bytes(t, d),
                n, d, out_gate_up.data(), 2 * f);
    q->dot_rows(down.data(), colibri::weight_row_bytes(t, f), D, h.data(), colibri::kernels::act_row_bytes(t, f), n, f,
                out_down.data(), d);
    benchmark::DoNotOptimize(out_gate_up.data());
    benchmark::DoNotOptimize(out_down.data());
    benchmark::ClobberMemory();
  }
  const double ops = 6.0 * D * F * n;
  state.counters["GOP/s"] =
      benchmark::Counter(ops * 1e-9 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

struct Table {
  const char* name;
  const QuantDotKernels* (*get)(WeightType);
};

}  // namespace

int main(int argc, char** argv) {
  using namespace colibri::kernels;
  std::vector<Table> tables{{"scalar", quant_dot_scalar}};
#if defined(COLIBRI_HAVE_X86_KERNELS)
  if (detect_isa() >= Isa::kAvx2) tables.push_back({"avx2", quant_dot_avx2});
  if (cpu_has_avx_vnni()) tables.push_back({"avx2-vnni", quant_dot_avx_vnni});
  if (detect_isa() >= Isa::kAvx512 && cpu_has_avx512_vnni()) {
    tables.push_back({"avx512-vnni", quant_dot_avx512});
    // The AVX2-level kernels with EVEX ymm (the grid i-quants' before their zmm kernels).
    tables.push_back({"avx512-vnni-ymm", quant_dot_avx512_ymm});
    // The many-token products on AMX-INT8 tiles (the formats scaled per 32).
    if (amx_int8_available()) tables.push_back({"amx-int8", quant_dot_amx_int8});
  }
#endif
  // qwen3-moe, olmoe, gpt-oss-20b (the benchmark suite's shapes).
  const int32_t shapes[][2] = {{2048, 768}, {2048, 1024}, {2880, 2880}};
  for (const Table& table : tables) {
    for (int type = 0; type < colibri::kWeightTypeCount; ++type) {
      const auto t = static_cast<WeightType>(type);
      if (!colibri::weight_format(t).quantized || table.get(t) == nullptr) continue;
      for (const auto& shape : shapes) {
        const std::string name = std::string(table.name) + "/" + colibri::weight_format(t).name + "/" +
                                 std::to_string(shape[0]) + "x" + std::to_string(shape[1]);
        benchmark::RegisterBenchmark(name.c_str(), run_expert, table.get(t), t, shape[0], shape[1])
            ->ArgName("n")
            ->Arg(1)->Arg(2)->Arg(4)->Arg(6)->Arg(8)->Arg(12)->Arg(16)->Arg(32)
            ->Unit(benchmark::kMicrosecond)
            ->MeasureProcessCPUTime()
            ->UseRealTime();
      }
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
