#include "moe/doctor.h"

#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/manifest.h"
#include "kernels/amx.h"
#include "kernels/kernels.h"
#include "kernels/quant_dot.h"
#include "moe/gguf_model.h"
#include "moe/kernel_choice.h"
#include "runtime/thread_pool.h"
#include "util/weight_format.h"

namespace colibri {

namespace {

using json = nlohmann::ordered_json;

std::string read_first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return "";
  return line;
}

// "always [madvise] never" -> "madvise".
std::string bracketed(const std::string& line) {
  const size_t a = line.find('['), b = line.find(']');
  return a != std::string::npos && b != std::string::npos && b > a ? line.substr(a + 1, b - a - 1) : line;
}

// /proc/meminfo's value for `key` in bytes (its kB figures), or -1.
int64_t meminfo_bytes(const std::string& key, bool count = false) {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) != 0) continue;
    std::istringstream ss(line.substr(key.size() + 1));
    int64_t v = -1;
    ss >> v;
    return count ? v : v * 1024;
  }
  return -1;
}

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

// CPUs this process may run on, and how many distinct physical cores they
// are (SMT siblings share one; decode is bound by memory, not by them).
std::pair<int, int> allowed_cpus_and_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return {online_cores(), online_cores()};
  int allowed = 0;
  std::set<std::pair<std::string, std::string>> cores;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    ++allowed;
    const std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
    const std::string core = read_first_line(base + "core_id");
    cores.emplace(read_first_line(base + "physical_package_id"), core.empty() ? "cpu" + std::to_string(cpu) : core);
  }
  return {allowed, cores.empty() ? allowed : static_cast<int>(cores.size())};
}

// Packed bytes of every routed expert, from the manifest's shapes.
uint64_t experts_bytes(const Manifest& m) {
  uint64_t total = 0;
  for (int32_t l = 0; l < m.n_layers; ++l) {
    const LayerTypes t = m.layer_types(l);
    const uint64_t per = 2 * static_cast<uint64_t>(m.d_ff) * weight_row_bytes(t.dtype, static_cast<size_t>(m.d_model)) +
                         static_cast<uint64_t>(m.d_model) * weight_row_bytes(t.down_dtype, static_cast<size_t>(m.d_ff));
    total += per * static_cast<uint64_t>(m.n_experts);
  }
  return total;
}

json model_section(const std::string& path, int threads, std::string* source) {
  Manifest m;
  if (is_gguf_file(path)) {
    const GgufModel g = load_gguf_model(path);
    m = g.manifest;
    *source = "gguf " + g.architecture + ", " + g.expert_types;
  } else {
    m = load_manifest(path);
    *source = "colibri model directory";
  }
  json out;
  out["path"] = path;
  out["source"] = *source;
  out["layers"] = m.n_layers;
  out["experts"] = m.n_experts;
  out["d_model"] = m.d_model;
  out["d_ff"] = m.d_ff;
  out["experts_bytes"] = experts_bytes(m);
  // Each distinct expert shape's kernels at the level this process runs,
  // and what a measurement at open remembered for it (kernel_choice.h).
  json kernels = json::array();
  std::vector<LayerTypes> seen;
  KernelChoiceRequest request;
  request.isa = kernels::default_isa();
  request.threads = threads > 0 ? std::min(threads, online_cores()) : online_cores();
  request.n_experts = m.n_experts;
  request.top_k = m.has_router() ? m.router.top_k : std::min(m.n_experts, 8);
  request.cache_path = kernel_choice_cache_path();
  for (int32_t l = 0; l < m.n_layers; ++l) {
    const LayerTypes t = m.layer_types(l);
    bool dup = false;
    for (const LayerTypes& s : seen) dup |= s == t;
    if (dup) continue;
    seen.push_back(t);
    const kernels::ExpertShape shape = kernels::make_expert_shape(m.d_model, m.d_ff, t.dtype, t.down_dtype);
    json k;
    k["types"] = std::string(weight_format(t.dtype).name) + "/" + weight_format(t.down_dtype).name;
    k["registry"] = kernels::describe_plan(
        kernels::plan_kernels(request.isa, shape, kernels::PrefillPrecision::kDefault), "tokens/expert");
    const std::string remembered = remembered_kernel_choice(request, shape);
    k["measured"] = remembered.empty() ? json(nullptr) : json(remembered);
    kernels.push_back(k);
  }
  out["kernels"] = kernels;
  return out;
}

}  // namespace

