// colibri gen | verify | info | doctor
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "common.h"
#include "io/manifest.h"
#include "lib/gguf_info.h"
#include "lib/model_writer.h"
#include "io/verify.h"
#include "util/error.h"

namespace colibri_cli {

namespace {

struct GenArgs {
  std::string out;
  int experts = 0, d_model = 0, d_ff = 0, layers = 1;
  std::string dtype = "f16";
  uint64_t seed = 1;
  // v2: a random router of a family's rule, and a shared expert.
  std::string router;
  int top_k = 0, n_group = 1, topk_group = 1, shared_d_ff = 0;
  bool norm_topk_prob = false, shared_gate = false;
  float scaling = 1.0f;
  // v4 (gpt-oss): the clamped SwiGLU and expert biases.
  std::string activation = "swiglu";
  float swiglu_alpha = 1.702f, swiglu_limit = 7.0f;
  bool expert_bias = false;
};

void run_gen(const GenArgs& a) {
  colibri::ModelWriteSpec spec;
  spec.n_layers = a.layers;
  spec.n_experts = a.experts;
  spec.d_model = a.d_model;
  spec.d_ff = a.d_ff;
  if (!colibri::parse_dtype_mix(a.dtype, &spec.dtype, &spec.down_dtype)) {
    throw CliError("gen: --dtype: unknown dtype \"" + a.dtype + "\" (expected " + kDtypeChoices + ")");
  }
  if (!a.router.empty()) {
    if (!colibri::parse_router_family(a.router, &spec.router.family) || spec.router.family == colibri::RouterFamily::kNone) {
      throw CliError("gen: --router: unknown family \"" + a.router +
                     "\" (expected mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2, deepseek_v3 or gpt_oss)");
    }
    if (a.top_k < 1) throw CliError("gen: --router needs --top-k");
    spec.router.top_k = a.top_k;
    spec.router.norm_topk_prob = a.norm_topk_prob || spec.router.family == colibri::RouterFamily::kMixtral ||
                                         spec.router.family == colibri::RouterFamily::kGptOss
                                     ? 1
                                     : 0;
    spec.router.n_group = a.n_group;
    spec.router.topk_group = a.topk_group;
    spec.router.routed_scaling_factor = a.scaling;
  }
  spec.shared_d_ff = a.shared_d_ff;
  spec.shared_gate = a.shared_gate;
  spec.clamped_swiglu = a.activation == "clamped_swiglu";
  spec.swiglu_alpha = a.swiglu_alpha;
  spec.swiglu_limit = a.swiglu_limit;
  spec.expert_bias = a.expert_bias;
  try {
    colibri::write_random_model(a.out, spec, a.seed);
  } catch (const colibri::Error& e) {
    throw CliError(std::string("gen: ") + e.what());
  }
  std::printf("wrote %s: %d layer(s) x %d experts, d_model %d, d_ff %d, %s, seed %llu\n",
              a.out.c_str(), a.layers, a.experts, a.d_model, a.d_ff, a.dtype.c_str(),
              static_cast<unsigned long long>(a.seed));
}

void run_verify(const std::string& dir) {
  int bad = 0, files = 0;
  double hashed_bytes = 0, seconds = 0;
  try {
    colibri::verify_model_dir(dir, [&](const colibri::FileReport& r) {
      ++files;
      if (r.ok) {
        std::printf("ok    %-28s %12llu bytes  %s\n", r.file.c_str(),
                    static_cast<unsigned long long>(r.bytes), r.has_checksum ? "checksum ok" : "no checksum in manifest");
      } else {
        ++bad;
        std::printf("FAIL  %-28s %s\n", r.file.c_str(), r.problem.c_str());
      }
      if (r.has_checksum) {
        hashed_bytes += static_cast<double>(r.bytes);
        seconds += r.seconds;
      }
    });
  } catch (const colibri::Error& e) {
    if (bad == 0) throw CliError(std::string("verify: ") + e.what());
    throw CliError("verify: " + std::to_string(bad) + " of " + std::to_string(files) +
                   " files failed; first: " + e.what());
  }
  std::printf("%d files verified", files);
  if (seconds > 0) std::printf(", hashing at %.0f MB/s", hashed_bytes / seconds / 1e6);
  std::printf("\n");
}

void run_info(const std::string& dir, int threads, const CacheFlags& cache, bool every_tensor) {
  ModelHandle h;
  open_model(dir, threads, true, &h, "default", cache);
  colibri_model_info_t info;
  colibri_stats_t stats;
  check(colibri_model_info(h.model, &info), "info");
  check(colibri_stats(h.model, &stats), "stats");
  std::printf("model        %s\n", dir.c_str());
  const std::string source = colibri_model_source(h.model);
  if (source.rfind("gguf", 0) == 0) {
    std::printf("source       %s\n", source.c_str());
  } else {
    std::printf("format       colibri-moe v%d\n", info.format_version);
  }
  std::printf("layers       %d\n", info.n_layers);
  std::printf("experts      %d\n", info.n_experts);
  std::printf("d_model      %d\n", info.d_model);
  std::printf("d_ff         %d\n", info.d_ff);
  std::printf("dtype        %s\n", dtype_label(info.dtype, info.down_dtype).c_str());
  // Layers whose types differ from layer 0's (GGUF Q4_K_M), listed by type.
  std::vector<std::pair<std::string, std::string>> other;  // types, layers
  for (int32_t l = 1; l < info.n_layers; ++l) {
    colibri_dtype_t d = info.dtype, down = info.down_dtype;
    check(colibri_layer_dtypes(h.model, l, &d, &down), "layer dtypes");
    if (d == info.dtype && down == info.down_dtype) continue;
    const std::string label = dtype_label(d, down);
    auto it = std::find_if(other.begin(), other.end(), [&](const auto& e) { return e.first == label; });
    if (it == other.end()) {
      other.emplace_back(label, std::to_string(l));
    } else {
      it->second.append(",").append(std::to_string(l));
    }
  }
  for (const auto& [label, layers] : other) std::printf("             %s in layers %s\n", label.c_str(), layers.c_str());
  const double expert_bytes =
      2.0 * info.d_ff * static_cast<double>(colibri_dtype_row_bytes(info.dtype, static_cast<size_t>(info.d_model))) +
      static_cast<double>(info.d_model) *
          static_cast<double>(colibri_dtype_row_bytes(info.down_dtype, static_cast<size_t>(info.d_ff)));
  std::printf("expert bytes %s (%.2f bits per weight)\n", human_bytes(static_cast<uint64_t>(expert_bytes)).c_str(),
              expert_bytes * 8.0 / (3.0 * info.d_model * static_cast<double>(info.d_ff)));
  if (info.router_family != COLIBRI_ROUTER_NONE) {
    std::printf("router       %s, top-%d\n", colibri_router_family_name(info.router_family), info.router_top_k);
  } else {
    std::printf("router       none (routing comes from the caller)\n");
  }
  if (info.shared_d_ff > 0) std::printf("shared       one shared expert, d_ff %d\n", info.shared_d_ff);
  if (info.activation == COLIBRI_ACTIVATION_CLAMPED_SWIGLU) {
    std::printf("activation   clamped_swiglu (gpt-oss): alpha %g, limit %g\n", static_cast<double>(info.swiglu_alpha),
                static_cast<double>(info.swiglu_limit));
  } else {
    std::printf("activation   swiglu\n");
  }
  if (info.expert_bias != 0) std::printf("biases       gate, up and down of every expert\n");
  std::printf("threads      %d\n", info.n_threads);
  std::printf("weights      %s in files, %s packed\n", human_bytes(stats.bytes_files).c_str(),
              human_bytes(stats.bytes_mapped).c_str());
  std::printf("huge pages   %s (%s)\n", human_bytes(stats.bytes_huge_pages).c_str(),
              huge_page_kind_name(stats.huge_page_kind));
  std::printf("locked       %s\n", human_bytes(stats.bytes_locked).c_str());
  std::printf("load time    %.3f s (checksums %.3f s)\n", stats.load_seconds, stats.verify_seconds);
  print_cache_stats(stats);
  if (source.rfind("gguf", 0) == 0) {
    try {
      std::fputs(colibri::gguf_tensor_types(dir, every_tensor).c_str(), stdout);
    } catch (const colibri::Error& e) {
      throw CliError(std::string("info: ") + e.what());
    }
  }
}

// colibri_doctor's JSON as lines: each section's fields, the model's
// kernels one shape a line, then the problems with their fixes.
void run_doctor(const std::string& model, int threads, bool as_json) {
  char* text = nullptr;
  size_t size = 0;
  check(colibri_doctor(model.empty() ? nullptr : model.c_str(), threads, &text, &size), "colibri_doctor");
  const std::string report(text, size);
  colibri_buffer_free(text);
  if (as_json) {
    std::printf("%s\n", report.c_str());
    return;
  }
  const nlohmann::ordered_json r = nlohmann::ordered_json::parse(report);
  const auto value = [](const nlohmann::ordered_json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); };
  for (const auto& [section, fields] : r.items()) {
    if (section == "problems" || !fields.is_object()) continue;
    std::string line;
    for (const auto& [key, v] : fields.items()) {
      if (key == "kernels") continue;
      line += (line.empty() ? "" : ", ") + key + " " + value(v);
    }
    std::printf("%-12s %s\n", section.c_str(), line.c_str());
    if (fields.contains("kernels")) {
      for (const auto& k : fields["kernels"]) {
        std::printf("%-12s %s: %s%s\n", "kernels", value(k["types"]).c_str(), value(k["registry"]).c_str(),
                    k["measured"].is_null() ? "" : ("; measured at an earlier open: " + value(k["measured"])).c_str());
      }
    }
  }
  if (r["problems"].empty()) std::printf("problems     none found\n");
  for (const auto& p : r["problems"]) {
    std::printf("problem      %s\n  fix        %s\n", value(p["problem"]).c_str(), value(p["fix"]).c_str());
  }
}

}  // namespace

