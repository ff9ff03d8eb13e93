// Shared helpers for the colibri CLI (and bench/layer_bench.cpp): error
// reporting, file I/O, latency statistics, routings and the work they ask
// for. The CLI talks to the engine through the C ABI; it reaches below it
// only for tooling the ABI does not need to carry (writing models).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "colibri.h"
#include "util/weight_format.h"

namespace colibri_cli {

// Thrown by command code; main() prints "colibri <cmd>: <message>" to stderr
// and exits 1.
struct CliError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Throws CliError with colibri_last_error() if status != OK.
void check(colibri_status_t status, const std::string& what);

std::vector<uint8_t> read_file(const std::string& path);
void write_file(const std::string& path, const void* data, size_t size);

// Nearest-rank percentile (p in [0, 1]): the ceil(p*n)-th smallest sample; 0
// for none.
double percentile(std::vector<double> samples, double p);

struct LatencySummary {
  double min_ms = 0, mean_ms = 0, p50_ms = 0, p90_ms = 0, p99_ms = 0, max_ms = 0;
};
LatencySummary summarize(std::vector<double> seconds);

// RAII for the C handles.
struct ModelHandle {
  colibri_model_t* model = nullptr;
  ModelHandle() = default;
  ModelHandle(const ModelHandle&) = delete;
  ModelHandle& operator=(const ModelHandle&) = delete;
  ~ModelHandle() { colibri_free(model); }
};
struct RoutingHandle {
  colibri_routing_t* routing = nullptr;
  RoutingHandle() = default;
  RoutingHandle(const RoutingHandle&) = delete;
  RoutingHandle& operator=(const RoutingHandle&) = delete;
  ~RoutingHandle() { colibri_routing_free(routing); }
};

// The open options' precision choice, as the --precision flag names it:
// "default", "exact" (exact_prefill) or "bf16" (bf16_compute).
inline constexpr const char* kPrecisionHelp =
    "Precision: default (bf16 models round activations on AMX tiles; block-quantised models quantise "
    "activations to int8), exact (fp32-grade everywhere; fp32 activations against dequantised weights), "
    "bf16 (any float weights through bf16 products); docs/PRECISION.md";
inline const std::vector<std::string>& precision_names() {
  static const std::vector<std::string> names{"default", "exact", "bf16"};
  return names;
}

// The weight types --dtype takes (gen, convert, quantize), and a label
// such as "q4_k (down q6_k)".
inline constexpr const char* kDtypeChoices =
    "f16, bf16, f32, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, mxfp4, iq4_nl, iq4_xs, fp8_e4m3, "
    "tq1_0, tq2_0, q4_k_m; "
    "gen also iq1_s, iq1_m, iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s (random codes: read, not made)";
inline const std::vector<std::string>& dtype_choices() {
  static const std::vector<std::string> names{"f16",  "bf16", "f32",  "q8_0", "q4_0",  "q4_1",   "q5_0",   "q5_1",  "q2_k",
                                                 "q3_k", "q4_k", "q5_k", "q6_k", "mxfp4", "iq4_nl", "iq4_xs", "q4_k_m",
                                                 "iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs",
                                                 "iq3_s", "fp8_e4m3", "tq1_0", "tq2_0"};
  return names;
}
std::string dtype_label(colibri_dtype_t dtype, colibri_dtype_t down_dtype);
std::string dtype_label(colibri::WeightType dtype, colibri::WeightType down_dtype);

// The memory-budget flags of every command that opens a model
// (add_cache_flags in commands.h): --max-resident 2G / 512MiB / 25%, the
// eviction policy, reader threads and their I/O engine, O_DIRECT and router
// speculation.
struct CacheFlags {
  std::string max_resident;  // empty: no budget
  std::string eviction = "freq";
  int io_threads = 0;
  std::string io_engine = "pread";
  bool buffered_io = false;
  bool no_speculate = false;
  bool no_tune = false;  // keep the registry's kernels (colibri_open_options_t.tune_kernels = 0)
};
// Applies the flags to open options; throws CliError on a malformed size.
void apply_cache_flags(const CacheFlags& flags, colibri_open_options_t* options);
// "1073741824", "1G", "512MiB", "1.5GB" (powers of 1024 either way) to
// bytes; "25%" to a percentage in *percent (bytes 0). Throws CliError.
uint64_t parse_budget(const std::string& text, float* percent);

// Opens a model; prints the loader's warning (if any) to stderr.
void open_model(const std::string& dir, int threads, bool verify, ModelHandle* out,
                const std::string& precision = "default", const CacheFlags& cache = CacheFlags());
colibri_model_info_t model_info(const ModelHandle& h);
// The memory budget's lines of `colibri info` / `colibri bench` (nothing
// without a budget), and the same as JSON text ("null" without one).
void print_cache_stats(const colibri_stats_t& stats);
std::string cache_stats_json(const colibri_stats_t& stats);

// Explicit routing for benchmarks and load tests.
struct Routing {
  int32_t k = 0;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// Uniformly random distinct experts per token, softmax-like weights summing
// to 1, as a trained router's top-k would give.
Routing random_routing(int32_t T, int32_t k, int32_t E, std::mt19937_64& rng);

// What one call with this routing ([T][k] ids, -1 = empty slot) asks of the
// machine: bytes of the distinct experts' weights (each read once) and the
// FLOP of its (token, expert) pairs.
struct RoutingWork {
  double bytes = 0, flop = 0;
};
RoutingWork routing_work(const colibri_model_info_t& info, int32_t T, int32_t k, const int32_t* ids);

// Hot-swap stress (bench and loadtest --swap-every N): a thread that swaps
// one expert with `bytes` (normally its own file, so results stay valid)
// once for every N requests the callers report, concurrently with them.
class SwapStress {
 public:
  SwapStress(colibri_model_t* model, int32_t layer, int32_t expert, std::vector<uint8_t> bytes, colibri_dtype_t dtype,
             long every);
  ~SwapStress();  // stops and joins
  SwapStress(const SwapStress&) = delete;
  SwapStress& operator=(const SwapStress&) = delete;

  void request_done();  // thread-safe; callers call it after each request
  void stop();          // performs the swaps still due, then joins
  long swaps() const { return swaps_.load(); }
  long failures() const { return failures_.load(); }
  const std::string& first_error() const { return first_error_; }

 private:
  void run();
  colibri_model_t* model_;
  int32_t layer_, expert_;
  std::vector<uint8_t> bytes_;
  colibri_dtype_t dtype_;
  long every_;
  std::atomic<long> done_{0}, swaps_{0}, failures_{0};
  std::mutex mutex_;
  std::condition_variable cv_;
  long due_ = 0;
  bool stopping_ = false;
  std::string first_error_;
  std::thread thread_;
};

std::string human_bytes(uint64_t bytes);

// A progress bar on stderr, one line redrawn in place at most ~10 times a
// second (small experts finish far faster than a terminal scrolls), for
// the long steps: opening, converting and quantising large files.
class ProgressLine {
 public:
  explicit ProgressLine(std::string label) : label_(std::move(label)) {}
  // Whether a line is worth drawing: stderr is a terminal (or forced).
  static bool wanted(bool forced);
  void update(double fraction, const std::string& detail = "");
  // Ends the line: kept (a newline) or erased.
  void finish(bool keep);
  // colibri_progress_fn over a ProgressLine* (the open's progress).
  static int32_t on_open(float progress, void* line);

 private:
  std::string label_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point last_draw_{};
};
const char* huge_page_kind_name(colibri_huge_page_kind_t kind);

}  // namespace colibri_cli
