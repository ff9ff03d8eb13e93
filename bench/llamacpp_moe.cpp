// llamacpp_moe: one MoE FFN layer on ggml's CPU backend, built the way
// llama.cpp builds it, timed.
//
// The llama.cpp peer of `colibri bench`. Built by bench/llamacpp_peer.sh
// against the ggml that PyPI's llama-cpp-python sdist vendors; run for the
// suite's shapes by bench/llamacpp_peer.py. Nothing here is copied from
// llama.cpp: it reproduces, with ggml's public API,
//
//  * the graph of llama.cpp's llm_graph_context::build_moe_ffn (src/llama-graph.cpp)
//    for a model with separate gate/up expert tensors (Mixtral, Qwen3-MoE,
//    OLMoE as converted to GGUF), SiLU gating and a given routing:
//      up      = mul_mat_id(up_exps   [d_model, d_ff, E], x [d_model, 1, T], ids [k, T])  -> [d_ff, k, T]
//      gate    = mul_mat_id(gate_exps [d_model, d_ff, E], x, ids)
//      h       = swiglu_split(gate, up)                       (silu(gate) * up)
//      experts = mul_mat_id(down_exps [d_ff, d_model, E], h, ids)                       -> [d_model, k, T]
//      experts = mul(experts, weights [1, k, T])
//      out     = view(experts, 0) + view(experts, 1) + ... + view(experts, k-1)        -> [d_model, T]
//    (the router -- logits, softmax, argsort top-k, get_rows -- is left out,
//    as `colibri bench --routing` takes the routing as given);
//  * the model loader's choice of buffer type for the expert weights
//    (src/llama-model-loader.cpp, select_weight_buft with the default
//    settings, i.e. extra buffer types on): the CPU device's extra buffer
//    types in order (AMX, CPU_REPACK, ...) and then the plain CPU buffer type,
//    the first whose device supports a MUL_MAT_ID on a tensor in it. On x86
//    with AVX2/AVX-512 that is CPU_REPACK for q4_0 and q4_K (repacked to the
//    interleaved 8x8 layouts at upload) and the plain CPU buffer for q8_0,
//    f16 and bf16 (AMX's buffer only takes MUL_MAT).
//
// Weights are random floats (uniform, std 1/sqrt(fan-in)) quantised with
// ggml_quantize_chunk; the routing is uniformly random distinct experts per
// token with softmax-normalised weights of normal logits; the input is
// uniform with std 1. --check compares the output with a float64 reference
// computed here from ggml's own dequantisation (type traits' to_float) of
// the same weights.
//
// Output: one JSON line per case,
//   {"shape":..., "type":..., "T":..., "p50_ms":..., "min_ms":..., "iters":..., ...}
// With --serve the weights are made once (q4_K quantisation of a Mixtral
// layer takes about a minute) and cases are read from stdin, one per line
// ("--tokens 128 --iters 5"); bench/llamacpp_peer.py drives it that way to
// interleave the cases with Colibri's.

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#ifndef LLAMACPP_PEER_PACKAGE
#define LLAMACPP_PEER_PACKAGE "unknown"
#endif
#ifndef LLAMACPP_PEER_GGML_VERSION
#define LLAMACPP_PEER_GGML_VERSION "unknown"
#endif

