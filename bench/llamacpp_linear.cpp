// llamacpp_linear: one dense linear layer y = x W^T on ggml's CPU backend, as
// llama.cpp computes a projection: ggml_mul_mat(W [in, out], x [in, T]) with
// the weight in the buffer type llama.cpp's model loader would choose, timed.
//
// The llama.cpp peer of colibri.nn.Linear, driven by bench/linear_bench.py;
// built by bench/llamacpp_peer.sh next to llamacpp_moe (whose comments
// describe the loader's rule). Nothing here is copied from llama.cpp: the
// buffer type is the first of the CPU device's extra buffer types (AMX,
// CPU_REPACK, ... as compiled in) and then the plain CPU buffer type whose
// device supports a MUL_MAT with the weight in it, tested on the op the
// loader tests with (512 tokens).
//
// Weights: --weights FILE holds the out rows as GGUF stores them (the driver
// writes Colibri's quantisation; the block layouts are GGUF's), else random
// normal*0.02 quantised with ggml_quantize_chunk. --check compares each
// output with a float64 reference computed from ggml's own dequantisation
// (type traits' to_float) of the same bytes.
//
//   llamacpp_linear --type q4_K --out 4096 --in 2048 [--weights FILE] [--check] [--serve]
//                   [--tokens T] [--iters N] [--warmup N] [--min-seconds S] [--threads N]
//                   [--input FILE] [--output FILE]
// --input: float32 [T, in] activations (else uniform, std 1); --output: writes
// y float32 [T, out]. With --serve one JSON line {"ready":...} and then one
// case per stdin line (the options of the second line above, and --check),
// each answered with one JSON line {"T":..., "p50_us":..., ...}.

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <strings.h>
#include <vector>

#ifndef LLAMACPP_PEER_PACKAGE
#define LLAMACPP_PEER_PACKAGE "unknown"
#endif

