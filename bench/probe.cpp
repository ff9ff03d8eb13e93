// colibri_probe: this machine's limits, measured in the same run as the
// benchmarks they are compared with (the host's bandwidth swings by 2x with
// other load, so a figure from another day means little). Prints one JSON
// object on stdout; progress goes to stderr.
//
//   read      read-only streaming over arrays far larger than the LLC, the way
//             decode reads expert weights: all threads, several streams each,
//             widest loads the CPU has; with THP and with 4 KiB pages
//   triad     STREAM a = b + s*c, counted as 3 arrays (no write-allocate)
//   fp32 FMA  register-only, independent accumulators, all threads
//   bf16 dot  vdpbf16ps zmm when the CPU has AVX512_BF16
//   int8 dot  vpdpbusd zmm with AVX512_VNNI, else vpmaddubsw + vpmaddwd +
//             vpaddd on ymm with AVX2 (the block formats' kernels); its
//             "gflop_per_s" counts int8 multiply-adds as 2 ops
//   AMX bf16  tdpbf16ps when the CPU and kernel allow AMX (what oneDNN, so
//             PyTorch bf16, uses there)
//
// Every figure is the best of several runs of ~0.3 s each: the best run is
// the one least disturbed by whatever else the host was doing.
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "probe_kernels.h"
#include "probe_runtime.h"

namespace colibri_probe {

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;


// ------------------------------------------------------------ generic loops

// Plain C++ for CPUs (or builds) without AVX2; the compiler vectorises what
// it can with the baseline ISA.
float generic_read(const float* const* streams, int n_streams, size_t n) {
  float acc[8][8] = {};
  for (size_t i = 0; i < n; i += 8) {
    for (int s = 0; s < n_streams; ++s) {
      for (int j = 0; j < 8; ++j) acc[s & 7][j] += streams[s][i + static_cast<size_t>(j)];
    }
  }
  float sum = 0;
  for (auto& row : acc) {
    for (float v : row) sum += v;
  }
  return sum;
}

void generic_triad(float* a, const float* b, const float* c, float s, size_t n, bool) {
  for (size_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

float generic_fma(uint64_t iters) {
  float acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = static_cast<float>(j);
  for (uint64_t i = 0; i < iters; ++i) {
    for (float& v : acc) v = v * 0.999999f + 1e-7f;
  }
  float sum = 0;
  for (float v : acc) sum += v;
  return sum;
}

// Keeps the loops' results alive.
std::atomic<float> g_sink{0};
void sink(float v) { g_sink.store(g_sink.load(std::memory_order_relaxed) + v, std::memory_order_relaxed); }

// ------------------------------------------------------------- CPU facts

struct CpuFacts {
  bool avx2 = false, avx512f = false, avx512_bf16 = false, avx512_vnni = false, amx_bf16 = false;
  std::string model;
  uint64_t llc_bytes = 0;
};

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        size_t start = line.find_first_not_of(" \t", colon + 1);
        return start == std::string::npos ? "" : line.substr(start);
      }
    }
  }
  return "unknown";
}

// Largest cache cpu0 sees, from sysfs ("32768K").
uint64_t llc_bytes() {
  uint64_t best = 0;
  for (int i = 0; i < 16; ++i) {
    std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/size");
    if (!f) break;
    std::string s;
    f >> s;
    if (s.empty()) continue;
    uint64_t v = std::strtoull(s.c_str(), nullptr, 10);
    const char unit = s.back();
    if (unit == 'K') v <<= 10;
    if (unit == 'M') v <<= 20;
    best = std::max(best, v);
  }
  return best;
}

