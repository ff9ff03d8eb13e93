#!/usr/bin/env python3
"""A model larger than its memory budget: decode and prefill through the
expert cache (max_resident, docs/CACHE.md) at budgets of 100/50/25/10% of
the experts, with the disk's own read bandwidth probed in the same run.

The workload is a routing trace (colibri.routing.synthetic_trace: Zipf-like
expert popularity per layer, layer-to-layer correlation, token reuse; or a
trace you recorded from your own model, --trace) replayed by
`colibri bench --trace`, one call per (token, layer). Each budget starts
cold: the page cache is dropped (root) before the run, and the cache reads
with O_DIRECT. The decayed-frequency policy runs at every budget, LRU too
for the comparison. At 100% every expert is packed at open, so that run is
the compute alone.

The bound a run is held to: the bytes it read per token at the probes'
random-read bandwidth (the cache's reads are whole experts at random
places; the faster of 4 readers and 8), plus the 100% run's compute per
token.

Also in the run: colibri_io_probe (pread against io_uring at 1-8 reads in
flight), the two engines end to end (the prefill trace at 25%), and the
page-cache baseline: the same weights as a GGUF, mmapped by ggml
(bench/llamacpp_mmap.cpp, built by bench/llamacpp_peer.sh) and by Colibri's
cache, each under the same cgroup memory limit (the budget's expert bytes
plus --headroom-mib).

  bench/cache_bench.py --colibri build --out bench/results/cache-zen4
  bench/cache_bench.py --colibri build --tiny      # seconds: does it run?
"""

import argparse
import datetime
import json
import mmap
import os
import platform
import random
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

from colibri import routing  # noqa: E402


def cpu_model():
    try:
        fam = mod = name = ""
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and not name:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("cpu family") and not fam:
                fam = line.split(":", 1)[1].strip()
            elif line.startswith("model\t") and not mod:
                mod = line.split(":", 1)[1].strip()
        return "%s (family %s model %s)" % (name, fam, mod)
    except OSError:
        return platform.processor()


