// colibri convert: Hugging Face MoE checkpoint -> Colibri model directory;
// colibri quantize: a model directory -> the same in another weight type.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>

#include "commands.h"
#include "common.h"
#include "lib/gguf_convert.h"
#include "lib/hf_convert.h"
#include "io/manifest.h"
#include "lib/model_writer.h"
#include "util/error.h"

namespace colibri_cli {

namespace {

struct ConvertArgs {
  std::string hf, gguf, out, dtype, layers;
  bool progress = false;
};

// "a-b" (inclusive) or a single "a".
void parse_layer_range(const std::string& text, colibri::HfConvertOptions* o) {
  const auto number = [&](const std::string& s) {
    if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string::npos) {
      throw CliError("convert: --layers: \"" + text + "\" is not a range a-b of layer indices");
    }
    return static_cast<int32_t>(std::stoi(s));
  };
  const size_t dash = text.find('-');
  o->first_layer = number(text.substr(0, dash));
  o->last_layer = dash == std::string::npos ? *o->first_layer : number(text.substr(dash + 1));
}

std::string layer_list(const std::vector<int32_t>& layers) {
  // Contiguous selections are the common case; print them as a range.
  if (layers.back() - layers.front() + 1 == static_cast<int32_t>(layers.size())) {
    return layers.size() == 1 ? std::to_string(layers.front())
                              : std::to_string(layers.front()) + "-" + std::to_string(layers.back());
  }
  std::string s;
  for (size_t i = 0; i < layers.size(); ++i) {
    if (i == 8 && layers.size() > 9) return s + ",... (" + std::to_string(layers.size()) + " layers)";
    s += (i ? "," : "") + std::to_string(layers[i]);
  }
  return s;
}

// The GGUF's MoE layers, bytes as stored.
void run_convert_gguf(const ConvertArgs& a) {
  if (!a.dtype.empty() || !a.layers.empty()) {
    throw CliError("convert: --gguf keeps every tensor as the file stores it; --dtype and --layers do not apply "
                   "(colibri quantize rewrites the result in another type)");
  }
  const auto t0 = std::chrono::steady_clock::now();
  colibri::GgufConvertResult r;
  ProgressLine bar("converting " + a.gguf);
  std::function<void(float)> progress;
  if (ProgressLine::wanted(a.progress)) progress = [&bar](float f) { bar.update(f); };
  try {
    r = colibri::convert_gguf_model(a.gguf, a.out, progress);
  } catch (const std::exception& e) {
    bar.finish(true);
    throw CliError(std::string("convert: ") + e.what());
  }
  bar.finish(true);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const colibri::Manifest& m = r.model.manifest;
  std::printf("converted %s (gguf %s) to %s: %d MoE layer(s) [GGUF blocks %d-%d] x %d experts, d_model %d, d_ff %d%s, "
              "router %s top-%d, %s, %s in %.1f s\n",
              a.gguf.c_str(), r.model.architecture.c_str(), a.out.c_str(), m.n_layers, r.model.first_block,
              r.model.first_block + m.n_layers - 1, m.n_experts, m.d_model, m.d_ff,
              m.shared_d_ff > 0 ? (", shared expert d_ff " + std::to_string(m.shared_d_ff)).c_str() : "",
              colibri::router_family_name(m.router.family), m.router.top_k, r.model.expert_types.c_str(),
              human_bytes(r.bytes_written).c_str(), seconds);
}

void run_convert(const ConvertArgs& a) {
  if (a.hf.empty() == a.gguf.empty()) throw CliError("convert: give one of --hf DIR or --gguf FILE");
  if (!a.gguf.empty()) {
    run_convert_gguf(a);
    return;
  }
  colibri::HfConvertOptions o;
  o.hf_dir = a.hf;
  o.out_dir = a.out;
  if (!a.dtype.empty()) {
    colibri::WeightType d, down;
    if (!colibri::parse_dtype_mix(a.dtype, &d, &down)) {
      throw CliError("convert: --dtype: unknown dtype \"" + a.dtype + "\" (expected " + kDtypeChoices + ")");
    }
    o.dtype = d;
    o.down_dtype = down;
  }
  if (!a.layers.empty()) parse_layer_range(a.layers, &o);
  ProgressLine bar("converting");
  if (ProgressLine::wanted(a.progress)) {
    o.progress = [&bar](const colibri::HfConvertProgress& p) {
      const double frac =
          p.bytes_total ? static_cast<double>(p.bytes_done) / static_cast<double>(p.bytes_total) : 1.0;
      bar.update(frac, human_bytes(p.bytes_done) + " / " + human_bytes(p.bytes_total) + "  layers " +
                           std::to_string(p.layers_done) + "/" + std::to_string(p.layers_total));
    };
  }

  const auto t0 = std::chrono::steady_clock::now();
  colibri::HfConvertResult r;
  try {
    r = colibri::convert_hf_checkpoint(o);
  } catch (const std::exception& e) {
    bar.finish(true);
    throw CliError(std::string("convert: ") + e.what());
  }
  bar.finish(true);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  const colibri::HfMoeConfig& c = r.config;
  std::string shared;
  if (c.shared_d_ff > 0) {
    shared = ", shared expert d_ff " + std::to_string(c.shared_d_ff) + (c.shared_gate ? " (gated)" : "");
  }
  std::printf("converted %s (%s) to %s: %zu MoE layer(s) [HF %s] x %d experts, d_model %d, d_ff %d%s, "
              "router %s top-%d, %s from %s, %s in %.1f s\n",
              a.hf.c_str(), c.model_type.c_str(), a.out.c_str(), r.layers.size(), layer_list(r.layers).c_str(),
              c.n_experts, c.d_model, c.d_ff, shared.c_str(), colibri::router_family_name(c.router.family),
              c.router.top_k, dtype_label(r.dtype, r.down_dtype).c_str(), colibri::weight_format(r.source_dtype).name,
              human_bytes(r.bytes_written).c_str(), seconds);
}

struct QuantizeArgs {
  std::string model, out, dtype;
  bool progress = false;
};

void run_quantize(const QuantizeArgs& a) {
  colibri::WeightType dtype, down;
  if (!colibri::parse_dtype_mix(a.dtype, &dtype, &down)) {
    throw CliError("quantize: --dtype: unknown dtype \"" + a.dtype + "\" (expected " + kDtypeChoices + ")");
  }
  // Never over the input, nor over another model: the output is written
  // file by file and its manifest last.
  struct stat st {};
  if (::stat((a.out + "/" + colibri::kManifestName).c_str(), &st) == 0) {
    throw CliError("quantize: --out: " + a.out + " already holds a model (" + colibri::kManifestName + ")");
  }
  const auto t0 = std::chrono::steady_clock::now();
  ProgressLine bar("quantizing " + a.model);
  std::function<void(float)> progress;
  if (ProgressLine::wanted(a.progress)) progress = [&bar](float f) { bar.update(f); };
  try {
    colibri::requantize_model_dir(a.model, a.out, dtype, down, progress);
  } catch (const std::exception& e) {
    bar.finish(true);
    throw CliError(std::string("quantize: ") + e.what());
  }
  bar.finish(true);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const colibri::Manifest in = colibri::load_manifest(a.model);
  const colibri::Manifest out = colibri::load_manifest(a.out);
  double before = 0.0, after = 0.0;
  for (int32_t l = 0; l < in.n_layers; ++l) {
    before += static_cast<double>(in.expert_file_bytes(l)) * in.n_experts;
    after += static_cast<double>(out.expert_file_bytes(l)) * out.n_experts;
  }
  std::printf("quantized %s (%s) to %s (%s): experts %s -> %s (%.2f bits per weight) in %.1f s\n", a.model.c_str(),
              (colibri::expert_types(in, 0) + (in.uniform_types() ? "" : " in layer 0, others per layer")).c_str(),
              a.out.c_str(), colibri::expert_types(out, 0).c_str(),
              human_bytes(static_cast<uint64_t>(before)).c_str(), human_bytes(static_cast<uint64_t>(after)).c_str(),
              after * 8.0 / (3.0 * in.d_model * static_cast<double>(in.d_ff) * in.n_experts * in.n_layers), seconds);
}

}  // namespace