CpuFacts detect_cpu() {
  CpuFacts c;
  c.model = cpu_model();
  c.llc_bytes = llc_bytes();
#if defined(COLIBRI_PROBE_X86)
  __builtin_cpu_init();
  // libgcc's checks include the OS's XCR0 state for AVX and AVX-512.
  c.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  c.avx512f = __builtin_cpu_supports("avx512f");
  // GCC 12 has no "avx512bf16" name for __builtin_cpu_supports: CPUID leaf 7
  // subleaf 1, EAX bit 5. Its registers are the AVX-512 ones, so OS support
  // is implied by avx512f above.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (c.avx512f && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) c.avx512_bf16 = (eax >> 5) & 1u;
  // AVX512_VNNI: CPUID leaf 7 subleaf 0, ECX bit 11.
  if (c.avx512f && __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) c.avx512_vnni = (ecx >> 11) & 1u;
  // AMX: CPUID.7.0 EDX bit 22 (AMX-BF16) and 24 (AMX-TILE), and the OS has
  // enabled XTILECFG and XTILEDATA (XCR0 bits 17 and 18).
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && ((edx >> 22) & 1u) && ((edx >> 24) & 1u) &&
      __get_cpuid(1, &eax, &ebx, &ecx, &edx) && ((ecx >> 27) & 1u)) {  // OSXSAVE, so xgetbv exists
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    c.amx_bf16 = ((lo >> 17) & 3u) == 3u;
  }
#endif
  return c;
}

int online_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// ----------------------------------------------------------------- timing

struct Options {
  int threads = 0, reps = 5, streams = 4;
  double seconds = 0.3;
  size_t read_mib = 1024, triad_mib = 512;
  bool quick = false, pin = false;
  std::string isa = "auto";
};

struct Measure {
  double best = 0;            // figure of the best run (GB/s or GFLOP/s)
  std::vector<double> runs;   // every run's figure
  double amount_per_run = 0;  // passes or iterations per run
};

// Calibrates how much work makes one run last ~o.seconds, then takes the
// best of o.reps runs. time_for(amount) runs amount passes (or iterations)
// and returns wall seconds; the figure is units_per_amount * amount / s / 1e9.
Measure best_of(const Options& o, const std::function<double(uint64_t)>& time_for,
                double units_per_amount, uint64_t start_amount) {
  uint64_t amount = std::max<uint64_t>(1, start_amount);
  double t = time_for(amount);
  while (t < o.seconds / 4 && amount < (uint64_t{1} << 40)) {
    amount *= 2;
    t = time_for(amount);
  }
  amount = std::max<uint64_t>(1, static_cast<uint64_t>(static_cast<double>(amount) * o.seconds / std::max(t, 1e-9)));
  Measure m;
  m.amount_per_run = static_cast<double>(amount);
  for (int r = 0; r < o.reps; ++r) {
    const double s = time_for(amount);
    const double fig = units_per_amount * static_cast<double>(amount) / s / 1e9;
    m.runs.push_back(fig);
    m.best = std::max(m.best, fig);
  }
  return m;
}

json measure_json(const Measure& m, const char* unit) {
  json runs = json::array();
  for (double v : m.runs) runs.push_back(std::round(v * 100) / 100);
  return {{unit, std::round(m.best * 100) / 100}, {"runs", runs}, {"per_run", m.amount_per_run}};
}

// Parallel first touch: each member faults in the part it will read, and the
// values are small so sums stay finite.
void touch(Team& team, float* p, size_t n) {
  team.run([&](int id) {
    const size_t per = n / static_cast<size_t>(team.size());
    const size_t lo = per * static_cast<size_t>(id);
    const size_t hi = id == team.size() - 1 ? n : lo + per;
    for (size_t i = lo; i < hi; ++i) p[i] = 1e-3f * static_cast<float>(i & 1023);
  });
}