namespace {

// Options. Layer options (type, shape, seed, --check) fix the weights; case
// options (tokens, routing, iterations, threads) may change per case in
// --serve mode.
struct Args {
    std::string type = "q8_0";
    std::string shape = "custom";
    int64_t experts = 8, top_k = 2, d_model = 256, d_ff = 512;
    uint64_t seed = 1;
    bool check = false, serve = false;
    bool gpt_oss = false;  // llama.cpp's gpt-oss FFN: expert biases (ggml_add_id) and ggml_swiglu_oai
    // per case
    int64_t tokens = 1;
    bool tokens_given = false;
    std::string routing = "fixed";  // fixed | cycled
    std::string route_file;         // .route text for the fixed routing
    int iters = 20, warmup = 3, threads = 2, cycle = 8;
    double max_seconds = 0;         // stop timing after this long (at least 3 iterations); 0: no limit
    double min_seconds = 0;         // time more than --iters calls until this long (within max_seconds)
};

[[noreturn]] void die(const char * fmt, const char * a = "") {
    std::fprintf(stderr, "llamacpp_moe: ");
    std::fprintf(stderr, fmt, a);
    std::fprintf(stderr, "\n");
    std::exit(2);
}

void usage() {
    std::fprintf(stderr,
        "usage: llamacpp_moe [--type f16|bf16|f32|q8_0|q4_0|q4_1|q5_0|q5_1|q2_K|q3_K|q4_K|iq4_nl|iq4_xs|iq1_s|iq1_m|iq2_xxs|iq2_xs|iq2_s|iq3_xxs|iq3_s|tq1_0|tq2_0|mxfp4] [--experts E] [--top-k K]\n"
        "                    [--d-model D] [--d-ff F] [--seed S] [--shape NAME] [--check] [--serve] [--gpt-oss]\n"
        "  --gpt-oss         the experts as llama.cpp's gpt-oss graph computes them: biases on gate,\n"
        "                    up and down (ggml_add_id) and ggml_swiglu_oai(alpha 1.702, limit 7)\n"
        "                    [--tokens T] [--routing fixed|cycled] [--cycle N] [--route FILE]\n"
        "                    [--iters N] [--warmup N] [--min-seconds S] [--max-seconds S] [--threads N]\n"
        "  --routing cycled  a different random routing every call (--cycle of them in turn),\n"
        "                    set between calls, outside the timed region\n"
        "  --route FILE      the fixed routing from a .route text file (\"t, e_1..e_k, w_1..w_k\"\n"
        "                    per line, as bench/run_suite.py writes them); sets --tokens\n"
        "  --max-seconds S   stop after S seconds of timed calls (at least 3 calls)\n"
        "  --min-seconds S   time more than --iters calls until S seconds have passed\n"
        "  --check           also compare each output with a float64 reference (small shapes)\n"
        "  --serve           make the weights once, then run one case per line of stdin: each\n"
        "                    line holds case options (--tokens --routing --cycle --route --iters\n"
        "                    --warmup --min-seconds --max-seconds --threads), answered with one JSON line\n");
}

std::vector<std::string> split_words(const std::string & line) {
    std::vector<std::string> w;
    std::string cur;
    for (char c : line) {
        if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
            if (!cur.empty()) w.push_back(cur), cur.clear();
        } else {
            cur += c;
        }
    }
    if (!cur.empty()) w.push_back(cur);
    return w;
}

// Parses words into a (case_only: only the per-case options are accepted).
void parse_into(Args & a, const std::vector<std::string> & words, bool case_only) {
    for (size_t i = 0; i < words.size(); ++i) {
        const std::string & k = words[i];
        if (!case_only && (k == "-h" || k == "--help")) { usage(); std::exit(0); }
        if (!case_only && k == "--check") { a.check = true; continue; }
        if (!case_only && k == "--serve") { a.serve = true; continue; }
        if (!case_only && k == "--gpt-oss") { a.gpt_oss = true; continue; }
        if (i + 1 >= words.size()) { usage(); die("missing value for %s", k.c_str()); }
        const std::string & v = words[++i];
        auto num = [&]() {
            char * end = nullptr;
            long long x = std::strtoll(v.c_str(), &end, 10);
            if (v.empty() || !end || *end || x < 0) die("bad number for %s", k.c_str());
            return (int64_t) x;
        };
        if (k == "--tokens") { a.tokens = num(); a.tokens_given = true; }
        else if (k == "--routing") a.routing = v;
        else if (k == "--route") a.route_file = v;
        else if (k == "--iters") a.iters = (int) num();
        else if (k == "--warmup") a.warmup = (int) num();
        else if (k == "--threads") a.threads = (int) num();
        else if (k == "--cycle") a.cycle = (int) num();
        else if (k == "--max-seconds" || k == "--min-seconds") {
            char * end = nullptr;
            const double x = std::strtod(v.c_str(), &end);
            if (v.empty() || !end || *end || !(x >= 0)) die("bad number for %s", k.c_str());
            (k == "--max-seconds" ? a.max_seconds : a.min_seconds) = x;
        }
        else if (case_only) die("not a case option: %s", k.c_str());
        else if (k == "--type") a.type = v;
        else if (k == "--shape") a.shape = v;
        else if (k == "--experts") a.experts = num();
        else if (k == "--top-k") a.top_k = num();
        else if (k == "--d-model") a.d_model = num();
        else if (k == "--d-ff") a.d_ff = num();
        else if (k == "--seed") a.seed = (uint64_t) num();
        else { usage(); die("unknown option %s", k.c_str()); }
    }
    if (a.experts < 1 || a.top_k < 1 || a.top_k > a.experts || a.d_model < 1 || a.d_ff < 1 || a.tokens < 1 ||
        a.iters < 1 || a.threads < 1 || a.cycle < 1)
        die("need experts >= top-k >= 1 and positive sizes, tokens, iters, threads, cycle%s", "");
    if (a.routing != "fixed" && a.routing != "cycled") die("--routing is fixed or cycled, not %s", a.routing.c_str());
    if (!a.route_file.empty() && a.routing == "cycled") die("--route gives a fixed routing, not with --routing cycled%s", "");
}

