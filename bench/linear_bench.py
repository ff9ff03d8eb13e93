#!/usr/bin/env python3
"""One dense linear layer y = x W^T on three engines, interleaved in one run:
Colibri (colibri.nn.Linear on the stored rows, default precision), llama.cpp
(ggml_mul_mat on ggml's CPU backend, the weight in the buffer type llama.cpp's
loader picks: bench/llamacpp_linear.cpp) and PyTorch (F.linear on the weights
dequantised to bf16 and to f32), 2 threads each, at T=1 and T=128 tokens.

Build and run (from the repository root):

  cmake --build build -j2                       # build/libcolibri.so
  bench/llamacpp_peer.sh                        # ggml (without AMX, see there) and
                                                # build/llamacpp-peer/llamacpp_linear
  COLIBRI_LIBRARY=build/libcolibri.so PYTHONPATH=python \\
      .venv/bin/python bench/linear_bench.py --json /tmp/linear.json
  # a subset / a quick look:
  ... bench/linear_bench.py --types q4_K,bf16 --shapes 4096x2048 --tokens 1 --reps 3

Weights: normal * 0.02 per (type, shape), quantised with colibri.quantize;
the same bytes are handed to ggml (GGUF's block layouts), and the
dequantisation (colibri.dequantize, bit for bit gguf's) feeds PyTorch, so all
engines compute the same matrix. Inputs: standard normal, float32 (bf16 for
the torch bf16 run). Agreement: relative L2 of each output against a float64
x @ W^T of the dequantised weights; the harness also reports its own
--check against ggml's dequantisation.

Timing: for each (type, shape, T) the engines take one untimed turn each,
then take turns, in rotated order, for --reps repetitions; one turn is a burst of calls (2 warm-up calls, then
at least 5 calls and --burst-s seconds), each call timed alone; a turn gives
its median, and the table gives the median of the turns. The machine is
shared, so compare the ratios (taken within one run). Threads: Colibri's
layer has threads=2; ggml runs with 2 threads (OpenMP); torch runs with
torch.set_num_threads(2) during its own turns only and 1 otherwise (its
OpenMP workers would spin on the cores the others need), and every turn
starts after a short sleep so the previous engine's spinning workers park.
Other jobs on the machine: before each (type, shape, T) the driver waits
(up to --max-wait s) for a quiet half-second, measures the others' share of
the CPUs over the case (bench/run_suite.py's meter, from /proc/stat), and
repeats a case measured while others used more than --quiet of the machine
(up to --retries times), keeping the least disturbed; the "others" column
gives that share.

Columns: "Colibri" is a forward of colibri.nn.Linear from Python (what a
model pays); "C" is the bare colibri_linear_forward through ctypes with
prepared buffers, the same output buffer every call (the C time plus about
half a microsecond). Their gap is more than the interpreter: a bare call
into a fresh torch.empty output each time, as the module makes, measured
about half of it on 4096x4096 q8_0. llama.cpp is ggml_backend_graph_compute
of the one-node graph, timed in C; torch is F.linear from Python. GB/s:
stored weight bytes / Colibri's T=1 time.

The peer ggml is built as llama.cpp builds it (GGML_NATIVE, CPU_REPACK,
llamafile's sgemm on) but without AMX (bench/llamacpp_peer.sh, GGML_AMX):
ggml's AMX buffer type would take q4_0/q8_0/q4_K/q6_K and its tile kernels
crash on the T=128 cases on the dev machine.
"""

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, HERE)
import colibri  # noqa: E402
from llamacpp_peer import ChildMeter  # noqa: E402  (others' share of the machine, /proc/stat)
import colibri.nn as cnn  # noqa: E402
from colibri.quant import dequantize, quantize  # noqa: E402

# ggml's type name -> Colibri's dtype name
TYPES = {"q8_0": "q8_0", "q4_0": "q4_0", "q4_K": "q4_k", "q6_K": "q6_k", "mxfp4": "mxfp4", "bf16": "bf16"}
# (out, in): name
SHAPES = {
    (4096, 2048): "Qwen3-30B-A3B q_proj",
    (512, 2048): "Qwen3-30B-A3B k/v_proj",
    (2048, 4096): "Qwen3-30B-A3B o_proj",
    (4096, 4096): "Mixtral q/o_proj",
    (2000, 2048): "small LM head",
}
ENGINES = ["colibri", "colibri_c", "llamacpp", "torch_bf16", "torch_f32"]
T0 = time.time()