json read_probe(const Options& o, const Kernels& k, Team& team, int members, bool huge) {
  Buffer buf(o.read_mib * kMiB, huge);
  touch(team, buf.data(), buf.floats());
  const int S = o.streams;
  // Each member reads S streams of n floats; n is a whole number of 4 KiB
  // pages so streams never share a page.
  const size_t n = buf.floats() / static_cast<size_t>(members * S) / 1024 * 1024;
  const double bytes_per_pass = static_cast<double>(n) * sizeof(float) * members * S;
  auto time_for = [&](uint64_t passes) {
    return team.run([&](int id) {
      if (id >= members) return;
      const float* ptrs[8];
      for (int s = 0; s < S; ++s) ptrs[s] = buf.data() + static_cast<size_t>(id * S + s) * n;
      float acc = 0;
      for (uint64_t p = 0; p < passes; ++p) acc += k.read(ptrs, S, n);
      sink(acc);
    });
  };
  const Measure m = best_of(o, time_for, bytes_per_pass, 1);
  json j = measure_json(m, "gbytes_per_s");
  const uint64_t thp = buf.thp_bytes();
  j["threads"] = members;
  j["bytes"] = bytes_per_pass;
  j["madvise"] = huge ? "MADV_HUGEPAGE" : "MADV_NOHUGEPAGE";
  j["madvise_ok"] = buf.advice_ok();
  j["thp_bytes"] = thp;
  j["thp_fraction"] = std::round(static_cast<double>(thp) / static_cast<double>(buf.bytes()) * 1000) / 1000;
  return j;
}

json triad_probe(const Options& o, const Kernels& k, Team& team, bool nontemporal) {
  const size_t bytes = o.triad_mib * kMiB;
  Buffer a(bytes, true), b(bytes, true), c(bytes, true);
  touch(team, a.data(), a.floats());
  touch(team, b.data(), b.floats());
  touch(team, c.data(), c.floats());
  const size_t per = a.floats() / static_cast<size_t>(team.size()) / 1024 * 1024;
  const double bytes_per_pass = 3.0 * static_cast<double>(per) * sizeof(float) * team.size();
  auto time_for = [&](uint64_t passes) {
    return team.run([&](int id) {
      const size_t off = per * static_cast<size_t>(id);
      for (uint64_t p = 0; p < passes; ++p) k.triad(a.data() + off, b.data() + off, c.data() + off, 0.5f, per, nontemporal);
    });
  };
  const Measure m = best_of(o, time_for, bytes_per_pass, 1);
  sink(a.data()[per / 2]);
  json j = measure_json(m, "gbytes_per_s");
  j["bytes_per_array"] = static_cast<double>(per) * sizeof(float) * team.size();
  j["stores"] = nontemporal ? "non-temporal" : "regular";
  j["thp_fraction"] =
      std::round(static_cast<double>(a.thp_bytes() + b.thp_bytes() + c.thp_bytes()) / (3.0 * static_cast<double>(bytes)) * 1000) / 1000;
  return j;
}

json compute_probe(const Options& o, Team& team, const std::function<float(uint64_t)>& loop,
                   double flop_per_iter) {
  auto time_for = [&](uint64_t iters) {
    return team.run([&](int) { sink(loop(iters)); });
  };
  const Measure m = best_of(o, time_for, flop_per_iter * team.size(), 1 << 16);
  json j = measure_json(m, "gflop_per_s");
  j["threads"] = team.size();
  return j;
}

[[noreturn]] void usage(int code) {
  std::fprintf(code == 0 ? stdout : stderr,
               "usage: colibri_probe [--threads N] [--quick] [--reps R] [--seconds S]\n"
               "                     [--read-mib M] [--triad-mib M] [--streams 1|2|4|8]\n"
               "                     [--isa auto|avx512|avx2|generic] [--pin]\n"
               "Prints this machine's read bandwidth (huge and 4 KiB pages), STREAM triad,\n"
               "fp32 FMA, bf16 and int8 dot-product peaks as JSON.\n");
  std::exit(code);
}

