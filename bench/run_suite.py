#!/usr/bin/env python3
"""Colibri's benchmark suite: Colibri against a PyTorch MoE block and against
this machine's own limits, measured in one invocation.

For each shape it
  1. generates (or reuses) a Colibri model per weight dtype with `colibri gen`
     (cached under --work-dir; every dtype is a rounding of the same random
     floats, seed 1),
  2. writes one fixed routing per token count (uniformly random distinct
     experts per token, softmax-normalised weights) as .route text and
     compiles it with `colibri route compile`,
  3. runs `colibri bench --json --routing ...` for every dtype and every ISA
     level the machine supports; decode (T=1) also with a routing that
     changes every call (see CYCLED),
  4. checks Colibri's output (`colibri infer`, default ISA) against PyTorch's
     on the same input,
  5. runs the PyTorch baselines (bench/pytorch_moe.py; --torch-baselines,
     default all: the HF-style eager block, transformers 5's own
     grouped_mm and batched_mm experts implementations, torch.compile of the
     eager block) in float32 and bfloat16 on the same weights and routings,
     each new baseline's output checked against the eager block's,
and runs colibri_probe before the first shape, after each and at the end:
the host's bandwidth moves with other load, and a fraction of the limit means
something only against a limit measured the same hour. The machine is shared,
so every measurement waits for a quiet moment, records how much of the
machine other processes took meanwhile, and is taken again at the end of the
run if that was too much.

Reported per row: latency percentiles, tokens/s, speed-up over PyTorch's
eager block (torch p50 / colibri p50; a second table has Colibri against
every baseline), and distance from the machine's limit: decode
rows (T=1) against the probe's read bandwidth (huge pages), prefill rows
against the peak FLOP/s of the precision the kernel computes in.

Outputs in --out-dir: results.json (everything), results.md (the table),
speedup.png (speed-up over PyTorch per shape).

  bench/run_suite.py --build-dir build --out-dir bench/results
  bench/run_suite.py --smoke --build-dir build --out-dir /tmp/x   # < 1 minute check

Run it with the project's Python environment, .venv/bin/python (torch 2.13.0
CPU, numpy, matplotlib; scripts/setup.sh makes it).
"""

import argparse
import datetime
import gc
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import pytorch_moe  # noqa: E402  (after the path tweak)

# name -> experts, top-k, d_model, d_ff, token counts
SHAPES = {
    "seed": (16, 2, 1024, 4096, [1024]),
    "mixtral": (8, 2, 4096, 14336, [1, 128]),
    "qwen3-moe": (128, 8, 2048, 768, [1, 128]),
    "olmoe": (64, 8, 2048, 1024, [1, 128]),
}
SMOKE_SHAPES = {"smoke": (8, 2, 64, 128, [1, 16])}
# Shapes whose experts are gpt-oss's: expert biases and the clamped SwiGLU
# (colibri gen --activation clamped_swiglu --expert-bias; llamacpp_moe --gpt-oss).
GPT_OSS_SHAPES = {"gpt-oss-20b": (32, 4, 2880, 2880, [1, 96])}


def is_gpt_oss(name):
    return name in GPT_OSS_SHAPES

DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "float32": 4, "bfloat16": 2}

T0 = time.time()


def log(msg):
    print("[%6.1fs] %s" % (time.time() - T0, msg), file=sys.stderr, flush=True)


# ------------------------------------------------------------------ machine


def cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def supported_isas():
    """The kernel levels Colibri can run here, by the same CPUID rules as
    src/kernels/cpu_features.cpp (colibri bench's JSON confirms each)."""
    f = cpu_flags()
    isas = ["scalar"]
    if {"avx2", "fma", "f16c"} <= f:
        isas.append("avx2")
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= f:
            isas.append("avx512")
            # Linux's permission for the tile state is not in cpuinfo; a row
            # that ran without the tiles is reported as an error (the JSON's isa).
            if {"avx512_bf16", "amx_tile", "amx_bf16"} <= f:
                isas.append("amx")
    return isas


def mem_total_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def git_revision(root):
    try:
        rev = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain"], capture_output=True, text=True, timeout=30)
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ------------------------------------------------------------ subprocesses


def run_cmd(cmd, timeout, what, env=None):
    """Runs cmd; returns stdout. Raises RuntimeError with stderr on failure.
    env: variables added to this process's environment."""
    log("$ " + " ".join(["%s=%s" % kv for kv in (env or {}).items()] + [shlex.quote(c) for c in cmd]))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, **env) if env else None)
    except subprocess.TimeoutExpired:
        raise RuntimeError("%s: timed out after %d s" % (what, timeout))
    if p.returncode != 0:
        raise RuntimeError("%s: exit %d: %s" % (what, p.returncode, p.stderr.strip()[-2000:]))
    return p.stdout


class LoadMeter:
    """How busy the machine was with OTHER work over an interval.

    This 2-core machine is shared: other people's builds and tests run on the
    same CPUs without showing up in our process list, and a 2-thread decode
    run whose second worker is descheduled waits a whole host time slice.
    /proc/stat counts every process on the machine (and steal, time the host
    gave our vCPUs to someone else); subtracting our own CPU time (this
    process and the children it waited for) leaves the others' share.
    """

    def __init__(self):
        self.seen_quiet = True
        self.hz = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as f:
            self.ncpu = sum(1 for line in f if line.startswith("cpu") and line[3].isdigit())

    @staticmethod
    def _busy_ticks():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal ...; guest time is
        # already inside user.
        return sum(v[:8]) - v[3] - v[4]

    def snapshot(self):
        t = os.times()
        return (time.monotonic(), self._busy_ticks(), t.user + t.system + t.children_user + t.children_system)

    def other_load(self, a, b):
        wall = b[0] - a[0]
        if wall <= 0:
            return 0.0
        others = (b[1] - a[1]) / self.hz - (b[2] - a[2])
        return min(1.0, max(0.0, others / (wall * self.ncpu)))

    def wait_for_quiet(self, threshold, max_wait):
        """Waits (up to max_wait s) for a half-second in which others used
        less than threshold of the machine; returns the last reading."""
        deadline = time.monotonic() + max_wait
        while True:
            a = self.snapshot()
            time.sleep(0.5)
            load = self.other_load(a, self.snapshot())
            if load < threshold or time.monotonic() >= deadline:
                return load


def measured(meter, a, what, fn):
    """Runs fn() up to 1 + a.retries times, until one attempt ran while others
    used less than a.quiet_threshold of the machine; returns (result, load)
    of the least disturbed attempt. Measurements taken under load are kept
    (and flagged by their load) rather than dropped: the machine may never
    be quiet. Once a full wait has found no quiet moment, later waits are
    short and disturbed attempts are not repeated until the machine has been
    seen quiet again: under steady load, waiting and retrying only add hours."""
    best = None
    for attempt in range(1 + a.retries):
        # --smoke (max_wait 0) skips the half-second sample: it checks that
        # everything runs, not how fast.
        patience = a.max_wait if meter.seen_quiet else min(a.max_wait, 5.0)
        before = meter.wait_for_quiet(a.quiet_threshold, patience) if a.max_wait > 0 else 0.0
        meter.seen_quiet = before < a.quiet_threshold
        if not meter.seen_quiet:
            log("  machine busy (others %.0f%%) after %.0f s; measuring anyway" % (100 * before, patience))
        s0 = meter.snapshot()
        res = fn()
        load = meter.other_load(s0, meter.snapshot())
        if best is None or load < best[1]:
            best = (res, load)
        if load < a.quiet_threshold:
            break
        again = attempt < a.retries and meter.seen_quiet
        log("  %s: others used %.0f%% of the machine meanwhile%s" % (what, 100 * load, "; again" if again else ""))
        if not again:
            break
    return best