def log(msg):
    print("[%6.1fs] %s" % (time.time() - T0, msg), file=sys.stderr, flush=True)


def cpu_name():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def rel_l2(y, ref):
    y = np.asarray(y, dtype=np.float64)
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-300))


def burst(call, min_s, min_calls=5, warmup=2, max_calls=20000):
    """Median µs of individually timed calls: warmup, then >= min_calls and >= min_s."""
    for _ in range(warmup):
        call()
    ts = []
    clock = time.perf_counter_ns
    start = clock()
    while True:
        t0 = clock()
        call()
        ts.append(clock() - t0)
        if len(ts) >= max_calls or (len(ts) >= min_calls and clock() - start >= min_s * 1e9):
            break
    return statistics.median(ts) / 1e3


class Harness:
    """bench/llamacpp_linear.cpp in --serve mode for one weight."""

    def __init__(self, exe, gtype, n_out, n_in, weights_path, threads):
        cmd = [exe, "--serve", "--type", gtype, "--out", str(n_out), "--in", str(n_in),
               "--weights", weights_path, "--threads", str(threads)]
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.ready = self._read(" ".join(shlex.quote(c) for c in cmd))

    def _read(self, what):
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError("llamacpp_linear exited (rc %s) on: %s" % (self.p.wait(), what))
        return json.loads(line)

    def case(self, opts):
        self.p.stdin.write(opts + "\n")
        self.p.stdin.flush()
        return self._read(opts)

    def close(self):
        try:
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
            self.p.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()
            self.p.wait()