ggml_type parse_type(const std::string & s) {
    std::string l = s;
    for (auto & c : l) c = (char) std::tolower((unsigned char) c);
    if (l == "f16") return GGML_TYPE_F16;
    if (l == "bf16") return GGML_TYPE_BF16;
    if (l == "f32") return GGML_TYPE_F32;
    if (l == "q8_0") return GGML_TYPE_Q8_0;
    if (l == "q4_0") return GGML_TYPE_Q4_0;
    if (l == "q4_k") return GGML_TYPE_Q4_K;
    if (l == "mxfp4") return GGML_TYPE_MXFP4;
    if (l == "q4_1") return GGML_TYPE_Q4_1;
    if (l == "q5_0") return GGML_TYPE_Q5_0;
    if (l == "q5_1") return GGML_TYPE_Q5_1;
    if (l == "iq4_nl") return GGML_TYPE_IQ4_NL;
    if (l == "iq4_xs") return GGML_TYPE_IQ4_XS;
    if (l == "q2_k") return GGML_TYPE_Q2_K;
    if (l == "q3_k") return GGML_TYPE_Q3_K;
    if (l == "iq2_xxs") return GGML_TYPE_IQ2_XXS;
    if (l == "iq3_xxs") return GGML_TYPE_IQ3_XXS;
    if (l == "iq1_s") return GGML_TYPE_IQ1_S;
    if (l == "iq1_m") return GGML_TYPE_IQ1_M;
    if (l == "iq2_xs") return GGML_TYPE_IQ2_XS;
    if (l == "iq2_s") return GGML_TYPE_IQ2_S;
    if (l == "iq3_s") return GGML_TYPE_IQ3_S;
    if (l == "tq1_0") return GGML_TYPE_TQ1_0;
    if (l == "tq2_0") return GGML_TYPE_TQ2_0;
    die("unsupported --type %s (f16, bf16, f32, q8_0, q4_0, q4_1, q5_0, q5_1, q2_K, q3_K, q4_K, iq4_nl, iq4_xs, "
        "iq1_s, iq1_m, iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s, tq1_0, tq2_0, mxfp4)",
        s.c_str());
}

std::string json_str(const std::string & s) {
    std::string r = "\"";
    for (char c : s) {
        if (c == '"' || c == '\\') r += '\\', r += c;
        else if ((unsigned char) c < 0x20) { char b[8]; std::snprintf(b, sizeof b, "\\u%04x", c); r += b; }
        else r += c;
    }
    return r + "\"";
}

// splitmix64: a counter-based generator, so every row's values depend only on
// (seed, tensor, expert, row), not on how rows are split among threads.
uint64_t mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

struct Rng {
    uint64_t s;
    explicit Rng(uint64_t seed) : s(mix(seed)) {}
    uint64_t next() { return mix(s++); }
    double uniform() { return (double) (next() >> 11) * (1.0 / 9007199254740992.0); }  // [0, 1)
    double normal() {
        double u1 = uniform(), u2 = uniform();
        return std::sqrt(-2.0 * std::log(1.0 - u1)) * std::cos(6.283185307179586 * u2);
    }
};