def run_probe(probe, threads, quick):
    cmd = [probe, "--threads", str(threads)] + (["--quick"] if quick else [])
    return json.loads(run_cmd(cmd, 600, "colibri_probe"))


def onednn_bf16_kernel(threads):
    """The oneDNN implementation PyTorch's bf16 linear runs here (e.g.
    "brg:avx512_core_amx_bf16"), from ONEDNN_VERBOSE in a child process: on
    CPUs with AMX, PyTorch bf16 is an AMX baseline and is compared with the
    AMX peak, not the vdpbf16ps one."""
    code = ("import torch; torch.set_num_threads(%d); "
            "torch.nn.functional.linear(torch.ones(64, 256).bfloat16(), torch.ones(128, 256).bfloat16())" % threads)
    env = dict(os.environ, ONEDNN_VERBOSE="1", DNNL_VERBOSE="1")
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    except (OSError, subprocess.SubprocessError):
        return ""
    # oneDNN 2 writes "onednn_verbose,exec,cpu,matmul,IMPL,...", oneDNN 3
    # (torch 2.x) "onednn_verbose,v1,primitive,exec,cpu,matmul,IMPL,...".
    for line in p.stdout.splitlines():
        f = line.split(",")
        for i in (1, 3):
            if len(f) > i + 3 and f[i] == "exec" and f[i + 2] in ("matmul", "inner_product"):
                return f[i + 3]
    return ""


# ------------------------------------------------------------ models, routes


def model_dir_for(work, name, E, D, F, dtype):
    return os.path.join(work, "%s-e%d-d%d-f%d-%s" % (name, E, D, F, dtype))


def ensure_model(colibri, work, name, E, D, F, dtype):
    """A cached model directory with the right manifest, generated if absent.
    Generation writes to a temporary directory renamed at the end, so an
    interrupted run never leaves a half-written model that looks cached."""
    d = model_dir_for(work, name, E, D, F, dtype)
    try:
        m = pytorch_moe.read_manifest(d)
        # q4_k_m is stored as dtype q4_k with down_dtype q6_k.
        stored = (m["dtype"], m.get("down_dtype", m["dtype"]))
        want = ("q4_k", "q6_k") if dtype == "q4_k_m" else (dtype, dtype)
        gpt_oss = m.get("activation") == "clamped_swiglu" and m.get("expert_bias", False)
        if (m["n_experts"], m["d_model"], m["d_ff"]) == (E, D, F) and stored == want and gpt_oss == is_gpt_oss(name):
            # Sizes and checksums: a truncated file would otherwise only show
            # up as a confusing failure later.
            run_cmd([colibri, "verify", "--model", d], 600, "colibri verify")
            log("reusing %s" % d)
            return d
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        log("(re)generating %s: %s" % (d, str(e).splitlines()[0] if str(e) else type(e).__name__))
    tmp = d + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(d, ignore_errors=True)
    t = time.time()
    run_cmd(
        [colibri, "gen", "--out", tmp, "--experts", str(E), "--d-model", str(D), "--d-ff", str(F),
         "--dtype", dtype, "--seed", "1"] + (["--activation", "clamped_swiglu", "--expert-bias"] if is_gpt_oss(name)
                                             else []),
        3600, "colibri gen",
    )
    os.rename(tmp, d)
    log("generated %s in %.1f s" % (d, time.time() - t))
    return d


def make_routing(T, k, E, seed):
    """Uniformly random distinct experts per token (a fresh uniform draw of k
    out of E) with softmax-normalised weights of random logits, as a trained
    router's renormalised top-k would give. float32 weights, printed with 9
    significant digits so the text round-trips exactly."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int64)
    logits = rng.normal(size=(T, k))
    w = np.exp(logits - logits.max(axis=1, keepdims=True))
    w = (w / w.sum(axis=1, keepdims=True)).astype(np.float32)
    return ids, w


def ensure_routing(colibri, work, name, T, k, E):
    """Writes name-T<T>.route (if absent) and compiles it; returns (route,
    bin, ids, weights) with ids and weights read back from the text, the
    exact values Colibri's compiler sees."""
    base = os.path.join(work, "%s-e%d-k%d-T%d" % (name, E, k, T))
    route, binf = base + ".route", base + ".bin"
    if not os.path.exists(route):
        # Seed from the shape, so the routing is the same on every machine.
        ids, w = make_routing(T, k, E, seed=1000003 * T + 7919 * E + k)
        lines = ["# %s: %d tokens, top-%d of %d experts, uniformly random, softmax weights" % (name, T, k, E)]
        for t in range(T):
            lines.append(", ".join([str(t)] + [str(int(e)) for e in ids[t]] + ["%.9g" % x for x in w[t]]))
        with open(route + ".tmp", "w") as f:
            f.write("\n".join(lines) + "\n")
        os.rename(route + ".tmp", route)
    if not os.path.exists(binf) or os.path.getmtime(binf) < os.path.getmtime(route):
        run_cmd([colibri, "route", "compile", route, "-o", binf, "--experts", str(E)], 120, "colibri route compile")
    ids, w = pytorch_moe.read_route(route)
    return route, binf, ids, w


# ------------------------------------------------------------------ metrics


def fmt(x, digits=2):
    if x is None:
        return ""
    if isinstance(x, str):
        return x
    if not math.isfinite(x):
        return "nan"
    if abs(x) >= 1000:
        return "%.0f" % x
    if abs(x) >= 100:
        return "%.1f" % x
    return ("%." + str(digits) + "f") % x


def limits_from(probes, threshold):
    """The figures rows are compared with: the best of this run's probes that
    ran on a quiet machine (all of them if none did). Best, because a probe
    disturbed by someone else's work would make every kernel look closer to
    the limit than it is."""
    quiet = [p for p in probes if p.get("other_load", 0.0) < threshold] or probes

    def best(key):
        vals = [p["summary"].get(key) for p in quiet if p["summary"].get(key) is not None]
        return max(vals) if vals else None

    return {
        "read_gbytes_per_s": best("read_gbytes_per_s_huge"),
        "read_gbytes_per_s_4k": best("read_gbytes_per_s_4k"),
        "triad_gbytes_per_s": best("triad_gbytes_per_s"),
        "fp32_gflop_per_s": best("fp32_gflop_per_s"),
        "bf16_gflop_per_s": best("bf16_gflop_per_s"),
        "amx_bf16_gflop_per_s": best("amx_bf16_gflop_per_s"),
        "llc_bytes": max((p.get("llc_bytes") or 0) for p in probes) if probes else 0,
        "probes_used": len(quiet),
    }


