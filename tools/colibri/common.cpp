#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

#include <unistd.h>

#include "io/mapped_file.h"
#include "util/error.h"

namespace colibri_cli {

void check(colibri_status_t status, const std::string& what) {
  if (status != COLIBRI_OK) {
    const std::string detail = colibri_last_error();
    throw CliError(detail.empty() ? what + ": " + colibri_status_name(status) : detail);
  }
}

std::vector<uint8_t> read_file(const std::string& path) {
  try {
    const std::string data = colibri::read_small_file(path, size_t{1} << 36);
    return std::vector<uint8_t>(data.begin(), data.end());
  } catch (const colibri::Error& e) {
    throw CliError(e.what());
  }
}

void write_file(const std::string& path, const void* data, size_t size) {
  try {
    colibri::write_file_atomic(path, data, size);
  } catch (const colibri::Error& e) {
    throw CliError(e.what());
  }
}

namespace {

// The ceil(p*n)-th smallest of `sorted` (non-empty, ascending).
double nearest_rank(const std::vector<double>& sorted, double p) {
  size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(sorted.size())));
  rank = std::clamp<size_t>(rank, 1, sorted.size());
  return sorted[rank - 1];
}

}  // namespace

double percentile(std::vector<double> s, double p) {
  if (s.empty()) return 0;
  std::sort(s.begin(), s.end());
  return nearest_rank(s, p);
}

LatencySummary summarize(std::vector<double> s) {
  LatencySummary r;
  if (s.empty()) return r;
  std::sort(s.begin(), s.end());
  double sum = 0;
  for (double v : s) sum += v;
  r.min_ms = s.front() * 1e3;
  r.max_ms = s.back() * 1e3;
  r.mean_ms = sum / static_cast<double>(s.size()) * 1e3;
  r.p50_ms = nearest_rank(s, 0.50) * 1e3;
  r.p90_ms = nearest_rank(s, 0.90) * 1e3;
  r.p99_ms = nearest_rank(s, 0.99) * 1e3;
  return r;
}

uint64_t parse_budget(const std::string& text, float* percent) {
  *percent = 0.0f;
  const auto bad = [&] {
    return CliError("--max-resident: '" + text + "' is not a size (bytes, or with K, M, G, T (x1024), or a "
                    "percentage of the experts such as 25%)");
  };
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    throw bad();
  }
  if (!(value >= 0) || !std::isfinite(value)) throw bad();
  std::string unit = text.substr(used);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (unit == "%") {
    if (value > 100) throw CliError("--max-resident: " + text + " is more than 100%");
    *percent = static_cast<float>(value);
    return 0;
  }
  double scale = 1;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "K" || unit == "KB" || unit == "KIB") scale = 1024.0;
  else if (unit == "M" || unit == "MB" || unit == "MIB") scale = 1024.0 * 1024;
  else if (unit == "G" || unit == "GB" || unit == "GIB") scale = 1024.0 * 1024 * 1024;
  else if (unit == "T" || unit == "TB" || unit == "TIB") scale = 1024.0 * 1024 * 1024 * 1024;
  else throw bad();
  const double bytes = value * scale;
  if (bytes >= 1.8e19) throw bad();
  return static_cast<uint64_t>(bytes);
}

void apply_cache_flags(const CacheFlags& f, colibri_open_options_t* o) {
  if (!f.max_resident.empty()) o->max_resident_bytes = parse_budget(f.max_resident, &o->max_resident_percent);
  if (f.eviction == "lru") {
    o->eviction_policy = COLIBRI_EVICT_LRU;
  } else if (f.eviction == "freq") {
    o->eviction_policy = COLIBRI_EVICT_DECAYED_FREQUENCY;
  } else {
    throw CliError("--eviction: '" + f.eviction + "' is not freq or lru");
  }
  o->io_threads = f.io_threads;
  if (f.io_engine == "pread") {
    o->io_engine = COLIBRI_IO_PREAD;
  } else if (f.io_engine == "io_uring") {
    o->io_engine = COLIBRI_IO_URING;
  } else {
    throw CliError("--io-engine: '" + f.io_engine + "' is not pread or io_uring");
  }
  o->direct_io = f.buffered_io ? 0 : 1;
  o->speculate = f.no_speculate ? 0 : 1;
  o->tune_kernels = f.no_tune ? 0 : 1;
}

bool ProgressLine::wanted(bool forced) { return forced || isatty(STDERR_FILENO) != 0; }