// Captures the repack layout the CPU backend reports at upload
// ("repack tensor up_exps with q4_K_8x8") and forwards warnings and errors.
std::string g_repack_layout;
void log_cb(ggml_log_level level, const char * text, void *) {
    const char * p = std::strstr(text, "repack tensor ");
    if (p) {
        const char * w = std::strstr(p, " with ");
        if (w && g_repack_layout.empty()) {
            std::string s = w + 6;
            while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
            g_repack_layout = s;
        }
        return;
    }
    if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

// One expert tensor [n_in, n_out, E]: its quantised bytes (row-major, as
// ggml lays them out before any repack).
std::vector<uint8_t> make_weights(ggml_type type, int64_t n_in, int64_t n_out, int64_t E, uint64_t seed,
                                  int tensor_id, int threads) {
    const size_t row_size = ggml_row_size(type, n_in);
    const int64_t rows = n_out * E;
    std::vector<uint8_t> q(row_size * rows);
    const float scale = (float) (std::sqrt(3.0) / std::sqrt((double) n_in));  // uniform, std 1/sqrt(n_in)
    // The grid i-quants: random codes with a sane f16 scale per block, as
    // `colibri gen` writes them (ggml's quantisers for these take minutes
    // per layer and need an importance matrix; the kernels' speed does not
    // depend on the codes).
    if (type == GGML_TYPE_IQ1_S || type == GGML_TYPE_IQ1_M || type == GGML_TYPE_IQ2_XXS || type == GGML_TYPE_IQ2_XS ||
        type == GGML_TYPE_IQ2_S || type == GGML_TYPE_IQ3_XXS || type == GGML_TYPE_IQ3_S) {
        const size_t block_bytes = ggml_type_size(type);
        Rng g(seed * 0x100000001b3ull ^ ((uint64_t) tensor_id << 56));
        for (auto & b : q) b = (uint8_t) g.next();
        const ggml_fp16_t d = ggml_fp32_to_fp16(scale / 8.0f);
        for (size_t o = 0; o < q.size(); o += block_bytes) {
            uint8_t * blk = q.data() + o;
            if (type == GGML_TYPE_IQ1_M) {
                uint8_t * sc = blk + block_bytes - 8;  // d's nibbles atop the four scale words
                for (int k = 0; k < 4; ++k) sc[2 * k + 1] = (uint8_t) ((sc[2 * k + 1] & 0x0f) | (((d >> (4 * k)) & 0xf) << 4));
            } else {
                std::memcpy(blk, &d, sizeof d);
            }
        }
        return q;
    }
    ggml_quantize_init(type);
    const float * im = nullptr;
    const int64_t chunk = 64;
    auto work = [&](int tid) {
        std::vector<float> buf(chunk * n_in);
        for (int64_t r0 = (int64_t) tid * chunk; r0 < rows; r0 += (int64_t) threads * chunk) {
            const int64_t nr = std::min(chunk, rows - r0);
            for (int64_t r = 0; r < nr; ++r) {
                Rng g(seed * 0x100000001b3ull ^ ((uint64_t) tensor_id << 56) ^ (uint64_t) (r0 + r));
                float * row = buf.data() + r * n_in;
                for (int64_t i = 0; i < n_in; ++i) row[i] = (float) ((2.0 * g.uniform() - 1.0) * scale);
            }
            ggml_quantize_chunk(type, buf.data(), q.data() + row_size * r0, 0, nr, n_in, im);
        }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(work, t);
    work(0);
    for (auto & t : pool) t.join();
    return q;
}

struct Routing {
    std::vector<int32_t> ids;  // [T][k]
    std::vector<float> w;      // [T][k]
};

Routing make_routing(int64_t T, int64_t k, int64_t E, uint64_t seed) {
    Rng g(seed);
    Routing r;
    r.ids.resize(T * k);
    r.w.resize(T * k);
    std::vector<int32_t> perm(E);
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t e = 0; e < E; ++e) perm[e] = (int32_t) e;
        for (int64_t j = 0; j < k; ++j) {  // partial Fisher-Yates: k distinct experts
            int64_t p = j + (int64_t) (g.next() % (uint64_t) (E - j));
            std::swap(perm[j], perm[p]);
            r.ids[t * k + j] = perm[j];
        }
        std::vector<double> l(k);
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j < k; ++j) mx = std::max(mx, l[j] = g.normal());
        for (int64_t j = 0; j < k; ++j) sum += (l[j] = std::exp(l[j] - mx));
        for (int64_t j = 0; j < k; ++j) r.w[t * k + j] = (float) (l[j] / sum);
    }
    return r;
}

// The loader's rule: the first buffer type (CPU extra buffer types, then the
// CPU's own) whose device supports MUL_MAT_ID with the weight in it, tested
// on the op llama.cpp tests with (512 tokens, n_expert_used ids).
ggml_backend_buffer_type_t select_weight_buft(ggml_backend_dev_t dev, ggml_tensor * w, int64_t top_k,
                                              std::vector<std::string> & tried) {
    std::vector<ggml_backend_buffer_type_t> list;
    auto * reg = ggml_backend_dev_backend_reg(dev);
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
        reg, "ggml_backend_dev_get_extra_bufts");
    if (get_extra) {
        for (ggml_backend_buffer_type_t * p = get_extra(dev); p && *p; ++p) list.push_back(*p);
    }
    list.push_back(ggml_backend_dev_buffer_type(dev));

    ggml_init_params ip = {ggml_tensor_overhead() * 8, nullptr, true};
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * b = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, w->ne[0], top_k, 512);
    ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, top_k, 512);
    ggml_tensor * op = ggml_mul_mat_id(ctx, w, b, ids);
    ggml_backend_buffer_type_t chosen = nullptr;
    for (auto * buft : list) {
        w->buffer = ggml_backend_buft_alloc_buffer(buft, 0);
        bool ok = ggml_backend_dev_supports_op(dev, op);
        ggml_backend_buffer_free(w->buffer);
        w->buffer = nullptr;
        tried.push_back(std::string(ggml_backend_buft_name(buft)) + (ok ? "+" : "-"));
        if (ok && !chosen) chosen = buft;
    }
    ggml_free(ctx);
    return chosen;
}