def add_limit_metrics(row, limits):
    p50 = row["p50_ms"] / 1e3
    row["gbytes_per_s"] = row["bytes_per_call"] / p50 / 1e9
    row["gflop_per_s"] = row["flop_per_call"] / p50 / 1e9
    bw = limits.get("read_gbytes_per_s")
    peak = limits.get({"bf16": "bf16_gflop_per_s", "amx_bf16": "amx_bf16_gflop_per_s",
                       "amx_split": "amx_bf16_gflop_per_s"}.get(row["compute"], "fp32_gflop_per_s"))
    # The split table (f16 weights at fp32-grade precision) spends five tile
    # products per multiply-add: its ceiling is a fifth of the tile peak.
    if peak and row["compute"] == "amx_split":
        peak /= 5.0
    row["fraction_of_bandwidth"] = row["gbytes_per_s"] / bw if bw else None
    row["fraction_of_peak"] = row["gflop_per_s"] / peak if peak else None
    # Decode is bound by reading weights, prefill by arithmetic: the limit
    # that matters for the row.
    if row["T"] == 1:
        row["limit"], f = "bandwidth", row["fraction_of_bandwidth"]
        text = "BW"
        # A fixed routing re-reads the same experts every call; when they fit
        # in the last-level cache the row measures cache, not DRAM, bandwidth.
        if row["routing"] == "fixed" and limits.get("llc_bytes") and row["bytes_per_call"] <= limits["llc_bytes"]:
            row["llc_resident"] = True
            text = "BW, fits LLC"
    else:
        row["limit"], f = row["compute"] + " peak", row["fraction_of_peak"]
        text = row["limit"]
    row["fraction_of_limit"] = f
    row["limit_text"] = "" if f is None else "%.0f%% %s" % (100 * f, text)
    # Prefill of many small experts reads more weight bytes than it has
    # arithmetic to hide them behind (qwen3-moe T=128 reads every expert for
    # ~8 tokens each), so the peak alone flatters nobody: the roofline time
    # is the larger of streaming the weights once and computing at peak.
    if bw and peak:
        roof_s = max(row["bytes_per_call"] / (bw * 1e9), row["flop_per_call"] / (peak * 1e9))
        row["roofline_ms"] = roof_s * 1e3
        row["fraction_of_roofline"] = roof_s / p50
        if row["T"] != 1:
            row["limit_text"] += ", roofline %.0f%%" % (100 * row["fraction_of_roofline"])


# ------------------------------------------------------------------ outputs


TABLE_COLUMNS = [
    ("shape", "shape"), ("T", "T"), ("routing", "routing"), ("engine", "engine"), ("weights", "weights"),
    ("isa", "isa"), ("kernel", "kernel"), ("p50 ms", "p50_ms"), ("p90 ms", "p90_ms"), ("p99 ms", "p99_ms"), ("tokens/s", "tokens_per_s"),
    ("x torch fp32", "speedup_vs_torch_fp32"), ("x torch bf16", "speedup_vs_torch_bf16"),
    ("GB/s", "gbytes_per_s"), ("GFLOP/s", "gflop_per_s"), ("% of limit", "limit_text"),
    ("others' load", "load_text"), ("check", "check_text"),
]


def torch_engine_name(baseline):
    """The rows' engine column: "torch" for the eager block (as before the
    other baselines existed), "torch <engine>" for the others."""
    return "torch" if baseline == "eager" else "torch " + baseline


def baselines_text(rows, baselines, skipped, best_isa):
    """Colibri (default ISA level) against each PyTorch baseline of the same
    precision: p50 and speed-up (baseline p50 / Colibri p50), one line per
    Colibri row; then what each baseline is and which rows it did not run."""
    if not any(r["engine"] != "colibri" for r in rows):
        return []
    heads = ["torch %s (%s)" % (b, "p50 ms, x") for b in baselines]
    out = ["Colibri (level %s) against each PyTorch baseline, same weights, routing and input: PyTorch p50 ms and "
           "speed-up (PyTorch p50 / Colibri p50) in brackets; f16 weights against PyTorch float32, bf16 against "
           "PyTorch bfloat16." % best_isa, "",
           "| shape | T | routing | weights | Colibri p50 ms | torch dtype | " + " | ".join(heads) + " |",
           "|---|---|---|---|---|---|" + "---|" * len(baselines)]
    for r in rows:
        if r["engine"] != "colibri" or r["isa"] != best_isa:
            continue
        tdt = "float32" if r["weights"] in ("f16", "f32") else "bfloat16"
        cells = []
        for b in baselines:
            t = [x for x in rows if x["engine"] != "colibri" and x.get("baseline") == b and x["weights"] == tdt and
                 (x["shape"], x["T"], x["routing"]) == (r["shape"], r["T"], r["routing"])]
            if t:
                cells.append("%.3g (%.2fx)" % (t[0]["p50_ms"], t[0]["p50_ms"] / r["p50_ms"]))
            else:
                sk = [x for x in skipped if (x["shape"], x["T"], x["routing"], x["dtype"]) ==
                      (r["shape"], r["T"], r["routing"], tdt) and x["engine"] == torch_engine_name(b)]
                cells.append("not run" if sk else "")
        out.append("| %s | %d | %s | %s | %.3g | %s | %s |" % (r["shape"], r["T"], r["routing"], r["weights"],
                                                            r["p50_ms"], tdt, " | ".join(cells)))
    out.append("")
    out += ["- torch %s: %s" % (b, pytorch_moe.ENGINE_TEXT[b]) for b in baselines]
    comp = [x for x in rows if x.get("baseline") == "compile" and "compile_s" in x]
    groups = []
    for x in comp:
        if (x["shape"], x["weights"]) not in groups:
            groups.append((x["shape"], x["weights"]))
    for shape, tdt in groups:
        g = [x for x in comp if (x["shape"], x["weights"]) == (shape, tdt)]
        d = g[-1].get("dynamo", {})  # dynamo's counters after the run's last row
        out.append("- torch compile, %s %s: first call (compiles for new shapes; not timed) %s; dynamo: %s graphs, "
                   "%s graph breaks (%s)" % (
                       shape, tdt, ", ".join("%s T=%d %.1f s" % (x["routing"], x["T"], x["compile_s"]) for x in g),
                       d.get("stats", {}).get("unique_graphs", "?"), d.get("graph_breaks", "?"),
                       "; ".join(r_.split("\n")[0] for r_ in d.get("graph_break_reasons", [])) or "none"))
    for x in skipped:
        out.append("- not run: %s %s %s T=%d %s: %s" % (x["engine"], x["shape"], x["routing"], x["T"], x["dtype"],
                                                        x["why"]))
    return out + [""]


