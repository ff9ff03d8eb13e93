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

The bound a run is held to: the bytes it read per token at the probe's
random-read bandwidth (the cache's reads are whole experts at random
places), plus the 100% run's compute per token.

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


def run_bench(cli, model, trace, threads, budget, eviction, warmup):
    cmd = [cli, "bench", "--model", model, "--trace", trace, "--threads", str(threads), "--json",
           "--warmup", str(warmup), "--no-verify"]
    if budget < 100:
        cmd += ["--max-resident", "%g%%" % budget, "--eviction", eviction]
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

    # The bound: bytes read per token at the random-read bandwidth, plus
    # the compute of the 100% run (same trace).
    for r in runs:
        full = next(x for x in runs if x["trace"] == r["trace"] and x["budget_percent"] >= 100)
        compute = full["seconds"] / max(1, full["tokens"])
        io = r["timed"]["bytes_read_per_token"] / (disk["random_expert_GBps"] * 1e9)
        r["bound_seconds_per_token"] = compute + io
        r["seconds_per_token"] = r["seconds"] / max(1, r["tokens"])
        r["over_bound"] = r["seconds_per_token"] / r["bound_seconds_per_token"]

    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "cpu": cpu_model(),
           "model": model, "layers": L, "experts": E, "top_k": k, "threads": a.threads, "disk": disk,
           "page_cache_dropped": drop_page_cache(), "runs": runs, "traces": traces}
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