// float64 reference of the layer from ggml's dequantisation of the same bytes.
std::vector<double> reference(const Args & a, ggml_type type, const std::vector<uint8_t> & qg,
                              const std::vector<uint8_t> & qu, const std::vector<uint8_t> & qd,
                              const std::vector<float> & x, const Routing & r) {
    const auto * tr = ggml_get_type_traits(type);
    const int64_t D = a.d_model, F = a.d_ff, k = a.top_k, T = a.tokens;
    const size_t rs_in = ggml_row_size(type, D), rs_ff = ggml_row_size(type, F);
    std::vector<float> row(std::max(D, F));
    std::vector<double> out(T * D, 0.0), h(F);
    auto dot = [&](const std::vector<uint8_t> & q, size_t rs, int64_t rix, int64_t n, const double * v,
                   const float * vf) {
        tr->to_float(q.data() + rs * rix, row.data(), n);
        double s = 0;
        for (int64_t i = 0; i < n; ++i) s += (double) row[i] * (v ? v[i] : (double) vf[i]);
        return s;
    };
    for (int64_t t = 0; t < T; ++t) {
        const float * xt = x.data() + t * D;
        for (int64_t j = 0; j < k; ++j) {
            const int64_t e = r.ids[t * k + j];
            for (int64_t f = 0; f < F; ++f) {
                double g = dot(qg, rs_in, e * F + f, D, nullptr, xt);
                double u = dot(qu, rs_in, e * F + f, D, nullptr, xt);
                h[f] = g / (1.0 + std::exp(-g)) * u;
            }
            for (int64_t d = 0; d < D; ++d)
                out[t * D + d] += (double) r.w[t * k + j] * dot(qd, rs_ff, e * D + d, F, h.data(), nullptr);
        }
    }
    return out;
}

// A .route text file: "token, e_1, ..., e_k, w_1, ..., w_k" per line, '#' comments.
Routing read_route(const std::string & path, int64_t k, int64_t E, int64_t & T) {
    FILE * f = std::fopen(path.c_str(), "r");
    if (!f) die("cannot open %s", path.c_str());
    std::vector<std::pair<long long, std::vector<double>>> rows;
    char line[1 << 16];
    while (std::fgets(line, sizeof line, f)) {
        char * p = line;
        while (*p == ' ' || *p == '\t') ++p;
        if (*p == '#' || *p == '\n' || *p == '\r' || *p == 0) continue;
        std::vector<double> cols;
        while (*p) {
            char * end = nullptr;
            double v = std::strtod(p, &end);
            if (end == p) break;
            cols.push_back(v);
            p = end;
            while (*p == ' ' || *p == ',' || *p == '\t' || *p == '\n' || *p == '\r') ++p;
        }
        if ((int64_t) cols.size() != 1 + 2 * k) die("%s: a line without 1 + 2*top-k numbers", path.c_str());
        rows.emplace_back((long long) cols[0], std::vector<double>(cols.begin() + 1, cols.end()));
    }
    std::fclose(f);
    if (rows.empty()) die("%s: no routing rows", path.c_str());
    std::sort(rows.begin(), rows.end(), [](const auto & x, const auto & y) { return x.first < y.first; });
    T = (int64_t) rows.size();
    Routing r;
    r.ids.resize(T * k);
    r.w.resize(T * k);
    for (int64_t t = 0; t < T; ++t) {
        if (rows[t].first != t) die("%s: token ids are not 0..T-1", path.c_str());
        for (int64_t j = 0; j < k; ++j) {
            const double e = rows[t].second[j];
            if (e < 0 || e >= (double) E) die("%s: expert id out of range", path.c_str());
            r.ids[t * k + j] = (int32_t) e;
            r.w[t * k + j] = (float) rows[t].second[k + j];
        }
    }
    return r;
}