Options parse(int argc, char** argv) {
  Options o;
  bool reps_set = false, seconds_set = false, read_set = false, triad_set = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "colibri_probe: %s needs a value\n", a.c_str());
        usage(2);
      }
      return argv[++i];
    };
    if (a == "--threads") o.threads = std::atoi(value().c_str());
    else if (a == "--quick") o.quick = true;
    else if (a == "--reps") { o.reps = std::atoi(value().c_str()); reps_set = true; }
    else if (a == "--seconds") { o.seconds = std::atof(value().c_str()); seconds_set = true; }
    else if (a == "--read-mib") { o.read_mib = std::strtoull(value().c_str(), nullptr, 10); read_set = true; }
    else if (a == "--triad-mib") { o.triad_mib = std::strtoull(value().c_str(), nullptr, 10); triad_set = true; }
    else if (a == "--streams") o.streams = std::atoi(value().c_str());
    else if (a == "--isa") o.isa = value();
    else if (a == "--pin") o.pin = true;
    else if (a == "-h" || a == "--help") usage(0);
    else {
      std::fprintf(stderr, "colibri_probe: unknown argument %s\n", a.c_str());
      usage(2);
    }
  }
  if (o.quick) {
    // A smoke run: the figures are meaningless (arrays may fit in the LLC).
    if (!reps_set) o.reps = 2;
    if (!seconds_set) o.seconds = 0.03;
    if (!read_set) o.read_mib = 64;
    if (!triad_set) o.triad_mib = 32;
  }
  if (o.threads < 0 || o.reps < 1 || o.seconds <= 0 || o.read_mib < 16 || o.triad_mib < 4 ||
      (o.streams != 1 && o.streams != 2 && o.streams != 4 && o.streams != 8) ||
      (o.isa != "auto" && o.isa != "avx512" && o.isa != "avx2" && o.isa != "generic")) {
    usage(2);
  }
  if (o.threads == 0) o.threads = online_cpus();
  return o;
}

int probe_main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const CpuFacts cpu = detect_cpu();
  Kernels k = generic_kernels();
#if defined(COLIBRI_PROBE_X86)
  const bool want512 = o.isa == "auto" || o.isa == "avx512";
  const bool want2 = want512 || o.isa == "avx2";
  if (want512 && cpu.avx512f) k = avx512_kernels();
  else if (want2 && cpu.avx2) k = avx2_kernels();
#endif
  if (o.isa != "auto" && o.isa != k.name) {
    std::fprintf(stderr, "colibri_probe: --isa %s not supported here\n", o.isa.c_str());
    return 2;
  }
  const auto t_start = Clock::now();
  Team team(o.threads, o.pin);

  json out;
  out["cpu"] = cpu.model;
  out["threads"] = o.threads;
  out["isa"] = k.name;
  out["avx512_bf16"] = cpu.avx512_bf16;
  out["amx_bf16_cpu"] = cpu.amx_bf16;
  out["llc_bytes"] = cpu.llc_bytes;
  out["quick"] = o.quick;
  out["reps"] = o.reps;
  out["seconds_per_run"] = o.seconds;
  out["streams_per_thread"] = o.streams;
  out["read_bytes"] = o.read_mib * kMiB;
  out["read_exceeds_llc"] = cpu.llc_bytes == 0 || o.read_mib * kMiB >= 2 * cpu.llc_bytes;
  if (std::FILE* thp = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r")) {
    char line[128] = {};
    if (std::fgets(line, sizeof line, thp)) {
      std::string s(line);
      while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
      out["thp_setting"] = s;
    }
    std::fclose(thp);
  }

  std::fprintf(stderr, "probe: %d threads, %s loads, %zu MiB read arrays\n", o.threads, k.name, o.read_mib);
  std::fprintf(stderr, "probe: read bandwidth, huge pages ...\n");
  out["read_huge"] = read_probe(o, k, team, o.threads, true);
  std::fprintf(stderr, "probe: read bandwidth, 4 KiB pages ...\n");
  out["read_4k"] = read_probe(o, k, team, o.threads, false);
  if (o.threads > 1) {
    std::fprintf(stderr, "probe: read bandwidth, one thread ...\n");
    out["read_huge_1thread"] = read_probe(o, k, team, 1, true);
  }
  std::fprintf(stderr, "probe: STREAM triad ...\n");
  out["triad"] = triad_probe(o, k, team, false);
  out["triad_nt"] = triad_probe(o, k, team, true);
  std::fprintf(stderr, "probe: fp32 FMA peak ...\n");
  const double fma_flop = 2.0 * k.fma_accumulators * (k.vector_bits / 32);
  out["fma_fp32"] = compute_probe(o, team, k.fma, fma_flop);
  out["fma_fp32"]["accumulators"] = k.fma_accumulators;
  out["fma_fp32"]["vector_bits"] = k.vector_bits;
  out["bf16_dot"] = nullptr;