void ProgressLine::update(double fraction, const std::string& detail) {
  const auto now = std::chrono::steady_clock::now();
  const bool last = fraction >= 1.0;
  if (!last && drawn_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  drawn_ = true;
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(std::min(1.0, std::max(0.0, fraction)) * kWidth);
  std::string bar(static_cast<size_t>(filled), '#');
  bar.resize(kWidth, '.');
  std::fprintf(stderr, "\r%s [%s] %3.0f%%%s%s ", label_.c_str(), bar.c_str(), fraction * 100.0,
               detail.empty() ? "" : "  ", detail.c_str());
  std::fflush(stderr);
}

void ProgressLine::finish(bool keep) {
  if (drawn_) std::fprintf(stderr, keep ? "\n" : "\r\033[K");
  std::fflush(stderr);
  drawn_ = false;
}

int32_t ProgressLine::on_open(float progress, void* line) {
  static_cast<ProgressLine*>(line)->update(progress);
  return 1;
}

void open_model(const std::string& dir, int threads, bool verify, ModelHandle* out, const std::string& precision,
                const CacheFlags& cache) {
  colibri_open_options_t options;
  colibri_open_options_default(&options);
  apply_cache_flags(cache, &options);
  options.n_threads = threads;
  options.verify_checksums = verify ? 1 : 0;
  options.exact_prefill = precision == "exact" ? 1 : 0;
  options.bf16_compute = precision == "bf16" ? 1 : 0;
  // A progress line only where a person watches; pipes and logs stay clean.
  ProgressLine line("opening " + dir);
  if (ProgressLine::wanted(false)) {
    options.progress = ProgressLine::on_open;
    options.progress_user_data = &line;
  }
  const colibri_status_t status = colibri_open(dir.c_str(), &options, &out->model);
  line.finish(false);
  check(status, "open " + dir);
  const std::string warning = colibri_last_warning();
  if (!warning.empty()) std::fprintf(stderr, "colibri: warning: %s\n", warning.c_str());
}

void print_cache_stats(const colibri_stats_t& c) {
  if (c.cache_slots == 0) return;
  std::printf("resident     %s for %d experts (%.1f%% of the experts' %s); %llu resident now\n",
              human_bytes(c.resident_bytes).c_str(), c.cache_slots,
              100.0 * static_cast<double>(c.resident_bytes) / static_cast<double>(c.experts_bytes),
              human_bytes(c.experts_bytes).c_str(), static_cast<unsigned long long>(c.resident_experts));
  const uint64_t lookups = c.cache_hits + c.cache_misses;
  if (lookups == 0) return;
  std::printf("cache        %llu hits, %llu misses (hit rate %.1f%%), %llu evictions\n",
              static_cast<unsigned long long>(c.cache_hits), static_cast<unsigned long long>(c.cache_misses),
              100.0 * static_cast<double>(c.cache_hits) / static_cast<double>(lookups),
              static_cast<unsigned long long>(c.cache_evictions));
  std::printf("reads        %llu (%llu O_DIRECT, %llu io_uring, %llu failed), %s, %.3f s summed over readers (%.3f s checksums), "
              "%.0f MB/s per reader; calls waited %.3f s\n",
              static_cast<unsigned long long>(c.expert_reads), static_cast<unsigned long long>(c.direct_reads),
              static_cast<unsigned long long>(c.uring_reads),
              static_cast<unsigned long long>(c.expert_read_failures), human_bytes(c.bytes_read).c_str(),
              c.read_seconds, c.checksum_seconds, c.read_seconds > 0 ? c.bytes_read / c.read_seconds / 1e6 : 0.0,
              c.wait_seconds);
  if (c.prefetch_reads > 0 || c.predicted > 0) {
    std::printf("prefetch     %llu reads, %llu used; router speculation %llu predicted, %llu right (%.1f%%)\n",
                static_cast<unsigned long long>(c.prefetch_reads), static_cast<unsigned long long>(c.prefetch_used),
                static_cast<unsigned long long>(c.predicted), static_cast<unsigned long long>(c.predicted_used),
                c.predicted > 0 ? 100.0 * static_cast<double>(c.predicted_used) / static_cast<double>(c.predicted) : 0.0);
  }
}

std::string cache_stats_json(const colibri_stats_t& c) {
  if (c.cache_slots == 0) return "null";
  char buf[1024];
  std::snprintf(buf, sizeof buf,
                "{\"slots\": %d, \"resident_bytes\": %llu, \"experts_bytes\": %llu, \"hits\": %llu, "
                "\"misses\": %llu, \"evictions\": %llu, \"reads\": %llu, \"direct_reads\": %llu, \"uring_reads\": %llu, "
                "\"read_failures\": %llu, \"bytes_read\": %llu, \"read_seconds\": %.6f, "
                "\"checksum_seconds\": %.6f, \"wait_seconds\": %.6f, \"prefetch_reads\": %llu, "
                "\"prefetch_used\": %llu, \"predicted\": %llu, \"predicted_used\": %llu}",
                c.cache_slots, static_cast<unsigned long long>(c.resident_bytes),
                static_cast<unsigned long long>(c.experts_bytes), static_cast<unsigned long long>(c.cache_hits),
                static_cast<unsigned long long>(c.cache_misses), static_cast<unsigned long long>(c.cache_evictions),
                static_cast<unsigned long long>(c.expert_reads), static_cast<unsigned long long>(c.direct_reads),
                static_cast<unsigned long long>(c.uring_reads),
                static_cast<unsigned long long>(c.expert_read_failures), static_cast<unsigned long long>(c.bytes_read),
                c.read_seconds, c.checksum_seconds, c.wait_seconds, static_cast<unsigned long long>(c.prefetch_reads),
                static_cast<unsigned long long>(c.prefetch_used), static_cast<unsigned long long>(c.predicted),
                static_cast<unsigned long long>(c.predicted_used));
  return buf;
}

std::string human_bytes(uint64_t bytes) {
  char buf[64];
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else if (b >= 1024.0 * 1024) std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1024.0 * 1024));
  else if (b >= 1024.0) std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  else std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  return buf;
}