double now_ms() {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Layer {
    ggml_type type;
    ggml_backend_t backend = nullptr;
    ggml_backend_buffer_type_t buft = nullptr;
    std::vector<std::string> tried;
    ggml_context * wctx = nullptr;
    ggml_backend_buffer_t wbuf = nullptr;
    ggml_tensor *up_exps = nullptr, *gate_exps = nullptr, *down_exps = nullptr;
    // --gpt-oss: f32 biases [F, E], [F, E], [D, E] in a plain CPU buffer.
    ggml_context * bctx = nullptr;
    ggml_backend_buffer_t bbuf = nullptr;
    ggml_tensor *up_b = nullptr, *gate_b = nullptr, *down_b = nullptr;
    std::vector<uint8_t> qg, qu, qd;  // host copies (ggml's row layout) for --check
    double setup_s = 0;
};

void make_layer(const Args & a, Layer & L) {
    const int64_t E = a.experts, k = a.top_k, D = a.d_model, F = a.d_ff;
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!dev) die("no CPU device%s", "");
    L.backend = ggml_backend_dev_init(dev, nullptr);
    if (!L.backend) die("ggml_backend_dev_init failed%s", "");

    ggml_init_params wp = {ggml_tensor_overhead() * 4, nullptr, true};
    L.wctx = ggml_init(wp);
    L.up_exps = ggml_new_tensor_3d(L.wctx, L.type, D, F, E);
    L.gate_exps = ggml_new_tensor_3d(L.wctx, L.type, D, F, E);
    L.down_exps = ggml_new_tensor_3d(L.wctx, L.type, F, D, E);
    ggml_set_name(L.up_exps, "up_exps");
    ggml_set_name(L.gate_exps, "gate_exps");
    ggml_set_name(L.down_exps, "down_exps");
    std::vector<std::string> tried_down;
    L.buft = select_weight_buft(dev, L.up_exps, k, L.tried);
    ggml_backend_buffer_type_t buft_down = select_weight_buft(dev, L.down_exps, k, tried_down);
    if (!L.buft || !buft_down) die("no buffer type supports MUL_MAT_ID for this type%s", "");
    if (L.buft != buft_down)
        die("gate/up and down want different buffer types (%s); not handled", ggml_backend_buft_name(buft_down));
    L.wbuf = ggml_backend_alloc_ctx_tensors_from_buft(L.wctx, L.buft);
    if (!L.wbuf) die("could not allocate the weights%s", "");
    ggml_backend_buffer_set_usage(L.wbuf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);

    const double t0 = now_ms();
    struct { ggml_tensor * t; std::vector<uint8_t> * q; int64_t n_in, n_out; int id; } w[3] = {
        {L.gate_exps, &L.qg, D, F, 1}, {L.up_exps, &L.qu, D, F, 2}, {L.down_exps, &L.qd, F, D, 3}};
    for (auto & x : w) {
        *x.q = make_weights(L.type, x.n_in, x.n_out, E, a.seed, x.id, std::max(a.threads, 1));
        ggml_backend_tensor_set(x.t, x.q->data(), 0, x.q->size());  // the repack happens here
        if (!a.check) std::vector<uint8_t>().swap(*x.q);
    }
    if (a.gpt_oss) {
        ggml_init_params bp = {ggml_tensor_overhead() * 4, nullptr, true};
        L.bctx = ggml_init(bp);
        L.gate_b = ggml_new_tensor_2d(L.bctx, GGML_TYPE_F32, F, E);
        L.up_b = ggml_new_tensor_2d(L.bctx, GGML_TYPE_F32, F, E);
        L.down_b = ggml_new_tensor_2d(L.bctx, GGML_TYPE_F32, D, E);
        L.bbuf = ggml_backend_alloc_ctx_tensors(L.bctx, L.backend);
        if (!L.bbuf) die("could not allocate the biases%s", "");
        int id = 10;
        for (ggml_tensor * b : {L.gate_b, L.up_b, L.down_b}) {
            std::vector<float> v(ggml_nelements(b));
            Rng g(a.seed * 131 + (uint64_t) id++);
            for (auto & x : v) x = (float) (g.uniform() - 0.5);
            ggml_backend_tensor_set(b, v.data(), 0, v.size() * sizeof(float));
        }
    }
    L.setup_s = (now_ms() - t0) / 1e3;
}

