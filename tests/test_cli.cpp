// End-to-end tests of the colibri CLI: the stable contract outside tools
// drive (gen, route compile, infer on raw float32 files), its error
// behaviour (non-zero exit, one-line message naming the culprit, no partial
// output file) and every subcommand's --help.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "colibri.h"
#include "reference.h"

namespace {

struct RunResult {
  int exit_code = -1;
  std::string out, err;
};

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/colibri-cli-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::system(("rm -rf '" + dir_ + "'").c_str()); }

  RunResult run(const std::string& args) {
    const std::string out = dir_ + "/stdout.txt", err = dir_ + "/stderr.txt";
    const std::string cmd = std::string(COLIBRI_CLI_PATH) + " " + args + " >" + out + " 2>" + err;
    const int status = std::system(cmd.c_str());
    RunResult r;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = slurp(out);
    r.err = slurp(err);
    return r;
  }
  static std::string slurp(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  static void spit(const std::string& path, const std::string& data) {
    std::ofstream f(path, std::ios::binary);
    f << data;
  }
  static bool exists(const std::string& path) {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0;
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  std::string dir_;
};

struct RandomRouting {
  std::string text;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

RandomRouting make_routing(int T, int k, int E, uint32_t seed) {
  std::mt19937 rng(seed);
  RandomRouting r;
  r.ids.resize(static_cast<size_t>(T) * k);
  r.weights.resize(r.ids.size());
  std::vector<int> order(static_cast<size_t>(T));
  for (int t = 0; t < T; ++t) order[static_cast<size_t>(t)] = t;
  std::shuffle(order.begin(), order.end(), rng);  // token ids in any order
  std::uniform_real_distribution<float> wd(-0.5f, 1.5f);
  for (int t = 0; t < T; ++t) {
    std::vector<int> perm(static_cast<size_t>(E));
    for (int e = 0; e < E; ++e) perm[static_cast<size_t>(e)] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int j = 0; j < k; ++j) {
      r.ids[static_cast<size_t>(t) * k + j] = perm[static_cast<size_t>(j)];
      // Weights representable exactly in decimal text so the CLI reads the
      // same float the reference uses.
      r.weights[static_cast<size_t>(t) * k + j] = std::round(wd(rng) * 1024.0f) / 1024.0f;
    }
  }
  r.text = "# test routing\r\n";
  for (int t : order) {
    std::ostringstream line;
    line.precision(9);  // max_digits10 for float: the text round-trips exactly
    line << t;
    for (int j = 0; j < k; ++j) line << " , " << r.ids[static_cast<size_t>(t) * k + j];
    for (int j = 0; j < k; ++j) line << ",  " << r.weights[static_cast<size_t>(t) * k + j];
    r.text += line.str() + "\r\n";
  }
  return r;
}

std::vector<float> random_input(int T, int D, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(T) * D);
  for (float& v : x) v = u(rng);
  return x;
}

std::string as_bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

TEST_F(CliTest, GenCompileInferMatchesReference) {
  struct Case {
    const char* dtype;
    int E, k, D, F, T, layers;
    double tol;
  };
  // Block formats: against the reference on the dequantised weights, with
  // int8 activations (docs/PRECISION.md).
  const Case cases[] = {{"f16", 8, 2, 64, 96, 37, 1, 5e-3},
                        {"bf16", 5, 3, 33, 17, 9, 2, 5e-3},
                        {"f32", 3, 1, 100, 129, 3, 1, 1e-5},
                        {"q8_0", 4, 2, 64, 96, 5, 1, 2e-2},
                        {"q4_k_m", 4, 2, 256, 96, 7, 2, 2e-2}};
  int n = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.dtype);
    const std::string model = path("m" + std::to_string(n++));
    RunResult g = run("gen --out " + model + " --experts " + std::to_string(c.E) + " --d-model " +
                      std::to_string(c.D) + " --d-ff " + std::to_string(c.F) + " --layers " +
                      std::to_string(c.layers) + " --dtype " + c.dtype + " --seed 9");
    ASSERT_EQ(g.exit_code, 0) << g.err;
    const RandomRouting r = make_routing(c.T, c.k, c.E, 17u + static_cast<uint32_t>(n));
    spit(path("r.route"), r.text);
    RunResult rc = run("route compile " + path("r.route") + " -o " + path("r.bin") + " --model " + model);
    ASSERT_EQ(rc.exit_code, 0) << rc.err;
    const std::vector<float> x = random_input(c.T, c.D, 5);
    spit(path("x.bin"), as_bytes(x));
    const int layer = c.layers - 1;
    const std::vector<double> ref =
        colibri_test::reference_layer(model, layer, c.T, x.data(), c.k, r.ids.data(), r.weights.data());
    for (const char* routing : {"r.route", "r.bin"}) {
      std::remove(path("y.bin").c_str());
      RunResult ri = run("infer --model " + model + " --routing " + path(routing) + " --input " +
                         path("x.bin") + " --output " + path("y.bin") + " --layer " + std::to_string(layer));
      ASSERT_EQ(ri.exit_code, 0) << ri.err;
      const std::string y = slurp(path("y.bin"));
      ASSERT_EQ(y.size(), x.size() * sizeof(float));
      const double err = colibri_test::relative_l2(reinterpret_cast<const float*>(y.data()), ref);
      EXPECT_LE(err, c.tol) << routing;
    }
  }
}

