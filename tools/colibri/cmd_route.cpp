// colibri route compile | route dump
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "commands.h"
#include "common.h"
#include "io/manifest.h"
#include "util/error.h"

namespace colibri_cli {

namespace {

struct CompileArgs {
  std::string in, out, model;
  int experts = 0;
  bool compact = false, q4 = false, f16 = false;
};

int experts_from_model(const std::string& dir) {
  try {
    return colibri::load_manifest(dir).n_experts;
  } catch (const colibri::Error& e) {
    throw CliError(std::string("route compile: ") + e.what());
  }
}

void run_compile(const CompileArgs& a) {
  colibri_route_compile_options_t o;
  colibri_route_compile_options_default(&o);
  o.n_experts = a.model.empty() ? a.experts : experts_from_model(a.model);
  o.compact = a.compact ? 1 : 0;
  o.q4_weights = a.q4 ? 1 : 0;
  o.weight_encoding = a.f16 ? COLIBRI_ROUTE_WEIGHTS_F16 : COLIBRI_ROUTE_WEIGHTS_F32;
  check(colibri_route_compile_file(a.in.c_str(), a.out.c_str(), &o), "route compile");
  RoutingHandle r;
  check(colibri_routing_load(a.out.c_str(), o.n_experts, 0, &r.routing), "route compile");
  std::printf("wrote %s: %d tokens, top-%d of %d experts, %s\n", a.out.c_str(),
              colibri_routing_n_tokens(r.routing), colibri_routing_top_k(r.routing),
              colibri_routing_n_experts(r.routing),
              a.compact ? "compact (1 byte/token)" : (a.f16 ? "f16 weights" : "f32 weights"));
}

struct DumpArgs {
  std::string file;
  int experts = 0;
  bool json = false, q4 = false;
};

void run_dump(const DumpArgs& a) {
  RoutingHandle r;
  check(colibri_routing_load(a.file.c_str(), a.experts, a.q4 ? 1 : 0, &r.routing), "route dump");
  const int T = colibri_routing_n_tokens(r.routing);
  const int k = colibri_routing_top_k(r.routing);
  const int32_t* ids = colibri_routing_expert_ids(r.routing);
  const float* w = colibri_routing_expert_weights(r.routing);
  const char* encoding = colibri_routing_is_compact(r.routing) ? "compact"
                         : colibri_routing_weight_encoding(r.routing) == COLIBRI_ROUTE_WEIGHTS_F16 ? "f16"
                                                                                                   : "f32";
  if (a.json) {
    nlohmann::json doc;
    doc["file"] = a.file;
    doc["n_tokens"] = T;
    doc["n_experts"] = colibri_routing_n_experts(r.routing);
    doc["top_k"] = k;
    doc["encoding"] = encoding;
    nlohmann::json tokens = nlohmann::json::array();
    for (int t = 0; t < T; ++t) {
      nlohmann::json e = nlohmann::json::array(), wt = nlohmann::json::array();
      for (int j = 0; j < k; ++j) {
        e.push_back(ids[t * k + j]);
        wt.push_back(w[t * k + j]);
      }
      tokens.push_back({{"token", t}, {"experts", e}, {"weights", wt}});
    }
    doc["tokens"] = tokens;
    std::printf("%s\n", doc.dump(1).c_str());
    return;
  }
  std::printf("# %s: %d tokens, top-%d of %d experts, encoding %s\n", a.file.c_str(), T, k,
              colibri_routing_n_experts(r.routing), encoding);
  std::printf("# token_id, experts..., weights...\n");
  for (int t = 0; t < T; ++t) {
    std::printf("%d", t);
    for (int j = 0; j < k; ++j) std::printf(", %d", ids[t * k + j]);
    for (int j = 0; j < k; ++j) std::printf(", %.9g", static_cast<double>(w[t * k + j]));
    std::printf("\n");
  }
}

}  // namespace

void add_route_commands(CLI::App& app) {
  CLI::App* route = app.add_subcommand("route", "Compile and inspect routing files");
  route->require_subcommand(1);

  auto c = std::make_shared<CompileArgs>();
  CLI::App* compile = route->add_subcommand("compile", "Compile a .route text file to routing.bin");
  compile->add_option("input", c->in, "Input .route file")->required();
  compile->add_option("-o,--output", c->out, "Output routing.bin")->required();
  auto* experts = compile->add_option("--experts", c->experts, "Number of experts in the model")
                      ->check(CLI::Range(1, 65536));
  auto* model = compile->add_option("--model", c->model, "Model directory (takes the expert count from it)");
  experts->excludes(model);
  compile->add_flag("--compact", c->compact, "Seed's 1 byte/token encoding (needs <= 4 experts, top-2)");
  compile->add_flag("--q4-weights", c->q4, "Weights in the text are 4-bit codes q meaning q/15");
  compile->add_flag("--f16-weights", c->f16, "Store weights as f16 instead of f32");
  compile->callback([c] {
    if (c->model.empty() && c->experts == 0) throw CliError("route compile: give --experts E or --model DIR");
    run_compile(*c);
  });

  auto d = std::make_shared<DumpArgs>();
  CLI::App* dump = route->add_subcommand("dump", "Print a routing.bin (or .route) file");
  dump->add_option("file", d->file, "routing.bin or .route file")->required();
  dump->add_option("--experts", d->experts, "Expert count (needed for .route text)")->check(CLI::Range(1, 65536));
  dump->add_flag("--q4-weights", d->q4, "For .route text: weights are 4-bit codes");
  dump->add_flag("--json", d->json, "JSON output");
  dump->callback([d] { run_dump(*d); });
}

}  // namespace colibri_cli