// One case: inputs, graph, optional check, timing; prints one JSON line.
void run_case(const Args & a, Layer & L) {
    const int64_t E = a.experts, k = a.top_k, D = a.d_model, F = a.d_ff;
    Routing file_route;
    int64_t T = a.tokens;
    if (!a.route_file.empty()) {
        int64_t T_file = 0;
        file_route = read_route(a.route_file, k, E, T_file);
        if (a.tokens_given && T != T_file) die("--tokens differs from the rows of %s", a.route_file.c_str());
        T = T_file;
    }
    ggml_backend_cpu_set_n_threads(L.backend, a.threads);

    // inputs
    ggml_init_params ipar = {ggml_tensor_overhead() * 4, nullptr, true};
    ggml_context * ictx = ggml_init(ipar);
    ggml_tensor * x = ggml_new_tensor_2d(ictx, GGML_TYPE_F32, D, T);
    ggml_tensor * ids = ggml_new_tensor_2d(ictx, GGML_TYPE_I32, k, T);
    ggml_tensor * weights = ggml_new_tensor_3d(ictx, GGML_TYPE_F32, 1, k, T);
    ggml_set_input(x);
    ggml_set_input(ids);
    ggml_set_input(weights);
    ggml_backend_buffer_t ibuf = ggml_backend_alloc_ctx_tensors(ictx, L.backend);
    if (!ibuf) die("could not allocate the inputs%s", "");

    std::vector<float> xh(T * D);
    {
        Rng g(a.seed * 31 + 7 + (uint64_t) T);
        for (auto & v : xh) v = (float) ((2.0 * g.uniform() - 1.0) * std::sqrt(3.0));
    }
    ggml_backend_tensor_set(x, xh.data(), 0, xh.size() * sizeof(float));
    std::vector<Routing> routes;
    if (!a.route_file.empty()) {
        routes.push_back(file_route);
    } else {
        const int n = a.routing == "cycled" ? a.cycle : 1;
        for (int i = 0; i < n; ++i) routes.push_back(make_routing(T, k, E, a.seed * 1000003 + 7919 * (uint64_t) T + 17 * i + 5));
    }
    auto set_routing = [&](const Routing & r) {
        ggml_backend_tensor_set(ids, r.ids.data(), 0, r.ids.size() * sizeof(int32_t));
        ggml_backend_tensor_set(weights, r.w.data(), 0, r.w.size() * sizeof(float));
    };
    set_routing(routes[0]);

    // the graph: build_moe_ffn with separate gate and up, SiLU, weights after the FFN
    ggml_init_params gp = {ggml_tensor_overhead() * (64 + (size_t) k) + ggml_graph_overhead(), nullptr, true};
    ggml_context * gctx = ggml_init(gp);
    ggml_cgraph * gf = ggml_new_graph(gctx);
    ggml_tensor * cur = ggml_reshape_3d(gctx, x, D, 1, T);
    ggml_tensor * up = ggml_mul_mat_id(gctx, L.up_exps, cur, ids);       // [F, k, T]
    ggml_tensor * gate = ggml_mul_mat_id(gctx, L.gate_exps, cur, ids);   // [F, k, T]
    ggml_tensor * act = nullptr;
    if (a.gpt_oss) {  // as llama.cpp's build_moe_ffn for gpt-oss
        up = ggml_add_id(gctx, up, L.up_b, ids);
        gate = ggml_add_id(gctx, gate, L.gate_b, ids);
        act = ggml_swiglu_oai(gctx, gate, up, 1.702f, 7.0f);
    } else {
        act = ggml_swiglu_split(gctx, gate, up);                         // silu(gate) * up
    }
    ggml_tensor * experts = ggml_mul_mat_id(gctx, L.down_exps, act, ids);  // [D, k, T]
    if (a.gpt_oss) experts = ggml_add_id(gctx, experts, L.down_b, ids);
    experts = ggml_mul(gctx, experts, weights);                          // routing weights [1, k, T]
    ggml_build_forward_expand(gf, experts);
    std::vector<ggml_tensor *> views(k);
    for (int64_t i = 0; i < k; ++i) {
        views[i] = ggml_view_2d(gctx, experts, D, T, experts->nb[2], i * experts->nb[1]);
        ggml_build_forward_expand(gf, views[i]);
    }
    ggml_tensor * out = views[0];
    for (int64_t i = 1; i < k; ++i) {
        out = ggml_add(gctx, out, views[i]);
        ggml_build_forward_expand(gf, out);
    }
    if (k == 1) out = ggml_cont(gctx, out);
    ggml_set_output(out);
    ggml_build_forward_expand(gf, out);

    ggml_gallocr_t galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(L.backend));
    if (!ggml_gallocr_alloc_graph(galloc, gf)) die("graph allocation failed%s", "");

    // check (first routing)
    double rel_l2 = -1, max_abs = -1;
    if (a.check) {
        if (ggml_backend_graph_compute(L.backend, gf) != GGML_STATUS_SUCCESS) die("compute failed%s", "");
        std::vector<float> y(T * D);
        ggml_backend_tensor_get(out, y.data(), 0, y.size() * sizeof(float));
        Args at = a;
        at.tokens = T;
        std::vector<double> ref = reference(at, L.type, L.qg, L.qu, L.qd, xh, routes[0]);
        double num = 0, den = 0;
        max_abs = 0;
        for (size_t i = 0; i < y.size(); ++i) {
            const double d = (double) y[i] - ref[i];
            num += d * d;
            den += ref[i] * ref[i];
            max_abs = std::max(max_abs, std::fabs(d));
        }
        rel_l2 = std::sqrt(num / std::max(den, 1e-300));
    }

    // time
    std::vector<double> ms;
    ms.reserve(a.iters);
    double timed_ms = 0;
    for (long it = 0; it < 100000000L; ++it) {
        if (routes.size() > 1) set_routing(routes[it % routes.size()]);
        const double t0 = now_ms();
        if (ggml_backend_graph_compute(L.backend, gf) != GGML_STATUS_SUCCESS) die("compute failed%s", "");
        const double t1 = now_ms();
        if (it >= a.warmup) {
            ms.push_back(t1 - t0);
            timed_ms += t1 - t0;
            if (a.max_seconds > 0 && ms.size() >= 3 && timed_ms >= a.max_seconds * 1e3) break;
            if ((long) ms.size() >= a.iters && timed_ms >= a.min_seconds * 1e3) break;
        }
    }
    std::vector<double> s = ms;
    std::sort(s.begin(), s.end());
    auto pct = [&](double p) {
        const double pos = p * (double) (s.size() - 1);
        const size_t i = (size_t) pos;
        const double f = pos - (double) i;
        return i + 1 < s.size() ? s[i] * (1 - f) + s[i + 1] * f : s[i];
    };
    double mean = 0;
    for (double v : s) mean += v;
    mean /= (double) s.size();
    const size_t wbytes = ggml_nbytes(L.up_exps) + ggml_nbytes(L.gate_exps) + ggml_nbytes(L.down_exps);
    std::string tried;
    for (auto & t : L.tried) tried += (tried.empty() ? "" : ",") + t;

    std::printf("{\"shape\":%s,\"gpt_oss\":%s,\"type\":\"%s\",\"T\":%lld,\"experts\":%lld,\"top_k\":%lld,\"d_model\":%lld,"
                "\"d_ff\":%lld,\"threads\":%d,\"routing\":\"%s\",\"route_file\":%s,\"p50_ms\":%.6g,\"p90_ms\":%.6g,"
                "\"min_ms\":%.6g,\"mean_ms\":%.6g,\"max_ms\":%.6g,\"iters\":%zu,\"warmup\":%d,\"tokens_per_s\":%.6g,"
                "\"weight_buffer\":\"%s\",\"repack\":%s,\"buffer_types\":\"%s\",\"weight_bytes\":%zu,\"setup_s\":%.3g",
                json_str(a.shape).c_str(), a.gpt_oss ? "true" : "false", ggml_type_name(L.type), (long long) T, (long long) E, (long long) k,
                (long long) D, (long long) F, a.threads, a.routing.c_str(), json_str(a.route_file).c_str(), pct(0.5),
                pct(0.9), s.front(), mean, s.back(), s.size(), a.warmup, (double) T / (pct(0.5) / 1e3),
                ggml_backend_buft_name(L.buft), json_str(g_repack_layout).c_str(), tried.c_str(), wbytes, L.setup_s);
    if (a.check) std::printf(",\"check_rel_l2\":%.6g,\"check_max_abs\":%.6g", rel_l2, max_abs);
    std::printf(",\"package\":\"%s\",\"ggml_version\":\"%s\",\"avx512\":%d,\"avx512_vnni\":%d}\n",
                LLAMACPP_PEER_PACKAGE, LLAMACPP_PEER_GGML_VERSION, ggml_cpu_has_avx512(), ggml_cpu_has_avx512_vnni());
    std::fflush(stdout);

    ggml_gallocr_free(galloc);
    ggml_free(gctx);
    ggml_backend_buffer_free(ibuf);
    ggml_free(ictx);
}

}  // namespace