const char* huge_page_kind_name(colibri_huge_page_kind_t kind) {
  switch (kind) {
    case COLIBRI_HUGE_PAGES_HUGETLBFS: return "hugetlbfs";
    case COLIBRI_HUGE_PAGES_TRANSPARENT: return "transparent";
    case COLIBRI_HUGE_PAGES_NONE: break;
  }
  return "none";
}

Routing random_routing(int32_t T, int32_t k, int32_t E, std::mt19937_64& rng) {
  Routing r;
  r.k = k;
  r.ids.resize(static_cast<size_t>(T) * k);
  r.weights.resize(r.ids.size());
  std::vector<int32_t> perm(static_cast<size_t>(E));
  for (int32_t e = 0; e < E; ++e) perm[static_cast<size_t>(e)] = e;
  std::uniform_real_distribution<float> logit(0.0f, 2.0f);
  for (int32_t t = 0; t < T; ++t) {
    // Partial Fisher-Yates: the first k of perm become the token's experts.
    float sum = 0;
    for (int32_t j = 0; j < k; ++j) {
      std::uniform_int_distribution<int32_t> pick(j, E - 1);
      std::swap(perm[static_cast<size_t>(j)], perm[static_cast<size_t>(pick(rng))]);
      r.ids[static_cast<size_t>(t) * k + j] = perm[static_cast<size_t>(j)];
      const float w = std::exp(logit(rng));
      r.weights[static_cast<size_t>(t) * k + j] = w;
      sum += w;
    }
    for (int32_t j = 0; j < k; ++j) r.weights[static_cast<size_t>(t) * k + j] /= sum;
  }
  return r;
}


colibri_model_info_t model_info(const ModelHandle& h) {
  colibri_model_info_t info;
  check(colibri_model_info(h.model, &info), "model info");
  return info;
}

std::string dtype_label(colibri_dtype_t dtype, colibri_dtype_t down_dtype) {
  std::string s = colibri_dtype_name(dtype);
  if (down_dtype != dtype) s += std::string(" (down ") + colibri_dtype_name(down_dtype) + ")";
  return s;
}

std::string dtype_label(colibri::WeightType dtype, colibri::WeightType down_dtype) {
  return dtype_label(static_cast<colibri_dtype_t>(dtype), static_cast<colibri_dtype_t>(down_dtype));
}

RoutingWork routing_work(const colibri_model_info_t& info, int32_t T, int32_t k, const int32_t* ids) {
  std::set<int32_t> active;
  size_t slots = 0;
  for (size_t i = 0; i < static_cast<size_t>(T) * static_cast<size_t>(k); ++i) {
    if (ids[i] < 0) continue;
    active.insert(ids[i]);
    ++slots;
  }
  // Bytes of one expert as the kernels read them (rows of whole blocks).
  const double expert_bytes =
      2.0 * info.d_ff * static_cast<double>(colibri_dtype_row_bytes(info.dtype, static_cast<size_t>(info.d_model))) +
      static_cast<double>(info.d_model) *
          static_cast<double>(colibri_dtype_row_bytes(info.down_dtype, static_cast<size_t>(info.d_ff)));
  RoutingWork w;
  w.bytes = static_cast<double>(active.size()) * expert_bytes;
  w.flop = static_cast<double>(slots) * 2.0 * 3.0 * info.d_model * info.d_ff;
  return w;
}

SwapStress::SwapStress(colibri_model_t* model, int32_t layer, int32_t expert, std::vector<uint8_t> bytes,
                       colibri_dtype_t dtype, long every)
    : model_(model), layer_(layer), expert_(expert), bytes_(std::move(bytes)), dtype_(dtype), every_(every) {
  thread_ = std::thread([this] { run(); });
}

SwapStress::~SwapStress() { stop(); }

void SwapStress::request_done() {
  if ((done_.fetch_add(1) + 1) % every_ != 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  ++due_;
  cv_.notify_one();
}

void SwapStress::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    cv_.notify_one();
  }
  if (thread_.joinable()) thread_.join();
}

void SwapStress::run() {
  colibri_swap_source_t s;
  colibri_swap_source_default(&s);
  s.data = bytes_.data();
  s.size = bytes_.size();
  s.dtype = dtype_;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    cv_.wait(lock, [this] { return due_ > 0 || stopping_; });
    if (due_ == 0) return;  // stopping, nothing left to do
    --due_;
    lock.unlock();
    if (colibri_swap_expert(model_, layer_, expert_, &s) == COLIBRI_OK) {
      swaps_.fetch_add(1);
    } else {
      if (failures_.fetch_add(1) == 0) first_error_ = colibri_last_error();
    }
    lock.lock();
  }
}

}  // namespace colibri_cli