std::string doctor_report(const std::string& model_path, int threads) {
  json r;
  json problems = json::array();
  const auto problem = [&problems](const std::string& what, const std::string& fix) {
    problems.push_back({{"problem", what}, {"fix", fix}});
  };

  const kernels::Isa detected = kernels::detect_isa(), used = kernels::default_isa();
  json features = json::array();
  if (detected >= kernels::Isa::kAvx2) features.push_back("avx2");
  if (kernels::cpu_has_avx_vnni()) features.push_back("avx_vnni");
  if (detected >= kernels::Isa::kAvx512) features.push_back("avx512");
  if (kernels::cpu_has_avx512_vnni()) features.push_back("avx512_vnni");
  if (kernels::cpu_has_avx512_bf16()) features.push_back("avx512_bf16");
  if (kernels::amx_available()) features.push_back("amx_bf16");
  if (kernels::amx_int8_available()) features.push_back("amx_int8");
  r["cpu"] = {{"name", kernels::cpu_signature()},
              {"level", kernels::isa_name(used)},
              {"detected_level", kernels::isa_name(detected)},
              {"features", features},
              {"far_prefetch", kernels::far_prefetch_nta() ? "nta" : "l2"}};
  if (detected == kernels::Isa::kScalar) {
    problem("this CPU (or VM) exposes no AVX2+FMA+F16C: every kernel runs the portable scalar code, many times slower",
            "run on an x86-64 CPU from 2013 on (Haswell, Zen) or let the hypervisor pass AVX2 through");
  }
  if (used < detected) {
    problem(std::string("COLIBRI_ISA lowers the kernels from ") + kernels::isa_name(detected) + " to " +
                kernels::isa_name(used),
            "unset COLIBRI_ISA");
  }

  const auto [allowed, cores] = allowed_cpus_and_cores();
  const int asked = threads > 0 ? threads : online_cores();
  r["cores"] = {{"online", online_cores()}, {"allowed", allowed}, {"physical", cores},
                {"threads", asked}, {"recommended_threads", cores}};
  if (asked > cores) {
    problem(std::to_string(asked) + " threads on " + std::to_string(cores) +
                " physical cores: decode streams weights from memory, and threads sharing a core (or more threads "
                "than cores) only contend",
            "open with threads=" + std::to_string(cores) + " (CLI --threads " + std::to_string(cores) + ")");
  }

  const int64_t total = meminfo_bytes("MemTotal"), available = meminfo_bytes("MemAvailable");
  r["memory"] = {{"total_bytes", total}, {"available_bytes", available}};

  const std::string thp = bracketed(read_first_line("/sys/kernel/mm/transparent_hugepage/enabled"));
  const std::string defrag = bracketed(read_first_line("/sys/kernel/mm/transparent_hugepage/defrag"));
  const int64_t huge_total = meminfo_bytes("HugePages_Total", true), huge_free = meminfo_bytes("HugePages_Free", true);
  r["huge_pages"] = {{"thp_enabled", thp.empty() ? json(nullptr) : json(thp)},
                     {"thp_defrag", defrag.empty() ? json(nullptr) : json(defrag)},
                     {"hugetlb_pages", huge_total},
                     {"hugetlb_free", huge_free},
                     {"hugetlb_page_bytes", meminfo_bytes("Hugepagesize")}};
  if ((thp.empty() || thp == "never") && huge_total <= 0) {
    problem("no huge pages: transparent huge pages are off and no hugetlbfs pages are reserved, so the weights sit "
            "on 4 KiB pages (more TLB misses for every weight read)",
            "echo madvise | sudo tee /sys/kernel/mm/transparent_hugepage/enabled");
  }

  struct rlimit lim {};
  const bool have_limit = getrlimit(RLIMIT_MEMLOCK, &lim) == 0;
  const bool unlimited = have_limit && lim.rlim_cur == RLIM_INFINITY;
  const bool root = ::geteuid() == 0;  // CAP_IPC_LOCK: the limit does not apply
  r["memlock"] = {{"limit_bytes", !have_limit || unlimited ? json(nullptr) : json(static_cast<uint64_t>(lim.rlim_cur))},
                  {"unlimited", unlimited},
                  {"root", root}};

  const std::string nodes = read_first_line("/sys/devices/system/node/online");
  int node_count = 0;
  {
    std::stringstream ss(nodes);
    for (std::string part; std::getline(ss, part, ',');) {
      const size_t dash = part.find('-');
      node_count += dash == std::string::npos ? 1 : std::atoi(part.c_str() + dash + 1) - std::atoi(part.c_str()) + 1;
    }
  }
  r["numa"] = {{"nodes", nodes.empty() ? json(nullptr) : json(nodes)}, {"count", node_count}};
  if (node_count > 1) {
    problem(std::to_string(node_count) + " NUMA nodes: threads on one node reading weights placed on another run at "
                "the interconnect's bandwidth",
            "numactl --cpunodebind=0 --membind=0 <command> (one node's cores and memory), or numactl "
            "--interleave=all when the model needs every node's memory");
  }

  const char* isa_env = std::getenv("COLIBRI_ISA");
  const char* tune_env = std::getenv("COLIBRI_TUNE");
  const char* prefetch_env = std::getenv("COLIBRI_PREFETCH");
  r["environment"] = {{"COLIBRI_ISA", isa_env != nullptr ? json(isa_env) : json(nullptr)},
                      {"COLIBRI_TUNE", tune_env != nullptr ? json(tune_env) : json(nullptr)},
                      {"COLIBRI_PREFETCH", prefetch_env != nullptr ? json(prefetch_env) : json(nullptr)},
                      {"kernel_choice_cache", kernel_choice_cache_path()},
                      {"kernel_choice_at_open", kernel_choice_allowed_by_environment()}};

  r["model"] = nullptr;
  if (!model_path.empty()) {
    std::string source;
    json m = model_section(model_path, threads, &source);
    const uint64_t bytes = m["experts_bytes"].get<uint64_t>();
    if (available > 0 && static_cast<double>(bytes) > 0.9 * static_cast<double>(available)) {
      const auto budget = static_cast<uint64_t>(0.7 * static_cast<double>(available));
      problem("the model's experts (" + gib(static_cast<double>(bytes)) + ") do not fit in the available memory (" +
                  gib(static_cast<double>(available)) + ")",
              "open with a memory budget, e.g. max_resident=\"" + std::to_string(budget >> 30) +
                  "G\" (CLI --max-resident " + std::to_string(budget >> 30) +
                  "G): the rest of the experts are read from the file on demand (docs/CACHE.md)");
    }
    if (!root && have_limit && !unlimited && lim.rlim_cur < bytes) {
      problem("mlock of the weights will be refused: RLIMIT_MEMLOCK is " + gib(static_cast<double>(lim.rlim_cur)) +
                  " (the model's experts take " + gib(static_cast<double>(bytes)) + "), so they may be paged out",
              "ulimit -l unlimited (or a memlock line in /etc/security/limits.conf), or open with lock=False");
    }
    r["model"] = m;
  }
  r["problems"] = problems;
  return r.dump(1);
}

}  // namespace colibri