void add_convert_commands(CLI::App& app) {
  auto qa = std::make_shared<QuantizeArgs>();
  CLI::App* q = app.add_subcommand("quantize", "Rewrite a model directory's experts in another weight type");
  q->add_option("--model", qa->model, "Input model directory")->required();
  q->add_option("--out", qa->out, "Output model directory (must not hold a model)")->required();
  q->add_option("--dtype", qa->dtype, std::string("Weight type: ") + kDtypeChoices + "; q4_k_m is q4_k with q6_k down")
      ->required()
      ->check(CLI::IsMember(dtype_choices()));
  q->add_flag("--progress", qa->progress, "Progress bar on stderr even when it is not a terminal");
  q->callback([qa] { run_quantize(*qa); });

  auto ca = std::make_shared<ConvertArgs>();
  CLI::App* c = app.add_subcommand(
      "convert",
      "Convert a Hugging Face MoE checkpoint (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, gpt-oss) or a GGUF file's MoE layers");
  CLI::Option* hf = c->add_option("--hf", ca->hf, "Checkpoint directory: config.json and model*.safetensors");
  c->add_option("--gguf", ca->gguf, "GGUF file (or the first of a split set); tensors kept as stored")->excludes(hf);
  c->add_option("--out", ca->out, "Output model directory (must not exist or be empty)")->required();
  c->add_option("--dtype", ca->dtype,
                std::string("Weight type: ") + kDtypeChoices + " (default: the checkpoint's); q4_k_m is q4_k with q6_k down")
      ->check(CLI::IsMember(dtype_choices()));
  c->add_option("--layers", ca->layers, "HF decoder layers a-b (inclusive); the MoE layers among them");
  c->add_flag("--progress", ca->progress, "Progress bar on stderr even when it is not a terminal");
  c->callback([ca] { run_convert(*ca); });
}

}  // namespace colibri_cli