TEST_F(CliTest, InferWithoutRoutingUsesTheBuiltInRouter) {
  const std::string model = path("routed");
  RunResult g = run("gen --out " + model + " --experts 8 --d-model 40 --d-ff 24 --layers 2 --dtype f32 --router "
                    "qwen2_moe --top-k 2 --shared-d-ff 48 --shared-gate --seed 3");
  ASSERT_EQ(g.exit_code, 0) << g.err;
  RunResult info = run("info --model " + model);
  ASSERT_EQ(info.exit_code, 0) << info.err;
  EXPECT_NE(info.out.find("qwen2_moe, top-2"), std::string::npos) << info.out;
  EXPECT_NE(info.out.find("d_ff 48"), std::string::npos) << info.out;
  const int T = 11;
  const std::vector<float> x = random_input(T, 40, 8);
  spit(path("x.bin"), as_bytes(x));
  RunResult ri = run("infer --model " + model + " --input " + path("x.bin") + " --output " + path("y.bin") +
                     " --layer 1");
  ASSERT_EQ(ri.exit_code, 0) << ri.err;
  const std::string y = slurp(path("y.bin"));
  ASSERT_EQ(y.size(), x.size() * sizeof(float));
  // Same as the library's own routing (checked against float64 in test_router).
  colibri_model_t* m = nullptr;
  ASSERT_EQ(colibri_open(model.c_str(), nullptr, &m), COLIBRI_OK) << colibri_last_error();
  std::vector<float> want(x.size(), std::nanf(""));
  colibri_infer_t in;
  colibri_infer_default(&in);
  in.layer = 1;
  in.n_tokens = T;
  in.input = x.data();
  in.output = want.data();
  ASSERT_EQ(colibri_infer(m, &in), COLIBRI_OK) << colibri_last_error();
  colibri_free(m);
  EXPECT_EQ(0, std::memcmp(y.data(), want.data(), y.size()));

  // A model without a router needs --routing, and says so.
  const std::string plain = path("plain");
  ASSERT_EQ(run("gen --out " + plain + " --experts 4 --d-model 40 --d-ff 24").exit_code, 0);
  RunResult bad = run("infer --model " + plain + " --input " + path("x.bin") + " --output " + path("z.bin"));
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("no built-in router"), std::string::npos) << bad.err;
  EXPECT_FALSE(exists(path("z.bin")));
  // A ragged input (not whole rows) is refused.
  spit(path("ragged.bin"), as_bytes(x).substr(0, 4 * 40 + 4));
  bad = run("infer --model " + model + " --input " + path("ragged.bin") + " --output " + path("z.bin"));
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("ragged.bin"), std::string::npos) << bad.err;
  bad = run("gen --out " + path("x2") + " --experts 4 --d-model 8 --d-ff 8 --router gpt --top-k 1");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("gpt"), std::string::npos) << bad.err;
}