def run_config(a, meter, gtype, n_out, n_in, tmp, seed):
    cdtype = TYPES[gtype]
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n_out, n_in), dtype=np.float32) * 0.02).astype(np.float32)
    rows = quantize(w, cdtype)
    wdq = dequantize(rows, cdtype, n_in)
    del w
    stored = int(rows.nbytes)
    wpath = os.path.join(tmp, "w.bin")
    rows.tofile(wpath)

    lin = cnn.Linear(torch.from_numpy(rows), cdtype, n_out, n_in, threads=a.threads)
    w_f32 = torch.from_numpy(wdq)
    w_bf16 = w_f32.to(torch.bfloat16)
    h = None
    if a.harness:
        h = Harness(a.harness, gtype, n_out, n_in, wpath, a.threads)
        meter.pids.append(h.p.pid)
    results = []
    try:
        for T in a.tokens:
            x = torch.from_numpy(rng.standard_normal((T, n_in), dtype=np.float32))
            xb = x.to(torch.bfloat16)
            xpath, ypath = os.path.join(tmp, "x.bin"), os.path.join(tmp, "y.bin")
            x.numpy().tofile(xpath)
            ref = x.numpy().astype(np.float64) @ wdq.T.astype(np.float64)
            y_c = torch.empty(T, n_out)
            fwd, handle, xp, yp = lin._forward_fn, lin._handle, x.data_ptr(), y_c.data_ptr()

            def torch_call(fn):
                def go():
                    torch.set_num_threads(a.threads)
                    try:
                        return burst(fn, a.burst_s)
                    finally:
                        torch.set_num_threads(1)
                return go

            calls = {
                "colibri": lambda: burst(lambda: lin(x), a.burst_s),
                "colibri_c": lambda: burst(lambda: fwd(handle, T, xp, yp), a.burst_s),
                "torch_bf16": torch_call(lambda: F.linear(xb, w_bf16)),
                "torch_f32": torch_call(lambda: F.linear(x, w_f32)),
            }
            if h:
                opts = "--tokens %d --warmup 2 --iters 5 --min-seconds %g" % (T, a.burst_s)
                calls["llamacpp"] = lambda: h.case(opts)["p50_us"]

            # agreement (one call each)
            acc = {"colibri": rel_l2(lin(x).numpy(), ref)}
            torch.set_num_threads(a.threads)
            acc["torch_bf16"] = rel_l2(F.linear(xb, w_bf16).float().numpy(), ref)
            acc["torch_f32"] = rel_l2(F.linear(x, w_f32).numpy(), ref)
            torch.set_num_threads(1)
            ginfo = {}
            if h:
                ginfo = h.case("--tokens %d --iters 1 --warmup 0 --check --input %s --output %s" % (T, xpath, ypath))
                acc["llamacpp"] = rel_l2(np.fromfile(ypath, dtype=np.float32).reshape(T, n_out), ref)
                acc["llamacpp_self_check"] = ginfo.get("check_rel_l2")

            names = [e for e in ENGINES if e in calls]
            best = None
            for attempt in range(1 + a.retries):
                if a.max_wait > 0:
                    meter.wait_for_quiet(a.quiet, a.max_wait)
                for e in names:  # one untimed turn each (first-call effects, spinning workers)
                    time.sleep(a.pause_s)
                    calls[e]()
                s0 = meter.snapshot()
                samples = {e: [] for e in names}
                for r in range(a.reps):
                    order = names[r % len(names):] + names[:r % len(names)]
                    for e in order:
                        time.sleep(a.pause_s)
                        samples[e].append(calls[e]())
                load = meter.other_load(s0, meter.snapshot())
                if best is None or load < best[1]:
                    best = (samples, load)
                if load < a.quiet:
                    break
                log("  %s %dx%d T=%d: others used %.0f%% of the machine meanwhile%s"
                    % (gtype, n_out, n_in, T, 100 * load, "; again" if attempt < a.retries else ""))
            samples, load = best
            med = {e: statistics.median(v) for e, v in samples.items()}
            res = {
                "type": gtype, "shape": "%dx%d" % (n_out, n_in), "shape_name": SHAPES.get((n_out, n_in), ""),
                "out": n_out, "in": n_in, "T": T, "threads": a.threads, "stored_bytes": stored,
                "other_load": round(load, 3),
                "us": med, "samples_us": samples, "rel_l2": acc,
                "colibri_kernels": lin.kernels, "colibri_packed_bytes": lin.nbytes,
                "llamacpp_buffer": ginfo.get("weight_buffer"), "llamacpp_repack": ginfo.get("repack"),
                "llamacpp_buffer_types": ginfo.get("buffer_types"),
            }
            c = med["colibri"]
            if "llamacpp" in med:
                res["llamacpp_over_colibri"] = med["llamacpp"] / c
                res["llamacpp_over_colibri_c"] = med["llamacpp"] / med["colibri_c"]
            res["torch_bf16_over_colibri"] = med["torch_bf16"] / c
            res["torch_f32_over_colibri"] = med["torch_f32"] / c
            if T == 1:
                res["colibri_weight_GBps"] = stored / (c * 1e-6) / 1e9
                res["colibri_c_weight_GBps"] = stored / (med["colibri_c"] * 1e-6) / 1e9
            log("%s %s T=%d: " % (gtype, res["shape"], T)
                + ", ".join("%s %.1f" % (e, med[e]) for e in names) + " µs")
            results.append(res)
    finally:
        if h:
            h.close()
        lin.close()
    return results


def fmt(v, nd=1):
    if v is None:
        return "-"
    return "%.*f" % (nd, v)