#if defined(COLIBRI_PROBE_X86)
  if (cpu.avx512_bf16 && std::string(k.name) == "avx512") {
    std::fprintf(stderr, "probe: bf16 dot-product peak ...\n");
    out["bf16_dot"] = compute_probe(o, team, bf16_dot_avx512, 64.0 * kBf16Accumulators);
    out["bf16_dot"]["accumulators"] = kBf16Accumulators;
    out["bf16_dot"]["instruction"] = "vdpbf16ps zmm";
  }
  out["int8_dot"] = nullptr;
  if (cpu.avx512_vnni && std::string(k.name) == "avx512") {
    std::fprintf(stderr, "probe: int8 dot-product peak ...\n");
    out["int8_dot"] = compute_probe(o, team, int8_dot_avx512_vnni, 128.0 * kInt8Accumulators);
    out["int8_dot"]["instruction"] = "vpdpbusd zmm";
  } else if (cpu.avx2) {
    std::fprintf(stderr, "probe: int8 dot-product peak ...\n");
    out["int8_dot"] = compute_probe(o, team, int8_dot_avx2, 64.0 * kInt8Accumulators);
    out["int8_dot"]["instruction"] = "vpmaddubsw + vpmaddwd + vpaddd ymm";
  }
  if (!out["int8_dot"].is_null()) out["int8_dot"]["accumulators"] = kInt8Accumulators;
  out["amx_bf16"] = nullptr;
  if (cpu.amx_bf16 && amx_enable()) {
    std::fprintf(stderr, "probe: AMX bf16 peak ...\n");
    out["amx_bf16"] = compute_probe(o, team, amx_bf16_dot, kAmxFlopPerIter);
    out["amx_bf16"]["instruction"] = "tdpbf16ps, 4 accumulator tiles";
  }
#endif
  // The figures the suite compares against, in one place.
  out["summary"] = {
      {"read_gbytes_per_s_huge", out["read_huge"]["gbytes_per_s"]},
      {"read_gbytes_per_s_4k", out["read_4k"]["gbytes_per_s"]},
      {"triad_gbytes_per_s", out["triad"]["gbytes_per_s"]},
      {"fp32_gflop_per_s", out["fma_fp32"]["gflop_per_s"]},
      {"bf16_gflop_per_s", out["bf16_dot"].is_null() ? json(nullptr) : out["bf16_dot"]["gflop_per_s"]},
      {"int8_gop_per_s", out["int8_dot"].is_null() ? json(nullptr) : out["int8_dot"]["gflop_per_s"]},
      {"amx_bf16_gflop_per_s", out["amx_bf16"].is_null() ? json(nullptr) : out["amx_bf16"]["gflop_per_s"]},
  };
  out["elapsed_s"] = std::round(std::chrono::duration<double>(Clock::now() - t_start).count() * 100) / 100;
  out["sink"] = std::isfinite(g_sink.load()) ? 0 : 1;
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}

}  // namespace

Kernels generic_kernels() { return {"generic", 32, 16, generic_read, generic_triad, generic_fma}; }

}  // namespace colibri_probe

int main(int argc, char** argv) {
  try {
    return colibri_probe::probe_main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "colibri_probe: %s\n", e.what());
    return 1;
  }
}