TEST_F(CliTest, LoadtestChecksEveryOutputUnderConcurrencyAndSwaps) {
  const std::string model = path("load");
  ASSERT_EQ(run("gen --out " + model + " --experts 6 --d-model 48 --d-ff 40 --dtype bf16").exit_code, 0);
  RunResult r = run("loadtest --model " + model + " --callers 1,3 --requests 30 --tokens 3 --top-k 2 "
                    "--routings 4 --swap-every 7 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json out = nlohmann::json::parse(r.out);
  ASSERT_EQ(out["rows"].size(), 2u);
  EXPECT_EQ(out["rows"][1]["callers"], 3);
  EXPECT_EQ(out["rows"][1]["requests"], 90);
  for (const auto& row : out["rows"]) {
    EXPECT_EQ(row["failed"], 0);
    EXPECT_EQ(row["wrong"], 0);
    EXPECT_GT(row["swaps"].get<int>(), 0);
    EXPECT_LE(row["worst_rel_l2"].get<double>(), 5e-3);
  }
  RunResult b = run("bench --model " + model + " --tokens 2 --top-k 2 --iters 10 --warmup 0 --swap-every 2 --json");
  ASSERT_EQ(b.exit_code, 0) << b.err;
  EXPECT_EQ(nlohmann::json::parse(b.out)["swaps"], 5);
  RunResult bad = run("loadtest --model " + model + " --callers 0");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("--callers"), std::string::npos) << bad.err;
}

TEST_F(CliTest, RouteDumpJsonRoundTrip) {
  const RandomRouting r = make_routing(5, 2, 4, 3);
  spit(path("r.route"), r.text);
  ASSERT_EQ(run("route compile " + path("r.route") + " -o " + path("r.bin") + " --experts 4").exit_code, 0);
  RunResult d = run("route dump --json " + path("r.bin"));
  ASSERT_EQ(d.exit_code, 0) << d.err;
  const auto doc = nlohmann::json::parse(d.out);
  EXPECT_EQ(doc["n_tokens"], 5);
  EXPECT_EQ(doc["top_k"], 2);
  for (int t = 0; t < 5; ++t) {
    for (int j = 0; j < 2; ++j) {
      EXPECT_EQ(doc["tokens"][t]["experts"][j], r.ids[static_cast<size_t>(t) * 2 + j]);
      EXPECT_EQ(doc["tokens"][t]["weights"][j].get<float>(), r.weights[static_cast<size_t>(t) * 2 + j]);
    }
  }
  RunResult compact = run("route compile " + path("r.route") + " -o " + path("c.bin") + " --experts 4 --compact");
  // Weights outside [0, 1] cannot be compact-coded only approximately; the
  // compiler accepts and quantises; dump must show q/15 steps.
  ASSERT_EQ(compact.exit_code, 0) << compact.err;
  RunResult dc = run("route dump " + path("c.bin"));
  ASSERT_EQ(dc.exit_code, 0) << dc.err;
  EXPECT_NE(dc.out.find("compact"), std::string::npos);
}

TEST_F(CliTest, ErrorsExitNonZeroNameTheCulpritAndLeaveNoOutput) {
  const std::string model = path("m");
  ASSERT_EQ(run("gen --out " + model + " --experts 4 --d-model 16 --d-ff 8 --dtype f16").exit_code, 0);
  const RandomRouting r = make_routing(4, 2, 4, 1);
  spit(path("r.route"), r.text);
  spit(path("x.bin"), as_bytes(random_input(4, 16, 2)));
  const std::string y = path("y.bin");

  auto expect_failure = [&](const std::string& args, const std::string& needle) {
    SCOPED_TRACE(args);
    std::remove(y.c_str());
    RunResult res = run(args);
    EXPECT_NE(res.exit_code, 0);
    EXPECT_NE(res.err.find(needle), std::string::npos) << "stderr: " << res.err;
    EXPECT_EQ(res.err.find('\n'), res.err.size() - 1) << "one line expected: " << res.err;
    EXPECT_FALSE(exists(y)) << "partial output left behind";
    EXPECT_TRUE(res.out.empty()) << res.out;
  };
  const std::string infer_tail = " --input " + path("x.bin") + " --output " + y;
  expect_failure("infer --model " + path("nope") + " --routing " + path("r.route") + infer_tail, "nope");
  spit(path("x_short.bin"), "abc");
  expect_failure("infer --model " + model + " --routing " + path("r.route") + " --input " + path("x_short.bin") +
                     " --output " + y,
                 "x_short.bin");
  spit(path("bad.route"), "0, 1, 2, 0.5, 0.5\n1, 1, 9, 0.5, 0.5\n");
  expect_failure("infer --model " + model + " --routing " + path("bad.route") + infer_tail, "bad.route:2");
  expect_failure("infer --model " + model + " --routing " + path("r.route") + infer_tail + " --layer 3", "layer");
  // A flipped byte in an expert file is refused at open and named.
  std::string w = slurp(model + "/expert_02.bin");
  w[7] = static_cast<char>(w[7] ^ 0x10);
  spit(model + "/expert_02.bin", w);
  expect_failure("infer --model " + model + " --routing " + path("r.route") + infer_tail, "expert_02.bin");
  RunResult v = run("verify --model " + model);
  EXPECT_NE(v.exit_code, 0);
  EXPECT_NE(v.out.find("FAIL  expert_02.bin"), std::string::npos) << v.out;
  // route compile: the output file is not created on failure either.
  std::remove(path("out.bin").c_str());
  RunResult rc = run("route compile " + path("bad.route") + " -o " + path("out.bin") + " --experts 4");
  EXPECT_NE(rc.exit_code, 0);
  EXPECT_NE(rc.err.find("bad.route:2"), std::string::npos) << rc.err;
  EXPECT_FALSE(exists(path("out.bin")));
}