def drop_page_cache():
    """True when the page cache could be dropped (needs root)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _read_direct(path, buf, offset=0, length=None):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        size = os.fstat(fd).st_size if length is None else length
        done = 0
        while done < size:
            n = os.preadv(fd, [memoryview(buf)[: min(len(buf), (size - done + 4095) // 4096 * 4096)]],
                          offset + done)
            if n <= 0:
                break
            done += n
        return min(done, size)
    finally:
        os.close(fd)


def probe_disk(files, seconds, readers):
    """Sequential: files read whole one after another, one reader, 16 MiB
    requests. Random: whole files in random order, `readers` at once (the
    cache's pattern). GB/s, page cache dropped first, O_DIRECT."""
    drop_page_cache()
    buf = mmap.mmap(-1, 16 << 20)
    t0, done, i = time.perf_counter(), 0, 0
    while time.perf_counter() - t0 < seconds and i < len(files):
        done += _read_direct(files[i], buf)
        i += 1
    seq = done / (time.perf_counter() - t0) / 1e9
    drop_page_cache()
    order = files[:]
    random.Random(1).shuffle(order)
    lock = threading.Lock()
    total = [0]
    stop = time.perf_counter() + seconds
    it = iter(order)

    def worker():
        b = mmap.mmap(-1, max(os.path.getsize(files[0]) + 4096, 1 << 20))
        while time.perf_counter() < stop:
            with lock:
                p = next(it, None)
            if p is None:
                return
            n = _read_direct(p, b)
            with lock:
                total[0] += n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rnd = total[0] / (time.perf_counter() - t0) / 1e9
    return {"sequential_GBps": seq, "random_expert_GBps": rnd, "readers": readers,
            "request_bytes_random": os.path.getsize(files[0])}


def expert_files(model, layer, n_layers, n_experts):
    d = os.path.join(model, "layer_%02d" % layer) if n_layers > 1 else model
    names = sorted((f for f in os.listdir(d) if f.startswith("expert_") and f.endswith(".bin")),
                   key=lambda f: int(f[len("expert_"):-len(".bin")]))
    if len(names) != n_experts:
        raise SystemExit("%s: %d expert files, the manifest says %d" % (d, len(names), n_experts))
    return [os.path.join(d, f) for f in names], os.path.join(d, "router.bin")


def gguf_from_directory(model, manifest, path):
    """The model directory's experts and routers as a qwen3moe GGUF, the
    bytes unchanged (bf16 experts, f32 routers), written tensor by tensor so
    only one tensor is in memory at a time."""
    import gguf
    import numpy as np

    L, E, D, F = (manifest[key] for key in ("n_layers", "n_experts", "d_model", "d_ff"))
    if manifest["dtype"] != "bf16" or manifest.get("version", 1) > 2 or "shared_expert" in manifest:
        raise SystemExit("gguf_from_directory: only bf16 routed experts with a router")
    w = gguf.GGUFWriter(path + ".tmp", "qwen3moe")
    w.add_block_count(L)
    w.add_embedding_length(D)
    w.add_expert_count(E)
    w.add_expert_used_count(manifest["router"]["top_k"])
    w.add_expert_feed_forward_length(F)
    parts = (("ffn_gate_exps", F, D, 0), ("ffn_up_exps", F, D, F * D), ("ffn_down_exps", D, F, 2 * F * D))
    for layer in range(L):
        for name, rows, cols, _ in parts:
            w.add_tensor_info("blk.%d.%s.weight" % (layer, name), (E, rows, cols * 2), np.dtype(np.uint8),
                              E * rows * cols * 2, raw_dtype=gguf.GGMLQuantizationType.BF16)
        w.add_tensor_info("blk.%d.ffn_gate_inp.weight" % layer, (E, D), np.dtype(np.float32), E * D * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for layer in range(L):
        files, router = expert_files(model, layer, L, E)
        maps = [np.memmap(f, dtype=np.uint16, mode="r") for f in files]
        for _, rows, cols, start in parts:
            w.write_tensor_data(np.stack([m[start:start + rows * cols] for m in maps]).view(np.uint8))
        w.write_tensor_data(np.fromfile(router, dtype=np.float32, count=E * D))
        del maps
    w.close()
    os.replace(path + ".tmp", path)


class MemoryLimit:
    """Runs a command inside a memory cgroup with a hard limit, so the page
    cache it fills is reclaimed at the limit as under memory pressure:
    cgroup v2 (memory.max) where the memory controller is there, else v1
    (memory.limit_in_bytes). Needs root. The peak usage of each run comes
    back with its output."""

    def __init__(self, name="colibri-cache-bench"):
        self.v2 = None
        root2 = "/sys/fs/cgroup"
        if os.path.exists(os.path.join(root2, "cgroup.controllers")) and \
                "memory" in open(os.path.join(root2, "cgroup.controllers")).read().split():
            self.dir, self.v2 = os.path.join(root2, name), True
        elif os.path.isdir("/sys/fs/cgroup/memory"):
            self.dir, self.v2 = os.path.join("/sys/fs/cgroup/memory", name), False
        else:
            raise OSError("no memory cgroup controller (v2 or v1) under /sys/fs/cgroup")
        os.makedirs(self.dir, exist_ok=True)
        if self.v2:
            with open(os.path.join(root2, "cgroup.subtree_control"), "w") as f:
                f.write("+memory")

    def describe(self):
        return "cgroup %s (%s)" % (self.dir, "v2 memory.max" if self.v2 else "v1 memory.limit_in_bytes")

    def _write(self, name, value):
        with open(os.path.join(self.dir, name), "w") as f:
            f.write(str(value))

    def _read(self, name):
        try:
            return int(open(os.path.join(self.dir, name)).read().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def run(self, cmd, limit_bytes):
        if self.v2:
            self._write("memory.max", limit_bytes)
            if os.path.exists(os.path.join(self.dir, "memory.swap.max")):
                self._write("memory.swap.max", 0)
            try:
                self._write("memory.peak", "0")  # newer kernels reset the peak so
            except OSError:
                pass
        else:
            self._write("memory.limit_in_bytes", limit_bytes)
            self._write("memory.max_usage_in_bytes", 0)
        wrapped = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', self.dir] + cmd
        r = subprocess.run(wrapped, capture_output=True, text=True)
        peak = self._read("memory.peak" if self.v2 else "memory.max_usage_in_bytes")
        return r, peak


def run_limited(limit, cmd, limit_bytes, what):
    drop_page_cache()
    t0 = time.perf_counter()
    r, peak = limit.run(cmd, limit_bytes)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit("%s failed under a %d MiB limit: %s\n%s" % (what, limit_bytes >> 20, " ".join(cmd), r.stderr))
    out = r.stdout.strip()
    try:
        doc = json.loads(out)
    except ValueError:  # llamacpp_mmap: one JSON line after any other output
        doc = json.loads(out.splitlines()[-1])
    doc.update({"wall_seconds": wall, "command": " ".join(cmd), "limit_bytes": limit_bytes, "peak_bytes": peak})
    return doc


def io_engines(probe, files, seconds):
    """The reader pool's pread against io_uring at 1-8 reads in flight
    (colibri_io_probe), random whole experts, O_DIRECT."""
    rng = random.Random(3)
    sample = rng.sample(files, min(len(files), 256))
    r = subprocess.run([probe, "--seconds", str(seconds), "--depths", "1,2,4,8"] + sample,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit("colibri_io_probe failed: %s" % r.stderr)
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


def bench_cmd(cli, model, trace, threads, budget, eviction, warmup):
    cmd = [cli, "bench", "--model", model, "--trace", trace, "--threads", str(threads), "--json",
           "--warmup", str(warmup), "--no-verify"]
    if budget < 100:
        cmd += ["--max-resident", "%g%%" % budget, "--eviction", eviction]
    return cmd


def run_bench(cli, model, trace, threads, budget, eviction, warmup, extra=()):
    cmd = bench_cmd(cli, model, trace, threads, budget, eviction, warmup) + list(extra)
    drop_page_cache()
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit("colibri bench failed: %s\n%s" % (" ".join(cmd), r.stderr))
    doc = json.loads(r.stdout)
    doc["wall_seconds"] = wall
    doc["command"] = " ".join(cmd)
    return doc


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--colibri", default="build", help="build directory (tools/colibri inside)")
    ap.add_argument("--model", help="model directory (default: generated under the build's bench-work)")
    ap.add_argument("--trace", help="a .ctrace to replay (default: synthetic)")
    ap.add_argument("--budgets", default="100,50,25,10")
    ap.add_argument("--decode-tokens", type=int, default=24)
    ap.add_argument("--prefill-tokens", type=int, default=96)
    ap.add_argument("--skew", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--probe-seconds", type=float, default=4.0)
    ap.add_argument("--tiny", action="store_true", help="a small model, seconds")
    ap.add_argument("--out", help="folder for results.json, the traces and cache.png")
    ap.add_argument("--peer", help="the page-cache peer, llamacpp_mmap (default: BUILD/llamacpp-peer/llamacpp_mmap, "
                    "made by bench/llamacpp_peer.sh; skipped when missing)")
    ap.add_argument("--page-cache-budgets", default="50,25,10",
                    help="budgets at which Colibri and the mmapped GGUF run under the same memory limit")
    ap.add_argument("--headroom-mib", type=int, default=256,
                    help="the memory limit is the budget's expert bytes plus this much")
    ap.add_argument("--io-seconds", type=float, default=3.0, help="per engine and depth in colibri_io_probe")
    ap.add_argument("--engine-repeats", type=int, default=3,
                    help="rounds of the end-to-end read-engine comparison (prefill trace at 25%%)")
    a = ap.parse_args()

    cli = os.path.join(a.colibri, "tools", "colibri")
    work = os.path.join(a.colibri, "bench-work")
    os.makedirs(work, exist_ok=True)
    if a.tiny:
        L, E, D, F, k, dtype = 4, 16, 256, 256, 4, "bf16"
    else:
        # 6.1 GiB of bf16 experts: 8 layers of 64 experts (Qwen3-30B-A3B's
        # d_model, a shorter d_ff), top-8.
        L, E, D, F, k, dtype = 8, 64, 2048, 1024, 8, "bf16"
    model = a.model or os.path.join(work, "cache-l%d-e%d-d%d-f%d-%s" % (L, E, D, F, dtype))
    if not os.path.exists(os.path.join(model, "colibri.json")):
        subprocess.run([cli, "gen", "--out", model, "--experts", str(E), "--d-model", str(D), "--d-ff", str(F),
                        "--layers", str(L), "--dtype", dtype, "--router", "qwen3_moe", "--top-k", str(k),
                        "--norm-topk-prob"], check=True)
    manifest = json.load(open(os.path.join(model, "colibri.json")))
    L, E = manifest["n_layers"], manifest["n_experts"]
    k = manifest.get("router", {}).get("top_k", k)
    out = a.out or os.path.join(work, "cache-results")
    os.makedirs(out, exist_ok=True)

    traces = {}
    if a.trace:
        traces["given"] = a.trace
    else:
        decode = routing.synthetic_trace(L, E, k, a.decode_tokens, skew=a.skew, seed=1)
        traces["decode"] = os.path.join(out, "decode.ctrace")
        decode.save(traces["decode"])
        prefill = routing.synthetic_trace(L, E, k, 0, prefill_tokens=a.prefill_tokens, skew=a.skew, seed=2)
        traces["prefill"] = os.path.join(out, "prefill.ctrace")
        prefill.save(traces["prefill"])

    files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(model) for f in fs if f.startswith("expert"))
    disk = probe_disk(files, a.probe_seconds, 4)
    print("disk: sequential %.2f GB/s, random whole experts (%d MB, 4 in flight) %.2f GB/s" %
          (disk["sequential_GBps"], disk["request_bytes_random"] // 1000000, disk["random_expert_GBps"]))

    budgets = [float(b) for b in a.budgets.split(",")]
    runs = []
    for name, trace in traces.items():
        for budget in budgets:
            for eviction in (["freq", "lru"] if budget < 100 else ["freq"]):
                doc = run_bench(cli, model, trace, a.threads, budget, eviction, 0)
                part = doc["prefill"] if doc["prefill"]["steps"] else doc["decode"]
                runs.append({"trace": name, "budget_percent": budget, "eviction": eviction,
                             "tokens_per_second": part["tokens_per_second"], "seconds": part["seconds"],
                             "tokens": part["tokens"], "timed": doc["timed"], "cache": doc["cache"],
                             "command": doc["command"]})
                c = doc["cache"] or {}
                hits, misses = doc["timed"]["hits"], doc["timed"]["misses"]
                print("%-8s %5.1f%% %-4s %8.2f tokens/s  hit rate %5.1f%%  %7.1f MB read/token  waited %.2f s" %
                      (name, budget, eviction, part["tokens_per_second"],
                       100.0 * hits / (hits + misses) if hits + misses else 100.0,
                       doc["timed"]["bytes_read_per_token"] / 1e6, doc["timed"]["wait_seconds"]))

    # The reader pool's blocking preads against io_uring, same reads in flight.
    io_runs = []
    probe = os.path.join(a.colibri, "bench", "colibri_io_probe")
    if os.path.exists(probe):
        drop_page_cache()
        io_runs = io_engines(probe, files, a.io_seconds)
        for r in io_runs:
            print("io %-8s %d in flight: %.2f GB/s" % (r["engine"], r["depth"], r["GBps"]))
    else:
        print("no %s (liburing-dev missing?): pread against io_uring not measured" % probe)

    # The engines end to end: the prefill trace (every expert of every layer
    # read, in waves) at 25%, pread and io_uring at the default reader count,
    # and pread at 4 readers, in turn, so the host's swings fall on all.
    engine_runs = []
    engine_cases = (("pread", ["--io-engine", "pread"]), ("io_uring", ["--io-engine", "io_uring"]),
                    ("pread, 4 readers", ["--io-engine", "pread", "--io-threads", "4"]))
    if "prefill" in traces:
        for rep in range(a.engine_repeats):
            for label, extra in engine_cases:
                doc = run_bench(cli, model, traces["prefill"], a.threads, 25, "freq", 0, extra)
                engine_runs.append({"engine": label, "round": rep, "tokens_per_second": doc["prefill"]["tokens_per_second"],
                                    "uring_reads": (doc["cache"] or {}).get("uring_reads"), "command": doc["command"]})
                print("engine %-16s round %d: %.2f tokens/s" % (label, rep, engine_runs[-1]["tokens_per_second"]))

    # Relying on the page cache: the same weights as a GGUF, mmapped and
    # used in place (ggml, as llama.cpp runs a model larger than memory),
    # against Colibri's cache on that GGUF, both under the same memory limit.
    paged = []
    peer = a.peer or os.path.join(a.colibri, "llamacpp-peer", "llamacpp_mmap")
    limit = None
    if os.path.exists(peer):
        try:
            limit = MemoryLimit()
        except OSError as e:
            print("page-cache comparison skipped: %s" % e)
    else:
        print("page-cache comparison skipped: no %s (bench/llamacpp_peer.sh builds it)" % peer)
    if limit is not None:
        gguf_path = model.rstrip("/") + ".gguf"
        if not os.path.exists(gguf_path):
            gguf_from_directory(model, manifest, gguf_path)
        experts_bytes = L * E * 3 * manifest["d_model"] * manifest["d_ff"] * 2
        for name, trace in traces.items():
            for budget in [float(b) for b in a.page_cache_budgets.split(",")]:
                limit_bytes = int(experts_bytes * budget / 100) + (a.headroom_mib << 20)
                c = run_limited(limit, bench_cmd(cli, gguf_path, trace, a.threads, budget, "freq", 0), limit_bytes,
                                "colibri bench")
                cpart = c["prefill"] if c["prefill"]["steps"] else c["decode"]
                g = run_limited(limit, [peer, "--gguf", gguf_path, "--trace", trace, "--threads", str(a.threads)],
                                limit_bytes, "llamacpp_mmap")
                row = {"trace": name, "budget_percent": budget, "limit_bytes": limit_bytes,
                       "colibri": {"tokens_per_second": cpart["tokens_per_second"], "seconds": cpart["seconds"],
                                   "tokens": cpart["tokens"], "timed": c["timed"], "peak_bytes": c["peak_bytes"],
                                   "command": c["command"]},
                       "page_cache": g}
                row["speedup"] = cpart["tokens_per_second"] / g["tokens_per_second"] if g["tokens_per_second"] else None
                paged.append(row)
                print("%-8s %5.1f%% limit %5d MiB: colibri %7.2f tokens/s (peak %d MiB), mmap %7.2f tokens/s "
                      "(peak %d MiB, %.0f MB read/token, open %.1f s): %.2fx" %
                      (name, budget, limit_bytes >> 20, cpart["tokens_per_second"], (c["peak_bytes"] or 0) >> 20,
                       g["tokens_per_second"], (g["peak_bytes"] or 0) >> 20, g["bytes_read_per_token"] / 1e6,
                       g["open_seconds"], row["speedup"] or 0))

    # The bound: bytes read per token at the random-read bandwidth, plus
    # the compute of the 100% run (same trace). The bandwidth is the faster
    # of the two probes of whole random experts: 4 readers (probe_disk) and
    # 8 pread readers (colibri_io_probe, the cache's default count here).
    bound_GBps = disk["random_expert_GBps"]
    for r in io_runs:
        if r["engine"] == "pread" and r["depth"] == 8:
            bound_GBps = max(bound_GBps, r["GBps"])
    disk["bound_GBps"] = bound_GBps
    for r in runs:
        full = next(x for x in runs if x["trace"] == r["trace"] and x["budget_percent"] >= 100)
        compute = full["seconds"] / max(1, full["tokens"])
        io = r["timed"]["bytes_read_per_token"] / (bound_GBps * 1e9)
        r["bound_seconds_per_token"] = compute + io
        r["seconds_per_token"] = r["seconds"] / max(1, r["tokens"])
        r["over_bound"] = r["seconds_per_token"] / r["bound_seconds_per_token"]

    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "cpu": cpu_model(),
           "model": model, "layers": L, "experts": E, "top_k": k, "threads": a.threads, "disk": disk,
           "page_cache_dropped": drop_page_cache(), "runs": runs, "traces": traces, "io_engines": io_runs, "engine_runs": engine_runs,
           "page_cache": {"limit": limit.describe() if limit else None, "headroom_mib": a.headroom_mib,
                          "runs": paged}}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(doc, f, indent=2)
    print("\n| trace | budget | policy | tokens/s | hit rate | MB read / token | s / token | bound | over bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        t = r["timed"]
        n = t["hits"] + t["misses"]
        print("| %s | %g%% | %s | %.2f | %s | %.1f | %.4f | %.4f | %.2fx |" % (
            r["trace"], r["budget_percent"], r["eviction"], r["tokens_per_second"],
            "%.1f%%" % (100.0 * t["hits"] / n) if n else "(resident)", t["bytes_read_per_token"] / 1e6,
            r["seconds_per_token"], r["bound_seconds_per_token"], r["over_bound"]))
    if io_runs:
        print("\n| reads in flight | pread pool GB/s | io_uring GB/s |")
        print("|---|---|---|")
        for d in sorted({r["depth"] for r in io_runs}):
            by = {r["engine"]: r["GBps"] for r in io_runs if r["depth"] == d}
            print("| %d | %.2f | %.2f |" % (d, by.get("pread", 0), by.get("io_uring", 0)))
    if engine_runs:
        import statistics
        print("\n| prefill at 25%, engine | tokens/s, median | rounds |")
        print("|---|---|---|")
        for label, _ in engine_cases:
            v = [r["tokens_per_second"] for r in engine_runs if r["engine"] == label]
            print("| %s | %.2f | %s |" % (label, statistics.median(v), ", ".join("%.2f" % x for x in v)))
    if paged:
        print("\n| trace | budget | memory limit | Colibri tokens/s | peak MiB | mmap tokens/s | peak MiB | "
              "mmap MB read / token | Colibri / mmap |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in paged:
            c, g = r["colibri"], r["page_cache"]
            print("| %s | %g%% | %d MiB | %.2f | %d | %.2f | %d | %.0f | %.2fx |" % (
                r["trace"], r["budget_percent"], r["limit_bytes"] >> 20, c["tokens_per_second"],
                (c["peak_bytes"] or 0) >> 20, g["tokens_per_second"], (g["peak_bytes"] or 0) >> 20,
                g["bytes_read_per_token"] / 1e6, r["speedup"] or 0))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, len(traces), figsize=(5.5 * len(traces), 4), squeeze=False)
        for ax, name in zip(axes[0], traces):
            ax2 = ax.twinx()
            for ev, style in (("freq", "-o"), ("lru", "--s")):
                rs = sorted((r for r in runs if r["trace"] == name and (r["eviction"] == ev or r["budget_percent"] >= 100)),
                            key=lambda r: r["budget_percent"])
                xs = [r["budget_percent"] for r in rs]
                ax.plot(xs, [r["tokens_per_second"] for r in rs], style, color="tab:blue", label="tokens/s, " + ev)
                hr = [100.0 * r["timed"]["hits"] / max(1, r["timed"]["hits"] + r["timed"]["misses"])
                      if r["budget_percent"] < 100 else 100.0 for r in rs]
                ax2.plot(xs, hr, style, color="tab:orange", label="hit rate, " + ev)
            ax.set_xlabel("memory budget, % of the experts")
            ax.set_ylabel("tokens/s")
            ax2.set_ylabel("hit rate, %")
            ax.set_title("%s (%s)" % (name, cpu_model().split(" (")[0]))
            ax.legend(loc="upper left", fontsize=7)
            ax2.legend(loc="lower right", fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "cache.png"), dpi=110)
    except ImportError:
        print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