void add_model_commands(CLI::App& app) {
  auto gen = std::make_shared<GenArgs>();
  CLI::App* g = app.add_subcommand("gen", "Write a model directory with random weights");
  g->add_option("--out", gen->out, "Output model directory")->required();
  g->add_option("--experts", gen->experts, "Number of experts")->required()->check(CLI::Range(1, 65536));
  g->add_option("--d-model", gen->d_model, "Hidden size")->required()->check(CLI::Range(1, 1 << 20));
  g->add_option("--d-ff", gen->d_ff, "Expert FFN size")->required()->check(CLI::Range(1, 1 << 20));
  g->add_option("--layers", gen->layers, "Number of MoE layers")->check(CLI::Range(1, 4096));
  g->add_option("--dtype", gen->dtype, std::string("Weight type: ") + kDtypeChoices)->check(CLI::IsMember(dtype_choices()));
  g->add_option("--seed", gen->seed, "Random seed");
  g->add_option("--router", gen->router,
                "Add a random built-in router with this family's rule: mixtral, qwen2_moe, qwen3_moe, olmoe, "
                "deepseek_v2, deepseek_v3, gpt_oss");
  g->add_option("--top-k", gen->top_k, "Router: experts per token")->check(CLI::Range(1, 65536));
  g->add_flag("--norm-topk-prob", gen->norm_topk_prob, "Router: renormalise the chosen weights");
  g->add_option("--n-group", gen->n_group, "Router (DeepSeek): expert groups")->check(CLI::Range(1, 65536));
  g->add_option("--topk-group", gen->topk_group, "Router (DeepSeek): groups kept")->check(CLI::Range(1, 65536));
  g->add_option("--routed-scaling-factor", gen->scaling, "Router (DeepSeek): weight scale");
  g->add_option("--shared-d-ff", gen->shared_d_ff, "Add a shared expert with this FFN size")->check(CLI::Range(0, 1 << 20));
  g->add_flag("--shared-gate", gen->shared_gate, "Shared expert scaled by sigmoid(gate . x) (Qwen2-MoE)");
  g->add_option("--activation", gen->activation, "swiglu, or clamped_swiglu (gpt-oss)")
      ->check(CLI::IsMember({"swiglu", "clamped_swiglu"}));
  g->add_option("--swiglu-alpha", gen->swiglu_alpha, "clamped_swiglu: the sigmoid's scale (1.702)");
  g->add_option("--swiglu-limit", gen->swiglu_limit, "clamped_swiglu: the clamp (7)");
  g->add_flag("--expert-bias", gen->expert_bias, "Random biases on every expert's gate, up and down (gpt-oss)");
  g->callback([gen] { run_gen(*gen); });

  auto dir = std::make_shared<std::string>();
  CLI::App* v = app.add_subcommand("verify", "Check sizes and checksums of a model directory");
  v->add_option("--model", *dir, "Model directory")->required();
  v->callback([dir] { run_verify(*dir); });

  auto info_dir = std::make_shared<std::string>();
  auto threads = std::make_shared<int>(0);
  CLI::App* i = app.add_subcommand("info", "Open a model and print what it holds and what the loader got");
  i->add_option("--model", *info_dir, "Model directory or GGUF file")->required();
  i->add_option("--threads", *threads, "Threads (0 = one per core)")->check(CLI::NonNegativeNumber);
  auto cache = std::make_shared<CacheFlags>();
  add_cache_flags(i, cache.get());
  auto tensors = std::make_shared<bool>(false);
  i->add_flag("--tensors", *tensors, "GGUF: every tensor's type, shape and bytes (default: the types per block)");
  i->callback([info_dir, threads, cache, tensors] { run_info(*info_dir, *threads, *cache, *tensors); });

  auto doctor_model = std::make_shared<std::string>();
  auto doctor_threads = std::make_shared<int>(0);
  auto doctor_json = std::make_shared<bool>(false);
  CLI::App* d = app.add_subcommand(
      "doctor", "Check this machine for a model: CPU and kernels, cores and threads, memory, huge pages, mlock, NUMA; "
                "each problem with the command that fixes it");
  d->add_option("--model", *doctor_model, "Model directory or GGUF file (read, not loaded)");
  d->add_option("--threads", *doctor_threads, "Threads the model would run on (0 = one per core)")
      ->check(CLI::NonNegativeNumber);
  d->add_flag("--json", *doctor_json, "Print colibri_doctor's JSON document");
  d->callback([doctor_model, doctor_threads, doctor_json] {
    run_doctor(*doctor_model, *doctor_threads, *doctor_json);
  });
}

}  // namespace colibri_cli