TEST_F(CliTest, EverySubcommandHasHelp) {
  for (const char* sub : {"gen", "route compile", "route dump", "infer", "bench", "demo", "verify", "info", "doctor"}) {
    RunResult r = run(std::string(sub) + " --help");
    EXPECT_EQ(r.exit_code, 0) << sub;
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << sub << ": " << r.out;
  }
  RunResult bad = run("frobnicate");
  EXPECT_NE(bad.exit_code, 0);
}

TEST_F(CliTest, QuantizeInfoVerifyAndExact) {
  const std::string f16 = path("f16"), q = path("q"), again = path("again");
  ASSERT_EQ(run("gen --out " + f16 + " --experts 4 --d-model 256 --d-ff 64 --dtype f16 --seed 3").exit_code, 0);
  RunResult r = run("quantize --model " + f16 + " --out " + q + " --dtype q4_k_m");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("q4_k (down q6_k)"), std::string::npos) << r.out;
  EXPECT_TRUE(r.err.empty()) << "no progress bar when stderr is not a terminal: " << r.err;
  RunResult shown = run("quantize --progress --model " + f16 + " --out " + path("q8") + " --dtype q8_0");
  ASSERT_EQ(shown.exit_code, 0) << shown.err;
  EXPECT_NE(shown.err.find("quantizing " + f16 + " [##############################] 100%"), std::string::npos)
      << shown.err;
  RunResult i = run("info --model " + q);
  ASSERT_EQ(i.exit_code, 0) << i.err;
  EXPECT_NE(i.out.find("dtype        q4_k (down q6_k)"), std::string::npos) << i.out;
  EXPECT_NE(i.out.find("colibri-moe v3"), std::string::npos) << i.out;
  EXPECT_NE(i.out.find("bits per weight"), std::string::npos) << i.out;
  EXPECT_EQ(run("verify --model " + q).exit_code, 0);
  // Never over an existing model.
  RunResult over = run("quantize --model " + f16 + " --out " + q + " --dtype q8_0");
  EXPECT_NE(over.exit_code, 0);
  EXPECT_NE(over.err.find("already holds a model"), std::string::npos) << over.err;
  RunResult bad = run("quantize --model " + f16 + " --out " + again + " --dtype q7_k");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_FALSE(exists(again + "/colibri.json"));

  // infer --precision exact: fp32 activations against the dequantised weights.
  const RandomRouting rt = make_routing(3, 2, 4, 5);
  spit(path("r.route"), rt.text);
  const std::vector<float> x = random_input(3, 256, 6);
  spit(path("x.bin"), as_bytes(x));
  const std::vector<double> ref = colibri_test::reference_layer(q, 0, 3, x.data(), 2, rt.ids.data(), rt.weights.data());
  for (const char* precision : {"default", "exact"}) {
    std::remove(path("y.bin").c_str());
    RunResult ri = run("infer --model " + q + " --routing " + path("r.route") + " --input " + path("x.bin") +
                       " --output " + path("y.bin") + " --precision " + precision);
    ASSERT_EQ(ri.exit_code, 0) << ri.err;
    const std::string y = slurp(path("y.bin"));
    ASSERT_EQ(y.size(), x.size() * sizeof(float));
    EXPECT_LE(colibri_test::relative_l2(reinterpret_cast<const float*>(y.data()), ref),
              std::string(precision) == "exact" ? 1e-5 : 2e-2)
        << precision;
  }
}