int main(int argc, char ** argv) {
    Args a;
    parse_into(a, std::vector<std::string>(argv + 1, argv + argc), false);
    Layer L;
    L.type = parse_type(a.type);
    if (a.d_model % ggml_blck_size(L.type) || a.d_ff % ggml_blck_size(L.type))
        die("d_model and d_ff must be multiples of the type's block size (%s)",
            std::to_string(ggml_blck_size(L.type)).c_str());

    ggml_log_set(log_cb, nullptr);
    ggml_cpu_init();
    if (a.gpt_oss && a.check) die("--check does not model --gpt-oss's biases and activation%s", "");
    make_layer(a, L);

    if (!a.serve) {
        run_case(a, L);
    } else {
        // Ready: one line with the setup, then one case per input line.
        std::printf("{\"ready\":true,\"setup_s\":%.3g}\n", L.setup_s);
        std::fflush(stdout);
        std::string line;
        char buf[4096];
        while (std::fgets(buf, sizeof buf, stdin)) {
            line = buf;
            std::vector<std::string> words = split_words(line);
            if (words.empty()) continue;
            if (words[0] == "quit") break;
            Args c = a;  // layer options and the command line's case options as defaults
            c.tokens_given = false;
            parse_into(c, words, true);
            run_case(c, L);
        }
    }

    if (L.bbuf) ggml_backend_buffer_free(L.bbuf);
    if (L.bctx) ggml_free(L.bctx);
    ggml_backend_buffer_free(L.wbuf);
    ggml_free(L.wctx);
    ggml_backend_free(L.backend);
    ggml_quantize_free();
    return 0;
}
