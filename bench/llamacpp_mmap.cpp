// llamacpp_mmap: a GGUF's MoE layers run the way llama.cpp runs a model
// larger than memory: the file mmapped, the expert tensors used in place
// from the mapping, every miss a page fault served by the page cache. The
// baseline of bench/cache_bench.py (issue: "relying on the page cache").
//
// Built by bench/llamacpp_peer.sh against the ggml that PyPI's
// llama-cpp-python sdist vendors. Nothing here is copied from llama.cpp; it
// reproduces with ggml's public API:
//
//  * llama.cpp's loader with mmap on (its default): the file is mapped
//    read-only and shared, POSIX_FADV_SEQUENTIAL is advised on it, and
//    MAP_POPULATE and POSIX_MADV_WILLNEED over the whole file are asked for
//    unless --no-populate (llama_mmap's prefetch, on by default); the weights' tensors get addresses inside the mapping
//    through a CPU buffer from that pointer (ggml_backend_cpu_buffer_from_ptr),
//    so nothing is copied. bf16, f16, f32 and q8_0 expert tensors stay in
//    place on x86 (the CPU_REPACK buffer type takes q4_0/q4_K, which are
//    copied out of the mapping; this harness refuses those);
//  * the graph of llm_graph_context::build_moe_ffn for separate gate/up
//    tensors, SiLU gating, as bench/llamacpp_moe.cpp builds it, with the
//    routing taken from a .ctrace (docs/FORMAT.md) and weights 1/k (the
//    router is left out: the trace gives the experts, as `colibri bench
//    --trace` takes them).
//
//   llamacpp_mmap --gguf M.gguf --trace T.ctrace [--threads N] [--no-populate]
//
// Output: one JSON line: open seconds, tokens, seconds, tokens/s, major page
// faults and bytes read from the device (/proc/self/io) during the timed
// part.

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#ifndef LLAMACPP_PEER_PACKAGE
#define LLAMACPP_PEER_PACKAGE "unknown"
#endif