TEST_F(CliTest, BenchAndInfoSmoke) {
  const std::string model = path("m");
  ASSERT_EQ(run("gen --out " + model + " --experts 8 --d-model 32 --d-ff 48 --dtype bf16").exit_code, 0);
  RunResult b = run("bench --model " + model + " --tokens 3 --top-k 2 --iters 5 --warmup 1 --json");
  ASSERT_EQ(b.exit_code, 0) << b.err;
  const auto doc = nlohmann::json::parse(b.out);
  EXPECT_GT(doc["p50_ms"].get<double>(), 0.0);
  EXPECT_GE(doc["p99_ms"].get<double>(), doc["p50_ms"].get<double>());
  EXPECT_FALSE(doc.contains("compare"));
  // --compare-threads: both thread counts timed every iteration.
  RunResult c = run("bench --model " + model + " --tokens 3 --top-k 2 --iters 5 --warmup 1 --threads 2 "
                    "--compare-threads 1 --json");
  ASSERT_EQ(c.exit_code, 0) << c.err;
  const auto cdoc = nlohmann::json::parse(c.out);
  ASSERT_TRUE(cdoc.contains("compare")) << c.out;
  EXPECT_EQ(cdoc["compare"]["threads"].get<int>(), 1);
  EXPECT_GT(cdoc["compare"]["p50_ms"].get<double>(), 0.0);
  EXPECT_GT(cdoc["compare"]["pair_speedup_median"].get<double>(), 0.0);
  EXPECT_NE(run("bench --model " + model + " --tokens 3 --top-k 2 --compare-threads 0").exit_code, 0);
  RunResult i = run("info --model " + model);
  ASSERT_EQ(i.exit_code, 0) << i.err;
  EXPECT_NE(i.out.find("experts      8"), std::string::npos) << i.out;
}

// colibri doctor: the machine's facts and each problem with its fix, for a
// model read but not loaded (its experts' bytes from the manifest's shapes,
// each expert shape's kernels); a bad model path fails naming it.
TEST_F(CliTest, DoctorReportsTheMachineAndTheModel) {
  const std::string model = path("m");
  ASSERT_EQ(run("gen --out " + model + " --experts 8 --d-model 256 --d-ff 64 --dtype q4_0").exit_code, 0);
  RunResult j = run("doctor --model " + model + " --threads 64 --json");
  ASSERT_EQ(j.exit_code, 0) << j.err;
  const auto doc = nlohmann::json::parse(j.out);
  EXPECT_EQ(doc["cpu"]["level"].get<std::string>(), colibri_cpu_isa());
  EXPECT_GE(doc["cores"]["physical"].get<int>(), 1);
  EXPECT_LE(doc["cores"]["physical"].get<int>(), doc["cores"]["allowed"].get<int>());
  EXPECT_EQ(doc["cores"]["recommended_threads"].get<int>(), doc["cores"]["physical"].get<int>());
  EXPECT_GT(doc["memory"]["total_bytes"].get<int64_t>(), 0);
  EXPECT_EQ(doc["model"]["experts"].get<int>(), 8);
  // 8 experts of 3 q4_0 matrices 64 x 256 (18 bytes per 32 weights).
  EXPECT_EQ(doc["model"]["experts_bytes"].get<uint64_t>(), 8u * 3u * 64u * 256u / 32u * 18u);
  ASSERT_EQ(doc["model"]["kernels"].size(), 1u);
  EXPECT_EQ(doc["model"]["kernels"][0]["types"].get<std::string>(), "q4_0/q4_0");
  EXPECT_EQ(doc["model"]["kernels"][0]["registry"].get<std::string>().rfind("decode int8-", 0), 0u);
  // 64 threads on this machine's cores: a problem, with the thread count that fixes it.
  bool threads_problem = false;
  for (const auto& p : doc["problems"]) {
    threads_problem |= p["problem"].get<std::string>().find("64 threads on") == 0 &&
                       p["fix"].get<std::string>().find("--threads " + std::to_string(
                           doc["cores"]["physical"].get<int>())) != std::string::npos;
  }
  EXPECT_TRUE(threads_problem) << j.out;
  RunResult text = run("doctor --model " + model);
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("kernels      q4_0/q4_0: decode int8-"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("cpu          name "), std::string::npos) << text.out;
  RunResult bare = run("doctor");
  EXPECT_EQ(bare.exit_code, 0) << bare.err;
  RunResult bad = run("doctor --model " + path("missing"));
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find(path("missing")), std::string::npos) << bad.err;
}

}  // namespace