def markdown_table(rows):
    out = ["| " + " | ".join(c for c, _ in TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for r in rows:
        cells = []
        for _, key in TABLE_COLUMNS:
            v = r.get(key)
            if key == "tokens_per_s" and v is not None:
                cells.append("%.0f" % v)
            elif key == "T":
                cells.append(str(v))
            elif key.startswith("speedup") and v is not None:
                cells.append("%.2f" % v)
            else:
                cells.append(fmt(v))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def limits_text(probes, limits):
    out = []
    for p in probes:
        s = p["summary"]
        out.append(
            "- probe (%s, others' load %.0f%%): read %s GB/s with huge pages (THP %s%% backed), %s GB/s with "
            "4 KiB pages, one thread %s GB/s; triad %s GB/s; fp32 FMA %s GFLOP/s; bf16 dot (vdpbf16ps) %s GFLOP/s; "
            "AMX bf16 %s GFLOP/s"
            % (p["label"], 100 * p.get("other_load", 0.0), fmt(s["read_gbytes_per_s_huge"]),
               fmt(100 * p["read_huge"]["thp_fraction"], 0), fmt(s["read_gbytes_per_s_4k"]),
               fmt(p.get("read_huge_1thread", {}).get("gbytes_per_s")), fmt(s["triad_gbytes_per_s"]),
               fmt(s["fp32_gflop_per_s"]), fmt(s["bf16_gflop_per_s"]), fmt(s.get("amx_bf16_gflop_per_s")))
        )
    out.append(
        "- limits used (best of the %d probes on a quiet machine, or of all if none was): read %s GB/s, "
        "fp32 %s GFLOP/s, bf16 %s GFLOP/s, AMX bf16 %s GFLOP/s; last-level cache %s MiB"
        % (limits["probes_used"], fmt(limits["read_gbytes_per_s"]), fmt(limits["fp32_gflop_per_s"]),
           fmt(limits["bf16_gflop_per_s"]), fmt(limits["amx_bf16_gflop_per_s"]),
           fmt(limits["llc_bytes"] / 2**20, 0) if limits["llc_bytes"] else "?")
    )
    return "\n".join(out)


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def group_of(r):
        return "%s\nT=%d%s" % (r["shape"], r["T"], "\ncycled" if r["routing"] == "cycled" else "")

    groups = []
    for r in rows:
        g = group_of(r)
        if g not in groups:
            groups.append(g)
    # One bar per Colibri configuration; scalar is left out (it exists to
    # check the fallback, and would flatten the scale).
    series = []
    for r in rows:
        if r["engine"] == "colibri" and r["isa"] != "scalar":
            s = (r["weights"], r["isa"])
            if s not in series:
                series.append(s)
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(groups) + 3), 8), sharex=True)
    width = 0.8 / max(1, len(series))
    for ax, key, label in (
        (axes[0], "speedup_vs_torch_fp32", "vs PyTorch fp32"),
        (axes[1], "speedup_vs_torch_bf16", "vs PyTorch bf16"),
    ):
        for i, (wt, isa) in enumerate(series):
            xs, ys = [], []
            for gi, g in enumerate(groups):
                for r in rows:
                    if (r["engine"], r["weights"], r["isa"]) == ("colibri", wt, isa) and \
                            group_of(r) == g and r.get(key):
                        xs.append(gi + (i - (len(series) - 1) / 2) * width)
                        ys.append(r[key])
            bars = ax.bar(xs, ys, width, label="Colibri %s %s" % (wt, isa))
            for b, y in zip(bars, ys):
                ax.annotate("%.1f" % y, (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_ylabel("speed-up " + label + "\n(torch p50 / colibri p50)")
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[1].set_xticks(range(len(groups)))
    axes[1].set_xticklabels(groups)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default="build", help="CMake build directory (with -DCOLIBRI_BUILD_BENCHMARKS=ON)")
    ap.add_argument("--work-dir", help="cache of generated models and routings (default BUILD/bench-work)")
    ap.add_argument("--out-dir", help="where results.{json,md} and speedup.png go (default BUILD/bench-results)")
    ap.add_argument("--shapes", help="comma-separated subset of: " + ", ".join(SHAPES))
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--iters", type=int, default=100, help="timed iterations of decode rows (T=1)")
    ap.add_argument("--prefill-iters", type=int, default=20, help="timed iterations of rows with T>1")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dtypes", default="f16,bf16", help="Colibri weight dtypes (f16, bf16, f32, q8_0, q4_0, q4_k, q5_k, q6_k, mxfp4, q4_k_m)")
    ap.add_argument("--isas", help="comma-separated ISA levels (default: every level this CPU supports)")
    ap.add_argument(
        "--scalar", choices=["decode", "all", "none"], default="decode",
        help="where the scalar kernels run. Default decode: T=1 rows with at most 5 iterations. Scalar exists "
             "to check the fallback, not to be fast; a prefill call of the seed shape (51 GFLOP) takes it "
             "tens of seconds, so prefill rows skip it unless 'all'.",
    )
    ap.add_argument("--torch-max-seconds", type=float, default=60.0,
                    help="cap on each PyTorch measurement (iterations are cut, to at least 3)")
    ap.add_argument("--quiet-threshold", type=float, default=0.2,
                    help="share of the machine other processes may use during a measurement before it is retried")
    ap.add_argument("--max-wait", type=float, default=60.0, help="seconds to wait for a quiet machine before each measurement")
    ap.add_argument("--retries", type=int, default=2, help="extra attempts of a measurement disturbed by other load")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch baselines")
    ap.add_argument("--torch-baselines", default="all",
                    help="comma-separated PyTorch engines to run, of: %s (default all; eager is the HF-style block "
                         "the check and the x torch columns use; see bench/pytorch_moe.py)"
                         % ", ".join(pytorch_moe.ENGINES))
    ap.add_argument("--batched-mm-max-gb", type=float, default=4.0,
                    help="rows where transformers' batched_mm would gather more than this many GB of expert "
                         "weights per call (T x top-k copies of an expert) are not run, and listed as skipped")
    ap.add_argument("--no-check", action="store_true", help="skip the output check against PyTorch")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, 3 iterations, quick probe: checks that everything runs (never a timed pass/fail)")
    a = ap.parse_args(argv)
    a.work_dir = a.work_dir or os.path.join(a.build_dir, "bench-work")
    a.out_dir = a.out_dir or os.path.join(a.build_dir, "bench-results")
    if a.smoke:
        a.shapes_table = SMOKE_SHAPES
        a.iters = a.prefill_iters = 3
        a.warmup = 1
        a.max_wait, a.retries = 0.0, 0
        if a.scalar == "decode":
            a.scalar = "all"
    else:
        a.shapes_table = SHAPES
    if a.shapes:
        # The smoke shape may also be named without --smoke: a quick run of
        # the full procedure (second pass, probes between shapes).
        known = dict(SHAPES, **SMOKE_SHAPES)
        names = [s.strip() for s in a.shapes.split(",") if s.strip()]
        unknown = [n for n in names if n not in known]
        if unknown:
            ap.error("unknown shape(s) %s; known: %s" % (", ".join(unknown), ", ".join(known)))
        a.shapes_table = {n: known[n] for n in names}
    if a.torch_baselines.strip() == "all":
        a.baselines = list(pytorch_moe.ENGINES)
    else:
        a.baselines = [e.strip() for e in a.torch_baselines.split(",") if e.strip()]
        bad = [e for e in a.baselines if e not in pytorch_moe.ENGINES]
        if bad or not a.baselines:
            ap.error("unknown --torch-baselines %s; known: %s" % (", ".join(bad) or "(none)",
                                                                 ", ".join(pytorch_moe.ENGINES)))
        a.baselines = [e for e in pytorch_moe.ENGINES if e in a.baselines]
    a.dtype_list = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    for d in a.dtype_list:
        if d not in ("f16", "bf16", "f32", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "mxfp4", "q4_k_m"):
            ap.error("unknown dtype %s" % d)
    if a.threads < 1:
        ap.error("--threads must be >= 1")
    return a


# --------------------------------------------------------------------- main

# Decode rows are run twice: with the shape's fixed routing (the same
# experts every call: exactly what PyTorch is checked against), and with
# routings that change every call. The second is what a real decode loop
# does, and the one that measures DRAM: a fixed top-8 of qwen3-moe or olmoe
# is 75-100 MB, small enough to stay in a large last-level cache.
CYCLED = 8


class Job:
    """One measurement that fills rows; kept so a measurement disturbed by
    other load can be taken again at the end of the run."""

    def __init__(self, what, fn, apply):
        self.what, self.fn, self.apply, self.load = what, fn, apply, None

    def run(self, meter, a):
        res, load = measured(meter, a, self.what, self.fn)
        if self.load is None or load < self.load:
            self.load = load
            self.apply(res, load)
            return True
        return False


def layer_bench(exe, model, routing, isa, against, threads, iters, warmup):
    """colibri_layer_bench: every call next to the probe loop `against`
    (read, fma or tiles) of the same moment. routing as for colibri_bench."""
    cmd = [exe, "--model", model, "--against", against, "--threads", str(threads),
           "--iters", str(iters), "--warmup", str(warmup)]
    if routing[0] == "fixed":
        cmd += ["--routing", routing[1]]
    else:
        cmd += ["--tokens", "1", "--top-k", str(routing[1])]
    return json.loads(run_cmd(cmd, 1800, "colibri_layer_bench", env={"COLIBRI_ISA": isa}))


def same_moment_plan(isas, T, dt):
    """(isa, against) pairs measured against the same moment's limit: decode
    against the read loop; prefill against the peak of what it computes in
    (f16 weights: fp32, so the FMA loop, also for the fp32-grade AMX split
    table; bf16 weights: the tile loop where AMX runs them). The loops are
    AVX-512 code, so nothing below that level."""
    if "avx512" not in isas:
        return []
    levels = [i for i in ("avx512", "amx") if i in isas]
    if T == 1:
        return [(levels[-1], "read")]
    if dt == "bf16":
        return [("amx", "tiles")] if "amx" in levels else []
    return [(i, "fma") for i in levels]


def colibri_bench(colibri, model, routing, isa, threads, iters, warmup, compare_threads=0):
    """routing: ("fixed", routing.bin) or ("cycled", (k, seed)) for colibri
    bench's own random routings, a new one each call. compare_threads: also
    run each iteration at that many threads, back to back (JSON "compare")."""
    cmd = [colibri, "bench", "--json", "--model", model, "--isa", isa, "--threads", str(threads),
           "--iters", str(iters), "--warmup", str(warmup), "--no-verify"]
    if compare_threads:
        cmd += ["--compare-threads", str(compare_threads)]
    if routing[0] == "fixed":
        cmd += ["--routing", routing[1]]
    else:
        k, seed = routing[1]
        cmd += ["--tokens", "1", "--top-k", str(k), "--seed", str(seed)]
    return json.loads(run_cmd(cmd, 1800, "colibri bench"))


LATENCY_KEYS = ("p50_ms", "p90_ms", "p99_ms", "min_ms", "mean_ms", "max_ms", "tokens_per_s")


def kernel_for_call(kernels, T, k, E):
    """The kernel table most of a call's experts run, from colibri bench's
    "kernels" description ("decode X, prefill Y from N tokens/expert, Z from
    M tokens/expert"): the highest prefill table whose N the average expert
    reaches, else the decode table."""
    m = re.match(r"decode ([\w-]+)", kernels or "")
    if not m:
        return ""
    chosen = m.group(1)
    per_expert = T * k / float(E)
    for name, n in re.findall(r"([\w-]+) from (\d+) tokens/expert", kernels):
        if per_expert >= int(n):
            chosen = name
    return chosen.lower()


def same_moment_text(entries):
    if not entries:
        return []
    out = ["Against the limit of the same moment (colibri_layer_bench: each call, then the probe's loop on as many "
           "threads for about as long, order alternating; median of the per-call fractions, p25-p75 in brackets): "
           "decode (T=1) as bytes of the active experts' weights per second / the read loop's rate, prefill as "
           "FLOP per second / the FMA loop's (fma) or tile loop's (tiles) rate.", "",
           "| shape | T | routing | weights | isa | kernel | against | p50 ms | fraction of the same moment | "
           "limit (median) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        out.append("| %s | %d | %s | %s | %s | %s | %s | %.3g | %.2f (%.2f-%.2f) | %.0f %s |" % (
            e["shape"], e["T"], e["routing"], e["weights"], e["isa"], e["kernel"], e["against"], e["p50_ms"],
            e["fraction_median"], e["fraction_p25"], e["fraction_p75"], e["limit_median"], e["limit_unit"]))
    return out + [""]


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    colibri = os.path.join(a.build_dir, "tools", "colibri")
    probe = os.path.join(a.build_dir, "bench", "colibri_probe")
    layer_exe = os.path.join(a.build_dir, "bench", "colibri_layer_bench")
    for exe in (colibri, probe):
        if not os.access(exe, os.X_OK):
            sys.exit("run_suite: %s not found; build with\n  cmake -S . -B %s -DCOLIBRI_BUILD_BENCHMARKS=ON && "
                     "cmake --build %s" % (exe, a.build_dir, a.build_dir))
    os.makedirs(a.work_dir, exist_ok=True)
    os.makedirs(a.out_dir, exist_ok=True)
    isas = supported_isas()
    if a.isas:
        want = [s.strip() for s in a.isas.split(",")]
        isas = [i for i in isas if i in want]
    best_isa = isas[-1]

    torch_mod = None if a.no_torch else pytorch_moe.import_torch(a.threads)
    machine = {
        "cpu": cpu_model(),
        "cpus_online": len(os.sched_getaffinity(0)),
        "memory_bytes": mem_total_bytes(),
        "kernel": platform.release(),
        "isas": isas,
        "cpu_flags_of_interest": sorted(cpu_flags() & {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                                                       "avx512dq", "avx512_bf16", "avx512_vnni", "amx_bf16",
                                                       "amx_tile", "avx512_fp16"}),
        "load_average_start": os.getloadavg(),
    }
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(c) for c in [sys.argv[0]] + (sys.argv[1:] if argv is None else argv)),
        "git": git_revision(os.path.dirname(HERE)),
        "threads": a.threads,
        "smoke": a.smoke,
        "machine": machine,
        "settings": {"iters_decode": a.iters, "iters_prefill": a.prefill_iters, "warmup": a.warmup,
                     "dtypes": a.dtype_list, "scalar": a.scalar, "torch_max_seconds": a.torch_max_seconds,
                     "quiet_threshold": a.quiet_threshold, "max_wait": a.max_wait, "retries": a.retries,
                     "cycled_routings": CYCLED, "torch_baselines": a.baselines,
                     "batched_mm_max_gb": a.batched_mm_max_gb},
        "torch": pytorch_moe.torch_info() if torch_mod else None,
        "probes": [],
        "shapes": {},
        "rows": [],
        "scaling": [],
        "same_moment": [],
        "skipped": [],
        "errors": [],
    }
    meter = LoadMeter()
    bf16_kernel = onednn_bf16_kernel(a.threads) if torch_mod else ""
    doc["torch_bf16_kernel"] = bf16_kernel
    torch_bf16_compute = "amx_bf16" if "amx" in bf16_kernel else "bf16"
    rows, jobs = doc["rows"], []

    def run_job(job, **where):
        try:
            job.run(meter, a)
            return True
        except (RuntimeError, ValueError, MemoryError) as e:
            doc["errors"].append(dict(where, error=str(e)))
            log("ERROR %s: %s" % (job.what, e))
            return False

    def probe_job(label):
        def apply(res, load):
            res["label"], res["other_load"] = label, load
            doc["probes"].append(res)
        run_job(Job("probe (%s)" % label, lambda: run_probe(probe, a.threads, a.smoke), apply), stage="probe " + label)

    log("probe (start) ...")
    probe_job("start")

    for name, (E, k, D, F, Ts) in a.shapes_table.items():
        log("=== %s: E=%d k=%d d_model=%d d_ff=%d T=%s" % (name, E, k, D, F, Ts))
        doc["shapes"][name] = {"experts": E, "top_k": k, "d_model": D, "d_ff": F, "tokens": Ts}
        try:
            models = {dt: ensure_model(colibri, a.work_dir, name, E, D, F, dt) for dt in a.dtype_list}
        except RuntimeError as e:
            doc["errors"].append({"shape": name, "stage": "gen", "error": str(e)})
            log("ERROR %s" % e)
            continue
        base = {"shape": name, "E": E, "k": k, "D": D, "F": F}
        routes = {}
        for T in Ts:
            route, binf, ids, w = ensure_routing(colibri, a.work_dir, name, T, k, E)
            x = np.random.default_rng(T + 17).uniform(-1, 1, size=(T, D)).astype(np.float32)
            routes[T] = {"bin": binf, "ids": ids, "weights": w, "distinct": len(np.unique(ids)), "x": x}
        cycled = [make_routing(1, k, E, seed=424242 + i) for i in range(CYCLED)] if 1 in Ts else []
        cycles = [("fixed", T) for T in Ts] + ([("cycled", 1)] if cycled else [])

        # Colibri first, while no PyTorch weights are in memory.
        for kind, T in cycles:
            iters = a.iters if T == 1 else a.prefill_iters
            for dt in a.dtype_list:
                for isa in isas:
                    n, wu = iters, a.warmup
                    if isa == "scalar":
                        if a.scalar == "none" or (a.scalar == "decode" and T != 1) or kind == "cycled":
                            continue
                        if not a.smoke:
                            n, wu = min(iters, 5), 1
                    row = dict(base, T=T, routing=kind, engine="colibri", weights=dt, isa=isa, iters=n)
                    # T=1: k distinct experts whatever the routing.
                    distinct = routes[T]["distinct"] if kind == "fixed" else k
                    row["bytes_per_call"] = distinct * 3 * D * F * DTYPE_BYTES[dt]
                    row["flop_per_call"] = 6.0 * D * F * T * k
                    spec = ("fixed", routes[T]["bin"]) if kind == "fixed" else ("cycled", (k, 4242))

                    def apply(j, load, row=row, isa=isa):
                        if j.get("isa") != isa:
                            doc["errors"].append({"row": [row["shape"], row["T"], row["weights"], isa],
                                                  "error": "colibri ran %s kernels" % j.get("isa")})
                        row.update({key: j[key] for key in LATENCY_KEYS})
                        row["other_load"], row["raw"] = load, j
                        row["kernel"] = kernel_for_call(j.get("kernels", ""), row["T"], row["k"], row["E"])
                        c = str(j.get("compute", "")).lower() or row["kernel"]
                        row["compute"] = ("amx_split" if "split" in c else "amx_bf16" if "amx" in c
                                          else "bf16" if "bf16" in c else "fp32")
                        log("  colibri %s %s %s T=%d: p50 %.3f ms (others %.0f%%)"
                            % (row["weights"], isa, row["routing"], row["T"], row["p50_ms"], 100 * load))

                    job = Job("colibri %s %s %s T=%d" % (dt, isa, kind, T),
                              lambda m=models[dt], s=spec, i=isa, n=n, wu=wu:
                              colibri_bench(colibri, m, s, i, a.threads, n, wu), apply)
                    if run_job(job, shape=name, T=T, dtype=dt, isa=isa, routing=kind):
                        rows.append(row)
                        jobs.append(job)

        # Thread scaling (the fast-path issue's target: 2 threads >= 1.8x one
        # thread on the seed shape): the same model, routing and ISA, each
        # iteration at N threads and at one thread back to back (colibri
        # bench --compare-threads), for every weight type. Rows minutes apart
        # compare two states of this host, not two thread counts.
        if a.threads > 1 and name in ("seed", "smoke"):
            T, isa = max(Ts), isas[-1]
            for dt in a.dtype_list:
                def apply_one(j, load, T=T, dt=dt, isa=isa):
                    entry = {"shape": name, "T": T, "weights": dt, "isa": isa, "threads": a.threads,
                             "p50_ms_1_thread": j["compare"]["p50_ms"], "p50_ms_n_threads": j["p50_ms"],
                             "speedup": j["compare"]["pair_speedup_median"], "other_load": load}
                    doc["scaling"][:] = [e for e in doc["scaling"] if (e["shape"], e["weights"]) != (name, dt)] + [entry]
                    log("  colibri %s %s T=%d, %d threads against 1, call by call: %.2fx (p50 %.3f / %.3f ms)"
                        % (dt, isa, T, a.threads, entry["speedup"], entry["p50_ms_1_thread"], j["p50_ms"]))

                job = Job("colibri %s %s fixed T=%d, %d threads against 1" % (dt, isa, T, a.threads),
                          lambda m=models[dt], b=routes[T]["bin"], i=isa:
                          colibri_bench(colibri, m, ("fixed", b), i, a.threads, a.prefill_iters, a.warmup, 1),
                          apply_one)
                run_job(job, shape=name, T=T, dtype=dt, isa=isa, routing="fixed, threads compared")

        # Each call against the limit of the same moment (colibri_layer_bench):
        # this host's bandwidth and FMA/tile rates swing by 2-5x within
        # seconds, so the fractions above, against probes taken minutes
        # apart, mix two states of the machine.
        if os.access(layer_exe, os.X_OK):
            for kind, T in cycles:
                for dt in a.dtype_list:
                    for isa, against in same_moment_plan(isas, T, dt):
                        n = a.iters if T == 1 else a.prefill_iters

                        def apply_pair(j, load, kind=kind, T=T, dt=dt, isa=isa, against=against):
                            unit = "gbytes" if against == "read" else "gflop"
                            entry = {"shape": name, "T": T, "routing": kind, "weights": dt, "isa": isa,
                                     "against": against, "p50_ms": j["p50_ms"], "kernels": j["kernels"],
                                     "kernel": kernel_for_call(j["kernels"], T, k, E),
                                     "fraction_median": j["fraction_median"], "fraction_p25": j["fraction_p25"],
                                     "fraction_p75": j["fraction_p75"],
                                     "limit_median": j["limit_%s_per_s_median" % unit], "limit_unit": unit + "/s",
                                     "other_load": load}
                            key = (name, T, kind, dt, isa, against)
                            doc["same_moment"][:] = [e for e in doc["same_moment"] if (
                                e["shape"], e["T"], e["routing"], e["weights"], e["isa"], e["against"]) != key] + [entry]
                            log("  colibri %s %s %s T=%d against %s of the same moment: %.2f (%.2f-%.2f)"
                                % (dt, isa, kind, T, against, entry["fraction_median"], entry["fraction_p25"],
                                   entry["fraction_p75"]))

                        spec = ("fixed", routes[T]["bin"]) if kind == "fixed" else ("cycled", k)
                        job = Job("colibri %s %s %s T=%d against %s" % (dt, isa, kind, T, against),
                                  lambda m=models[dt], s=spec, i=isa, ag=against, n=n:
                                  layer_bench(layer_exe, m, s, i, ag, a.threads, n, a.warmup), apply_pair)
                        run_job(job, shape=name, T=T, dtype=dt, isa=isa, routing=kind + ", same moment")

        # Output check: colibri infer (default ISA) on an input PyTorch also gets.
        colibri_out = {}
        if not a.no_check:
            for T in Ts:
                xpath = os.path.join(a.work_dir, "%s-T%d-input.f32" % (name, T))
                routes[T]["x"].tofile(xpath)
                for dt in a.dtype_list:
                    ypath = os.path.join(a.work_dir, "%s-T%d-%s-output.f32" % (name, T, dt))
                    try:
                        run_cmd([colibri, "infer", "--model", models[dt], "--routing", routes[T]["bin"],
                                 "--input", xpath, "--output", ypath, "--threads", str(a.threads)], 600, "colibri infer")
                        colibri_out[(T, dt)] = np.fromfile(ypath, dtype=np.float32).reshape(T, D)
                        os.remove(ypath)
                    except RuntimeError as e:
                        doc["errors"].append({"shape": name, "T": T, "dtype": dt, "stage": "infer", "error": str(e)})
                        log("ERROR %s" % e)
                os.remove(xpath)

        # PyTorch: fp32 on the f16 weights (exactly representable, so the
        # same numbers Colibri's f16 rows multiply), bf16 on the bf16 ones.
        # Every baseline engine (--torch-baselines) on the same weights,
        # loaded once per dtype, each engine its own measurement.
        torch_out = {}
        if torch_mod:
            for tdt in ("float32", "bfloat16"):
                if tdt == "bfloat16":
                    src = "bf16" if "bf16" in models else a.dtype_list[0]
                else:
                    src = "f16" if "f16" in models else ("f32" if "f32" in models else a.dtype_list[0])
                for engine in a.baselines:
                    reqs, trows = [], {}
                    for kind, T in cycles:
                        req = {"label": (kind, T), "iters": a.iters if T == 1 else a.prefill_iters}
                        if kind == "fixed":
                            req.update(ids=routes[T]["ids"], weights=routes[T]["weights"],
                                       x=None if a.no_check else routes[T]["x"])
                            distinct = routes[T]["distinct"]
                        else:
                            req.update(ids=[c[0] for c in cycled], weights=[c[1] for c in cycled])
                            distinct = k
                        reqs.append(req)
                        trows[(kind, T)] = dict(
                            base, T=T, routing=kind, engine=torch_engine_name(engine), baseline=engine,
                            weights=tdt, isa="", source_weights=src,
                            bytes_per_call=distinct * 3 * D * F * DTYPE_BYTES[tdt], flop_per_call=6.0 * D * F * T * k,
                            compute="fp32" if tdt == "float32" else torch_bf16_compute,
                            kernel="" if tdt == "float32" else bf16_kernel)

                    def apply(res, load, trows=trows, tdt=tdt, engine=engine, outs=torch_out):
                        for label, row in trows.items():
                            t = res[label]
                            if "skipped" in t:
                                row["skipped"] = t["skipped"]
                                continue
                            out = t.pop("output", None)
                            if out is not None:
                                outs[(label[1], tdt, engine)] = out
                            row.update({key: t[key] for key in LATENCY_KEYS})
                            row.update(iters=t["iters"], load_s=t["load_s"], other_load=load)
                            for key in ("compile_s", "dynamo", "experts_implementation"):
                                if key in t:
                                    row[key] = t[key]
                            log("  torch %s %s %s T=%d: p50 %.3f ms (%d iters, others %.0f%%)%s"
                                % (engine, tdt, label[0], label[1], row["p50_ms"], row["iters"], 100 * load,
                                   ", first call (compiles) %.1f s" % t["compile_s"] if "compile_s" in t else ""))

                    # Defaults bind this shape's values: the job may run again
                    # at the end, when the loop variables name the last shape.
                    def fn(model_dir=models[src], reqs=reqs, tdt=tdt, engine=engine, first=[True]):
                        # The outputs for the check are computed on the first run
                        # only; a re-run for a quieter measurement needs none.
                        rq = reqs if first[0] else [dict(r, x=None) for r in reqs]
                        first[0] = False
                        return pytorch_moe.run(model_dir, rq, tdt, a.threads, iters=a.iters, warmup=min(a.warmup, 2),
                                               max_seconds=a.torch_max_seconds, engine=engine, keep_loaded=True,
                                               max_gather_bytes=a.batched_mm_max_gb * 1e9)

                    log("  torch %s %s on %s weights ..." % (engine, tdt, src))
                    job = Job("torch %s %s %s" % (engine, name, tdt), fn, apply)
                    try:
                        job.run(meter, a)
                    except Exception as e:  # noqa: BLE001  (a torch failure must not lose the other results)
                        err = "%s: %s" % (type(e).__name__, str(e).strip().splitlines()[0][:500] if str(e).strip() else "")
                        doc["errors"].append({"shape": name, "engine": "torch " + engine, "dtype": tdt, "error": err})
                        log("ERROR torch %s %s: %s" % (engine, tdt, err))
                        continue
                    for row in trows.values():
                        if "skipped" in row:
                            doc["skipped"].append({"shape": name, "T": row["T"], "routing": row["routing"],
                                                   "engine": row["engine"], "dtype": tdt, "why": row["skipped"]})
                            log("  torch %s %s %s T=%d: not run: %s" % (engine, tdt, row["routing"], row["T"],
                                                                         row["skipped"]))
                        else:
                            rows.append(row)
                    jobs.append(job)
                pytorch_moe.release()
                gc.collect()

        # Each further baseline against the eager block on the same input
        # (its outputs, like the eager block's, from the fixed routings).
        for row in rows:
            if row["shape"] != name or row["engine"] == "colibri" or row.get("baseline", "eager") == "eager" or \
                    row["routing"] != "fixed":
                continue
            ref = torch_out.get((row["T"], row["weights"], "eager"))
            got = torch_out.get((row["T"], row["weights"], row["baseline"]))
            if ref is None or got is None:
                continue
            err = float(np.max(np.abs(got - ref))) / (float(np.max(np.abs(ref))) or 1.0)
            row["check_max_rel_err"], row["check_against"] = err, "torch eager " + row["weights"]
            # Same weights, different summation orders (fp32); in bf16 each
            # engine rounds at other points (index_add_ in bf16 against a sum
            # over top-k; inductor fuses silu * up without rounding between).
            tol = 1e-4 if row["weights"] == "float32" else 5e-2
            row["check_text"] = ("ok " if err <= tol else "MISMATCH ") + "%.1e vs eager" % err
            if err > tol:
                doc["errors"].append({"shape": name, "T": row["T"], "engine": row["engine"], "dtype": row["weights"],
                                      "error": "output differs from torch eager: max rel err %.3g" % err})

        # Output check against PyTorch on the same input.
        for row in rows:
            if row["shape"] != name or row["engine"] != "colibri" or row["routing"] != "fixed" or row["isa"] != best_isa:
                continue
            T = row["T"]
            ref_dt = "float32" if row["weights"] in ("f16", "f32") else "bfloat16"
            ref, got = torch_out.get((T, ref_dt, "eager")), colibri_out.get((T, row["weights"]))
            if ref is None or got is None:
                continue
            err = float(np.max(np.abs(got - ref))) / (float(np.max(np.abs(ref))) or 1.0)
            row["check_max_rel_err"], row["check_against"] = err, "torch " + ref_dt
            # f16 weights in torch fp32 are the same numbers: only the
            # summation order differs. torch bf16 also rounds every
            # activation to bf16, so ~1e-2 is what agreement looks like.
            tol = 1e-4 if row["weights"] in ("f16", "f32") else 5e-2
            row["check_text"] = ("ok " if err <= tol else "MISMATCH ") + "%.1e" % err
            if err > tol:
                doc["errors"].append({"shape": name, "T": T, "dtype": row["weights"],
                                      "error": "output differs from torch %s: max rel err %.3g" % (ref_dt, err)})
        del routes, colibri_out, torch_out
        gc.collect()
        if not a.smoke:
            probe_job("after " + name)

    if not a.smoke:
        # Second chance for measurements that other work disturbed: the
        # machine is often quieter later, and a quieter attempt replaces it.
        late = [j for j in jobs if j.load is not None and j.load >= a.quiet_threshold]
        if late:
            log("=== measuring again %d rows disturbed by other load" % len(late))
            for job in late:
                try:
                    job.run(meter, a)
                except Exception as e:  # noqa: BLE001  (the first measurement stands)
                    log("ERROR again %s: %r" % (job.what, e))
            pytorch_moe.release()
        log("probe (end) ...")
        probe_job("end")

    limits = limits_from(doc["probes"], a.quiet_threshold) if doc["probes"] else {}
    doc["limits"] = limits
    rows = [r for r in rows if "p50_ms" in r]
    for row in rows:
        add_limit_metrics(row, limits)
        row["load_text"] = "%.0f%%" % (100 * row["other_load"])
        if row["engine"] == "colibri":
            for tdt, key in (("float32", "speedup_vs_torch_fp32"), ("bfloat16", "speedup_vs_torch_bf16")):
                tr = [t for t in rows if t["engine"] == "torch" and t["weights"] == tdt and
                      (t["shape"], t["T"], t["routing"]) == (row["shape"], row["T"], row["routing"])]
                row[key] = tr[0]["p50_ms"] / row["p50_ms"] if tr else None
            # Against every baseline of the matching precision (f16/f32
            # weights: PyTorch fp32 on the same values; bf16: PyTorch bf16).
            tdt = "float32" if row["weights"] in ("f16", "f32") else "bfloat16"
            row["speedup_vs_baselines"] = {
                t["baseline"]: t["p50_ms"] / row["p50_ms"] for t in rows
                if t["engine"] != "colibri" and t["weights"] == tdt and
                (t["shape"], t["T"], t["routing"]) == (row["shape"], row["T"], row["routing"])}
    shape_order = list(a.shapes_table)
    dtype_order = ["f16", "bf16", "f32", "float32", "bfloat16"]
    isa_order = ["scalar", "avx2", "avx512", "amx", ""]
    rows.sort(key=lambda r: (shape_order.index(r["shape"]), r["T"], r["routing"] != "fixed", r["engine"] != "colibri",
                             dtype_order.index(r["weights"]), isa_order.index(r["isa"]) if r["isa"] in isa_order else 9,
                             pytorch_moe.ENGINES.index(r.get("baseline", "eager"))))
    doc["rows"] = rows
    machine["load_average_end"] = os.getloadavg()
    doc["elapsed_s"] = round(time.time() - T0, 1)

    title = "Colibri vs PyTorch: %s, %d threads, %s%s" % (
        machine["cpu"], a.threads, doc["date"][:10], " (SMOKE: not a measurement)" if a.smoke else "")
    md = "\n".join([
        "# " + title, "",
        "Command: `%s` (git %s, %.0f min)" % (doc["command"], doc["git"], doc["elapsed_s"] / 60), "",
        limits_text(doc["probes"], limits) if limits else "- no probe", "",
        "Speed-up = PyTorch p50 / Colibri p50, same weights and routing. "
        "routing: fixed = one routing, the same every call (PyTorch computes the same thing; check column); "
        "cycled = a different random top-k every call, %d in turn, as in a real decode loop (the same amount "
        "of work for both engines, not the same experts). "
        "%% of limit: decode (T=1) rows as bytes of the distinct experts' weights / p50 / probe read bandwidth "
        "(huge pages; 'fits LLC' = those bytes fit in the last-level cache, so the row reads cache, not DRAM); "
        "other rows as FLOP / p50 / peak of the precision computed in (fp32 FMA for Colibri unless its JSON "
        "says otherwise; amx_split, Colibri's fp32-grade AMX table for f16 weights, against a fifth of the tile "
        "peak, as it spends five tile products per multiply-add; PyTorch bf16 runs oneDNN %s), and as roofline "
        "time / p50, the roofline time being the "
        "larger of reading the weights once at the probe's bandwidth and computing at that peak. "
        "others' load: share of the machine other processes used while the row was measured (rows above "
        "%.0f%% were measured again, the least disturbed attempt kept). "
        "check: max |colibri - torch| / max |torch| on one input (default ISA)."
        % (CYCLED, bf16_kernel or "?", 100 * a.quiet_threshold), "",
        markdown_table(rows), "",
    ] + baselines_text(rows, a.baselines, doc["skipped"], best_isa) + ["Thread scaling (calls at both counts back to back, median per-iteration ratio): %s %s weights, %s, T=%d: "
         "1 thread p50 %.1f ms, %d threads %.1f ms: %.2fx"
         % (e["shape"], e["weights"], e["isa"], e["T"], e["p50_ms_1_thread"], e["threads"], e["p50_ms_n_threads"],
            e["speedup"]) for e in doc["scaling"]] + [""] + same_moment_text(doc["same_moment"]) + (["Errors:", ""] + ["- " + json.dumps(e) for e in doc["errors"]] + [""] if doc["errors"] else []))
    with open(os.path.join(a.out_dir, "results.md"), "w") as f:
        f.write(md)
    try:
        plot(rows, os.path.join(a.out_dir, "speedup.png"), title)
    except Exception as e:  # noqa: BLE001  (no chart is no reason to lose the numbers)
        doc["errors"].append({"stage": "plot", "error": repr(e)})
        log("ERROR plot: %r" % e)
    with open(os.path.join(a.out_dir, "results.json"), "w") as f:
        json.dump(doc, f, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
    print(md)
    log("wrote %s/results.{json,md} and speedup.png in %.0f s" % (a.out_dir, time.time() - T0))
    return 1 if any("MISMATCH" in r.get("check_text", "") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