namespace {

struct Args {
    std::string type = "q8_0", weights;
    int64_t n_out = 512, n_in = 2048;
    bool check = false, serve = false;
    // per case
    int64_t tokens = 1;
    int iters = 20, warmup = 3, threads = 2;
    double min_seconds = 0;
    std::string input, output;
};

[[noreturn]] void die(const std::string & msg) {
    std::fprintf(stderr, "llamacpp_linear: %s\n", msg.c_str());
    std::exit(2);
}

void parse_into(Args & a, const std::vector<std::string> & w, bool case_only) {
    for (size_t i = 0; i < w.size(); ++i) {
        const std::string & k = w[i];
        if (k == "--check") { a.check = true; continue; }
        if (!case_only && k == "--serve") { a.serve = true; continue; }
        if (i + 1 >= w.size()) die("missing value for " + k);
        const std::string & v = w[++i];
        if (k == "--tokens") a.tokens = std::atoll(v.c_str());
        else if (k == "--iters") a.iters = std::atoi(v.c_str());
        else if (k == "--warmup") a.warmup = std::atoi(v.c_str());
        else if (k == "--threads") a.threads = std::atoi(v.c_str());
        else if (k == "--min-seconds") a.min_seconds = std::atof(v.c_str());
        else if (k == "--input") a.input = v;
        else if (k == "--output") a.output = v;
        else if (case_only) die("not a case option: " + k);
        else if (k == "--type") a.type = v;
        else if (k == "--weights") a.weights = v;
        else if (k == "--out") a.n_out = std::atoll(v.c_str());
        else if (k == "--in") a.n_in = std::atoll(v.c_str());
        else die("unknown option " + k);
    }
    if (a.tokens < 1 || a.iters < 1 || a.threads < 1 || a.n_out < 1 || a.n_in < 1) die("need positive sizes");
}

ggml_type parse_type(const std::string & s) {
    for (int t = 0; t < GGML_TYPE_COUNT; ++t) {
        const char * n = ggml_type_name((ggml_type) t);
        if (n && strcasecmp(n, s.c_str()) == 0 && ggml_get_type_traits((ggml_type) t)->to_float) return (ggml_type) t;
    }
    die("unknown --type " + s);
}

std::string g_repack;  // "repack tensor W with q4_K_8x8" from the CPU backend's log
void log_cb(ggml_log_level level, const char * text, void *) {
    if (const char * p = std::strstr(text, " with ")) {
        if (std::strstr(text, "repack tensor") && g_repack.empty()) {
            g_repack = p + 6;
            while (!g_repack.empty() && (g_repack.back() == '\n' || g_repack.back() == ' ')) g_repack.pop_back();
        }
        return;
    }
    if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

// The loader's rule for a weight used by MUL_MAT (see the header comment).
ggml_backend_buffer_type_t select_weight_buft(ggml_backend_dev_t dev, ggml_tensor * w, std::string & tried) {
    std::vector<ggml_backend_buffer_type_t> list;
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts");
    if (get_extra)
        for (ggml_backend_buffer_type_t * p = get_extra(dev); p && *p; ++p) list.push_back(*p);
    list.push_back(ggml_backend_dev_buffer_type(dev));
    ggml_init_params ip = {ggml_tensor_overhead() * 4, nullptr, true};
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * op = ggml_mul_mat(ctx, w, ggml_new_tensor_4d(ctx, GGML_TYPE_F32, w->ne[0], 512, w->ne[2], w->ne[3]));
    ggml_backend_buffer_type_t chosen = nullptr;
    for (auto * buft : list) {
        w->buffer = ggml_backend_buft_alloc_buffer(buft, 0);
        const bool ok = ggml_backend_dev_supports_op(dev, op);
        ggml_backend_buffer_free(w->buffer);
        w->buffer = nullptr;
        tried += (tried.empty() ? "" : ",") + std::string(ggml_backend_buft_name(buft)) + (ok ? "+" : "-");
        if (ok && !chosen) chosen = buft;
    }
    ggml_free(ctx);
    return chosen;
}

double now_us() {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Layer {
    ggml_type type;
    ggml_backend_t backend = nullptr;
    ggml_backend_buffer_type_t buft = nullptr;
    ggml_context * wctx = nullptr;
    ggml_backend_buffer_t wbuf = nullptr;
    ggml_tensor * w = nullptr;
    std::vector<uint8_t> q;  // host copy of the bytes (for --check)
    std::string tried;
};

void make_layer(const Args & a, Layer & L) {
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!dev || !(L.backend = ggml_backend_dev_init(dev, nullptr))) die("no CPU backend");
    ggml_init_params wp = {ggml_tensor_overhead() * 2, nullptr, true};
    L.wctx = ggml_init(wp);
    L.w = ggml_new_tensor_2d(L.wctx, L.type, a.n_in, a.n_out);
    ggml_set_name(L.w, "weight");
    if (!(L.buft = select_weight_buft(dev, L.w, L.tried))) die("no buffer type supports MUL_MAT of this type");
    if (!(L.wbuf = ggml_backend_alloc_ctx_tensors_from_buft(L.wctx, L.buft))) die("could not allocate the weight");
    ggml_backend_buffer_set_usage(L.wbuf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    const size_t bytes = ggml_row_size(L.type, a.n_in) * a.n_out;
    L.q.resize(bytes);
    if (!a.weights.empty()) {
        FILE * f = std::fopen(a.weights.c_str(), "rb");
        if (!f) die("cannot open " + a.weights);
        const size_t got = std::fread(L.q.data(), 1, bytes, f);
        const bool extra = std::fgetc(f) != EOF;
        std::fclose(f);
        if (got != bytes || extra) die(a.weights + ": not " + std::to_string(bytes) + " bytes");
    } else {
        std::mt19937_64 g(1);
        std::normal_distribution<float> nd(0.0f, 0.02f);
        std::vector<float> wf(a.n_in * a.n_out);
        for (auto & v : wf) v = nd(g);
        ggml_quantize_init(L.type);
        ggml_quantize_chunk(L.type, wf.data(), L.q.data(), 0, a.n_out, a.n_in, nullptr);
    }
    ggml_backend_tensor_set(L.w, L.q.data(), 0, bytes);  // a repacking buffer type repacks here
}

void run_case(const Args & a, Layer & L) {
    const int64_t T = a.tokens, I = a.n_in, O = a.n_out;
    ggml_backend_cpu_set_n_threads(L.backend, a.threads);
    ggml_init_params ip = {ggml_tensor_overhead() * 2, nullptr, true};
    ggml_context * ictx = ggml_init(ip);
    ggml_tensor * x = ggml_new_tensor_2d(ictx, GGML_TYPE_F32, I, T);
    ggml_set_input(x);
    ggml_backend_buffer_t ibuf = ggml_backend_alloc_ctx_tensors(ictx, L.backend);
    std::vector<float> xh(T * I);
    if (!a.input.empty()) {
        FILE * f = std::fopen(a.input.c_str(), "rb");
        if (!f || std::fread(xh.data(), sizeof(float), xh.size(), f) != xh.size()) die("cannot read " + a.input);
        std::fclose(f);
    } else {
        std::mt19937_64 g(7 + T);
        std::uniform_real_distribution<float> ud(-1.7320508f, 1.7320508f);
        for (auto & v : xh) v = ud(g);
    }
    ggml_backend_tensor_set(x, xh.data(), 0, xh.size() * sizeof(float));

    ggml_init_params gp = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true};
    ggml_context * gctx = ggml_init(gp);
    ggml_cgraph * gf = ggml_new_graph(gctx);
    ggml_tensor * y = ggml_mul_mat(gctx, L.w, x);  // [O, T]
    ggml_set_output(y);
    ggml_build_forward_expand(gf, y);
    ggml_gallocr_t galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(L.backend));
    if (!ggml_gallocr_alloc_graph(galloc, gf)) die("graph allocation failed");

    double rel_l2 = -1, max_abs = -1;
    if (a.check || !a.output.empty()) {
        if (ggml_backend_graph_compute(L.backend, gf) != GGML_STATUS_SUCCESS) die("compute failed");
        std::vector<float> yh(T * O);
        ggml_backend_tensor_get(y, yh.data(), 0, yh.size() * sizeof(float));
        if (!a.output.empty()) {
            FILE * f = std::fopen(a.output.c_str(), "wb");
            if (!f || std::fwrite(yh.data(), sizeof(float), yh.size(), f) != yh.size()) die("cannot write " + a.output);
            std::fclose(f);
        }
        if (a.check) {
            const auto * tr = ggml_get_type_traits(L.type);
            const size_t rs = ggml_row_size(L.type, I);
            std::vector<float> row(I);
            double num = 0, den = 0;
            max_abs = 0;
            for (int64_t o = 0; o < O; ++o) {
                tr->to_float(L.q.data() + rs * o, row.data(), I);
                for (int64_t t = 0; t < T; ++t) {
                    const float * xt = xh.data() + t * I;
                    double s = 0;
                    for (int64_t i = 0; i < I; ++i) s += (double) row[i] * xt[i];
                    const double d = yh[t * O + o] - s;
                    num += d * d, den += s * s, max_abs = std::max(max_abs, std::fabs(d));
                }
            }
            rel_l2 = std::sqrt(num / std::max(den, 1e-300));
        }
    }

    std::vector<double> us;
    double timed = 0;
    for (int it = 0;; ++it) {
        const double t0 = now_us();
        if (ggml_backend_graph_compute(L.backend, gf) != GGML_STATUS_SUCCESS) die("compute failed");
        const double dt = now_us() - t0;
        if (it < a.warmup) continue;
        us.push_back(dt), timed += dt;
        if ((int) us.size() >= a.iters && timed >= a.min_seconds * 1e6) break;
    }
    std::sort(us.begin(), us.end());
    const size_t n = us.size();
    const double p50 = n % 2 ? us[n / 2] : 0.5 * (us[n / 2 - 1] + us[n / 2]);
    std::printf("{\"type\":\"%s\",\"out\":%lld,\"in\":%lld,\"T\":%lld,\"threads\":%d,\"p50_us\":%.6g,\"min_us\":%.6g,"
                "\"iters\":%zu,\"weight_buffer\":\"%s\",\"repack\":\"%s\",\"buffer_types\":\"%s\",\"weight_bytes\":%zu",
                ggml_type_name(L.type), (long long) O, (long long) I, (long long) T, a.threads, p50, us.front(), n,
                ggml_backend_buft_name(L.buft), g_repack.c_str(), L.tried.c_str(), ggml_nbytes(L.w));
    if (a.check) std::printf(",\"check_rel_l2\":%.6g,\"check_max_abs\":%.6g", rel_l2, max_abs);
    std::printf(",\"package\":\"%s\"}\n", LLAMACPP_PEER_PACKAGE);
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
    if (a.n_in % ggml_blck_size(L.type)) die("--in must be a multiple of the type's block size");
    ggml_log_set(log_cb, nullptr);
    ggml_cpu_init();
    make_layer(a, L);
    if (!a.serve) {
        run_case(a, L);
    } else {
        std::printf("{\"ready\":true,\"weight_buffer\":\"%s\"}\n", ggml_backend_buft_name(L.buft));
        std::fflush(stdout);
        char buf[4096];
        while (std::fgets(buf, sizeof buf, stdin)) {
            std::istringstream ss(buf);
            std::vector<std::string> words;
            for (std::string s; ss >> s;) words.push_back(s);
            if (words.empty()) continue;
            if (words[0] == "quit") break;
            Args c = a;
            c.input.clear(), c.output.clear();
            parse_into(c, words, true);
            run_case(c, L);
        }
    }
    ggml_backend_buffer_free(L.wbuf);
    ggml_free(L.wctx);
    ggml_backend_free(L.backend);
    return 0;
}