def table(results, header):
    out = [header, ""]
    out.append("| type | shape (out x in) | T | Colibri µs | Colibri C µs | llama.cpp µs | torch bf16 µs | torch f32 µs "
               "| llama.cpp / Colibri | torch bf16 / Colibri | Colibri GB/s (T=1) | others |")
    out.append("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in results:
        u = r["us"]
        out.append("| %s | %s | %d | %s | %s | %s | %s | %s | %s | %s | %s | %.0f%% |" % (
            r["type"], r["shape"], r["T"], fmt(u["colibri"]), fmt(u["colibri_c"]), fmt(u.get("llamacpp")),
            fmt(u["torch_bf16"]), fmt(u["torch_f32"]), fmt(r.get("llamacpp_over_colibri"), 2),
            fmt(r["torch_bf16_over_colibri"], 2), fmt(r.get("colibri_weight_GBps"), 1), 100 * r["other_load"]))
    out += ["", "Agreement: relative L2 against float64 x @ W^T of the dequantised weights "
            "(ggml self: the harness's --check against ggml's own dequantisation).", ""]
    out.append("| type | shape | T | Colibri | llama.cpp | ggml self | torch bf16 | torch f32 | Colibri kernels "
               "| llama.cpp weight buffer |")
    out.append("|---|---|--:|--:|--:|--:|--:|--:|---|---|")
    e = lambda v: "-" if v is None else "%.2e" % v  # noqa: E731
    for r in results:
        a = r["rel_l2"]
        buf = r.get("llamacpp_buffer") or "-"
        if r.get("llamacpp_repack"):
            buf += " (%s)" % r["llamacpp_repack"]
        out.append("| %s | %s | %d | %s | %s | %s | %s | %s | %s | %s |" % (
            r["type"], r["shape"], r["T"], e(a.get("colibri")), e(a.get("llamacpp")), e(a.get("llamacpp_self_check")),
            e(a.get("torch_bf16")), e(a.get("torch_f32")), r["colibri_kernels"], buf))
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default=",".join(TYPES), help="ggml type names (default: %(default)s)")
    ap.add_argument("--shapes", default=",".join("%dx%d" % s for s in SHAPES), help="OUTxIN list (default: %(default)s)")
    ap.add_argument("--tokens", default="1,128")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7, help="turns per engine and case (default %(default)s)")
    ap.add_argument("--burst-s", type=float, default=0.05, help="seconds of calls per turn, at least (default %(default)s)")
    ap.add_argument("--pause-s", type=float, default=0.03, help="sleep before each turn (default %(default)s)")
    ap.add_argument("--harness", default=os.path.join(ROOT, "build", "llamacpp-peer", "llamacpp_linear"),
                    help="llamacpp_linear from bench/llamacpp_peer.sh; '' to leave llama.cpp out")
    ap.add_argument("--quiet", type=float, default=0.1,
                    help="others' share of the CPUs above which a case is measured again (default %(default)s)")
    ap.add_argument("--max-wait", type=float, default=60,
                    help="seconds to wait for a quiet machine before each case; 0: no wait (default %(default)s)")
    ap.add_argument("--retries", type=int, default=2, help="re-measurements of a disturbed case (default %(default)s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    a.tokens = [int(t) for t in a.tokens.split(",")]
    types = a.types.split(",")
    for t in types:
        if t not in TYPES:
            sys.exit("linear_bench.py: unknown type %r (ggml names: %s)" % (t, ", ".join(TYPES)))
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes.split(",")]
    if a.harness and not os.access(a.harness, os.X_OK):
        sys.exit("linear_bench.py: no harness at %s; build it with bench/llamacpp_peer.sh (or --harness '')"
                 % a.harness)
    torch.set_num_threads(1)
    when = datetime.datetime.now().astimezone()
    header = "CPU: %s; %s; colibri %s (%s), torch %s; %d threads; median of %d interleaved turns" % (
        cpu_name(), when.strftime("%Y-%m-%d %H:%M %Z"), colibri.library_version(), colibri.cpu_isa(),
        torch.__version__, a.threads, a.reps)
    results = []
    meter = ChildMeter()
    with tempfile.TemporaryDirectory(prefix="linear_bench.") as tmp, torch.inference_mode():
        for i, (n_out, n_in) in enumerate(shapes):
            for j, t in enumerate(types):
                log("%s %dx%d" % (t, n_out, n_in))
                results += run_config(a, meter, t, n_out, n_in, tmp, a.seed * 1000 + 10 * i + j)
    print(table(results, header))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_name(), "date": when.isoformat(timespec="seconds"), "threads": a.threads,
                       "reps": a.reps, "burst_s": a.burst_s, "quiet": a.quiet, "colibri": colibri.library_version(),
                       "torch": torch.__version__, "harness": a.harness, "results": results}, f, indent=1)
        log("wrote %s" % a.json)


if __name__ == "__main__":
    main()