namespace {

[[noreturn]] void die(const char * fmt, const char * a = "") {
    std::fprintf(stderr, "llamacpp_mmap: ");
    std::fprintf(stderr, fmt, a);
    std::fprintf(stderr, "\n");
    std::exit(2);
}

double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Bytes this process has caused to be read from storage (Linux's
// /proc/self/io read_bytes); -1 where it cannot be read.
long long read_bytes() {
    std::ifstream f("/proc/self/io");
    std::string key;
    long long v = -1;
    while (f >> key) {
        long long x;
        if (!(f >> x)) break;
        if (key == "read_bytes:") v = x;
    }
    return v;
}

long major_faults() {
    rusage ru {};
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_majflt;
}

struct Step {
    uint32_t layer = 0, tokens = 0;
    std::vector<int32_t> ids;  // [tokens][k]
};

struct Trace {
    uint32_t layers = 0, experts = 0, top_k = 0;
    std::vector<Step> steps;
};

Trace read_trace(const std::string & path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) die("cannot open %s", path.c_str());
    char magic[8];
    uint32_t version = 0;
    uint64_t n = 0;
    Trace t;
    f.read(magic, 8);
    f.read(reinterpret_cast<char *>(&version), 4);
    f.read(reinterpret_cast<char *>(&t.layers), 4);
    f.read(reinterpret_cast<char *>(&t.experts), 4);
    f.read(reinterpret_cast<char *>(&t.top_k), 4);
    f.read(reinterpret_cast<char *>(&n), 8);
    if (!f || std::memcmp(magic, "CLBTRACE", 8) != 0 || version != 1) die("%s: not a version-1 routing trace", path.c_str());
    for (uint64_t i = 0; i < n; ++i) {
        Step s;
        f.read(reinterpret_cast<char *>(&s.layer), 4);
        f.read(reinterpret_cast<char *>(&s.tokens), 4);
        if (!f || s.layer >= t.layers) die("%s: bad record", path.c_str());
        s.ids.resize(static_cast<size_t>(s.tokens) * t.top_k);
        f.read(reinterpret_cast<char *>(s.ids.data()), static_cast<std::streamsize>(s.ids.size() * 4));
        if (!f) die("%s: truncated record", path.c_str());
        for (int32_t & e : s.ids) {
            if (e < -1 || e >= static_cast<int32_t>(t.experts)) die("%s: expert id out of range", path.c_str());
            if (e < 0) die("%s: empty slots (-1) are not handled", path.c_str());
        }
        t.steps.push_back(std::move(s));
    }
    return t;
}

void log_cb(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

}  // namespace

int main(int argc, char ** argv) {
    std::string gguf_path, trace_path;
    int threads = 2;
    bool populate = true;
    for (int i = 1; i < argc; ++i) {
        std::string s = argv[i];
        auto next = [&]() -> std::string {
            if (i + 1 >= argc) die("%s needs a value", s.c_str());
            return argv[++i];
        };
        if (s == "--gguf") gguf_path = next();
        else if (s == "--trace") trace_path = next();
        else if (s == "--threads") threads = std::atoi(next().c_str());
        else if (s == "--no-populate") populate = false;
        else die("unknown option %s (usage: --gguf M.gguf --trace T.ctrace [--threads N] [--no-populate])", s.c_str());
    }
    if (gguf_path.empty() || trace_path.empty()) die("--gguf and --trace are required%s");
    ggml_log_set(log_cb, nullptr);
    const Trace trace = read_trace(trace_path);
    const int64_t k = trace.top_k;

    const double t_open = now_s();
    ggml_context * meta = nullptr;
    gguf_init_params gp = {true, &meta};
    gguf_context * g = gguf_init_from_file(gguf_path.c_str(), gp);
    if (!g) die("%s: not a GGUF ggml can read", gguf_path.c_str());
    const int fd = open(gguf_path.c_str(), O_RDONLY);
    struct stat st {};
    if (fd < 0 || fstat(fd, &st) != 0) die("cannot open %s", gguf_path.c_str());
    const size_t size = static_cast<size_t>(st.st_size);
    posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    void * map = mmap(nullptr, size, PROT_READ, MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, 0);
    if (map == MAP_FAILED) die("mmap of %s failed", gguf_path.c_str());
    if (populate) posix_madvise(map, size, POSIX_MADV_WILLNEED);
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_t backend = dev ? ggml_backend_dev_init(dev, nullptr) : nullptr;
    if (!backend) die("no CPU backend%s");
    ggml_backend_cpu_set_n_threads(backend, threads);
    ggml_backend_buffer_t wbuf = ggml_backend_cpu_buffer_from_ptr(map, size);
    ggml_backend_buffer_set_usage(wbuf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    const size_t data0 = gguf_get_data_offset(g);
    for (int64_t i = 0; i < gguf_get_n_tensors(g); ++i) {
        ggml_tensor * t = ggml_get_tensor(meta, gguf_get_tensor_name(g, i));
        if (ggml_backend_tensor_alloc(wbuf, t, static_cast<char *>(map) + data0 + gguf_get_tensor_offset(g, i)) !=
            GGML_STATUS_SUCCESS)
            die("could not place %s in the mapping", ggml_get_name(t));
    }
    struct LayerW { ggml_tensor *gate, *up, *down; };
    std::vector<LayerW> layers(trace.layers);
    int64_t D = 0;
    for (uint32_t l = 0; l < trace.layers; ++l) {
        auto get = [&](const char * what) {
            std::string name = "blk." + std::to_string(l) + "." + what + ".weight";
            ggml_tensor * t = ggml_get_tensor(meta, name.c_str());
            if (!t) die("%s: no tensor %s", name.c_str());
            if (t->type == GGML_TYPE_Q4_0 || t->type == GGML_TYPE_Q4_K)
                die("%s: q4_0/q4_K are repacked out of the mapping on x86; not a page-cache run", name.c_str());
            if (t->ne[2] != static_cast<int64_t>(trace.experts)) die("%s: expert count differs from the trace", name.c_str());
            return t;
        };
        layers[l] = {get("ffn_gate_exps"), get("ffn_up_exps"), get("ffn_down_exps")};
        D = layers[l].gate->ne[0];
    }
    const double open_s = now_s() - t_open;

    // Inputs for the largest call; every call uses a view of the first rows.
    uint32_t T_max = 1;
    for (const Step & s : trace.steps) T_max = std::max(T_max, s.tokens);
    ggml_init_params ip = {ggml_tensor_overhead() * 4, nullptr, true};
    ggml_context * ictx = ggml_init(ip);
    ggml_tensor * x = ggml_new_tensor_2d(ictx, GGML_TYPE_F32, D, T_max);
    ggml_backend_buffer_t ibuf = ggml_backend_alloc_ctx_tensors(ictx, backend);
    {
        std::vector<float> xh(static_cast<size_t>(D) * T_max);
        uint64_t s = 88172645463325252ull;
        for (float & v : xh) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            v = static_cast<float>(static_cast<double>(s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
        }
        ggml_backend_tensor_set(x, xh.data(), 0, xh.size() * sizeof(float));
    }
    ggml_gallocr_t galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend));

    uint64_t tokens = 0;
    double seconds = 0, max_call = 0;
    const long faults0 = major_faults();
    const long long read0 = read_bytes();
    double checksum = 0;
    for (const Step & s : trace.steps) {
        if (s.tokens == 0) continue;
        const int64_t T = s.tokens;
        const LayerW & L = layers[s.layer];
        ggml_init_params cp = {ggml_tensor_overhead() * (64 + static_cast<size_t>(k)) + ggml_graph_overhead(), nullptr, true};
        ggml_context * gctx = ggml_init(cp);
        ggml_cgraph * gf = ggml_new_graph(gctx);
        ggml_tensor * ids = ggml_new_tensor_2d(gctx, GGML_TYPE_I32, k, T);
        ggml_tensor * w = ggml_new_tensor_3d(gctx, GGML_TYPE_F32, 1, k, T);
        ggml_set_input(ids);
        ggml_set_input(w);
        ggml_tensor * cur = ggml_view_3d(gctx, x, D, 1, T, x->nb[1], x->nb[1], 0);
        ggml_tensor * up = ggml_mul_mat_id(gctx, L.up, cur, ids);
        ggml_tensor * gate = ggml_mul_mat_id(gctx, L.gate, cur, ids);
        ggml_tensor * act = ggml_swiglu_split(gctx, gate, up);
        ggml_tensor * experts = ggml_mul_mat_id(gctx, L.down, act, ids);
        experts = ggml_mul(gctx, experts, w);
        ggml_build_forward_expand(gf, experts);
        ggml_tensor * out = ggml_view_2d(gctx, experts, D, T, experts->nb[2], 0);
        for (int64_t i = 1; i < k; ++i) {
            out = ggml_add(gctx, out, ggml_view_2d(gctx, experts, D, T, experts->nb[2], i * experts->nb[1]));
        }
        if (k == 1) out = ggml_cont(gctx, out);
        ggml_set_output(out);
        ggml_build_forward_expand(gf, out);
        if (!ggml_gallocr_alloc_graph(galloc, gf)) die("graph allocation failed%s");
        ggml_backend_tensor_set(ids, s.ids.data(), 0, s.ids.size() * sizeof(int32_t));
        std::vector<float> wv(static_cast<size_t>(T * k), 1.0f / static_cast<float>(k));
        ggml_backend_tensor_set(w, wv.data(), 0, wv.size() * sizeof(float));

        const double t0 = now_s();
        if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) die("compute failed%s");
        const double dt = now_s() - t0;
        seconds += dt;
        max_call = std::max(max_call, dt);
        float y0 = 0;
        ggml_backend_tensor_get(out, &y0, 0, sizeof(float));
        checksum += y0;
        if (s.layer == 0) tokens += static_cast<uint64_t>(T);
        ggml_free(gctx);
    }
    const long faults = major_faults() - faults0;
    const long long rb = read_bytes();
    std::printf("{\"runner\":\"ggml-mmap\",\"package\":\"%s\",\"populate\":%s,\"open_seconds\":%.3f,"
                "\"tokens\":%llu,\"seconds\":%.4f,\"tokens_per_second\":%.4f,\"max_call_seconds\":%.4f,"
                "\"major_faults\":%ld,\"bytes_read\":%lld,\"bytes_read_per_token\":%.0f,\"threads\":%d,\"checksum\":%.6g}\n",
                LLAMACPP_PEER_PACKAGE, populate ? "true" : "false", open_s,
                static_cast<unsigned long long>(tokens), seconds, tokens ? static_cast<double>(tokens) / seconds : 0.0,
                max_call, faults, (rb >= 0 && read0 >= 0) ? rb - read0 : -1LL,
                (rb >= 0 && read0 >= 0 && tokens) ? static_cast<double>(rb - read0) / static_cast<double>(tokens) : -1.0,
                threads, checksum);
    ggml_gallocr_free(galloc);
    ggml_backend_buffer_free(ibuf);
    ggml_free(ictx);
    ggml_backend_buffer_free(wbuf);
    ggml_backend_free(backend);
    munmap(map, size);
    close(fd);
    gguf_free(g);
    ggml_free(meta);
    return 0;
}
