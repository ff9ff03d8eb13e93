#!/usr/bin/env python3
"""llama.cpp peer benchmark: one MoE layer on ggml's CPU backend (the graph
llama.cpp's build_moe_ffn builds, weights in the buffer type its model loader
picks, so q4_0/q4_K go through the CPU_REPACK AVX-512 kernels), for the
suite's shapes and quantised weight types, optionally with Colibri's own
`colibri bench` on the same shape, type and routing, interleaved case by case.

  bench/llamacpp_peer.py --out /tmp/peer.json                        # llama.cpp only
  bench/llamacpp_peer.py --colibri build --out /tmp/peer.json        # and Colibri, interleaved
  bench/llamacpp_peer.py --smoke --out /tmp/peer.json                # seconds: does it run (and check)?
  bench/llamacpp_peer.py --shapes olmoe --types q4_K --tokens 1      # a subset

The harness (bench/llamacpp_moe.cpp) and ggml are built by
bench/llamacpp_peer.sh, which this script runs first (it skips finished
steps; the first run downloads PyPI's llama-cpp-python sdist, so it needs
the network once). Run with the project's environment, .venv/bin/python
(numpy; it reuses bench/run_suite.py's shapes, routings and model cache).

Per shape and type the harness is started once in --serve mode (making and
quantising the weights takes up to a minute for Mixtral q4_K), then each
case is one request: T=1 with the suite's fixed routing, T=1 with a new
routing every call ("cycled", decode as it runs), T=128 with the suite's
fixed routing. The fixed routings are the suite's own .route files (same
seeds, same cache directory), so with --colibri both engines run exactly the
same routing. With --colibri each llama.cpp case is followed by the same case
on `colibri bench`; a dtype Colibri cannot generate (`colibri gen --dtype`
fails) is reported and its Colibri cases are left out.
"""

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import run_suite  # noqa: E402  (shapes, routings, model cache, load meter)

SHAPE_NAMES = ["mixtral", "qwen3-moe", "olmoe"]
SMOKE_SHAPES = {"peer-smoke": (8, 2, 256, 512, [1, 16])}  # q4_K needs multiples of 256
# DeepSeek-V3's routed experts (256 of 7168 x 2048, top-8): on request only,
# with the types whose weights are made in seconds (the grid i-quants' random
# codes; a quantiser takes minutes over its 11 G weights).
LARGE_SHAPES = {"deepseek-v3": (256, 8, 7168, 2048, [1, 128])}
QUANT_TYPES = ["q8_0", "q4_0", "q4_K"]
FLOAT_TYPES = ["f16", "bf16"]
# ggml's type names -> Colibri's dtype names
COLIBRI_DTYPE = {"q8_0": "q8_0", "q4_0": "q4_0", "q4_K": "q4_k", "mxfp4": "mxfp4", "f16": "f16", "bf16": "bf16", "f32": "f32",
                 "q4_1": "q4_1", "q5_0": "q5_0", "q5_1": "q5_1", "iq4_nl": "iq4_nl", "iq4_xs": "iq4_xs",
                 "q2_K": "q2_k", "q3_K": "q3_k", "iq1_s": "iq1_s", "iq1_m": "iq1_m", "iq2_xxs": "iq2_xxs",
                 "iq3_xxs": "iq3_xxs", "iq2_xs": "iq2_xs", "iq2_s": "iq2_s", "iq3_s": "iq3_s", "tq1_0": "tq1_0",
                 "tq2_0": "tq2_0"}

T0 = time.time()


def log(msg):
    print("[%6.1fs] %s" % (time.time() - T0, msg), file=sys.stderr, flush=True)


# ------------------------------------------------------------------ build


def build_harness(work_dir):
    cmd = [os.path.join(HERE, "llamacpp_peer.sh"), work_dir]
    log("$ " + " ".join(shlex.quote(c) for c in cmd))
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.exit("llamacpp_peer.py: building the llama.cpp harness failed (see above); "
                 "the first build needs network access to PyPI")
    exe = p.stdout.strip().splitlines()[-1]
    if not os.access(exe, os.X_OK):
        sys.exit("llamacpp_peer.py: llamacpp_peer.sh did not produce an executable (%r)" % exe)
    return exe


# ------------------------------------------------------------ load meter


class ChildMeter(run_suite.LoadMeter):
    """run_suite's meter (others' share of the machine from /proc/stat minus
    our own CPU time), also counting the serving harness as ours: it is a
    child that has not been waited for, so os.times() does not include it."""

    def __init__(self):
        super().__init__()
        self.pids = []

    def _children_cpu(self):
        total = 0.0
        for pid in self.pids:
            try:
                with open("/proc/%d/stat" % pid) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / self.hz  # utime, stime
            except (OSError, IndexError, ValueError):
                pass
        return total

    def snapshot(self):
        m, busy, own = super().snapshot()
        return (m, busy, own + self._children_cpu())


def measured(meter, a, what, fn):
    """fn() up to 1 + a.retries times until others used less than
    a.quiet_threshold of the machine meanwhile; the least disturbed result,
    with its "other_load"."""
    best = None
    for attempt in range(1 + a.retries):
        if a.max_wait > 0:
            before = meter.wait_for_quiet(a.quiet_threshold, a.max_wait)
            if before >= a.quiet_threshold:
                log("  machine busy (others %.0f%%) after %.0f s; measuring anyway" % (100 * before, a.max_wait))
        s0 = meter.snapshot()
        res = fn()
        s1 = meter.snapshot()
        # /proc/stat counts in clock ticks (10 ms): shorter measurements
        # cannot be told apart from other load.
        load = meter.other_load(s0, s1) if s1[0] - s0[0] >= 0.5 else None
        if isinstance(res, dict):
            res["other_load"] = None if load is None else round(load, 3)
        if best is None or (load is not None and best[1] is not None and load < best[1]):
            best = (res, load)
        if load is None or load < a.quiet_threshold or not isinstance(res, dict) or "error" in res:
            break
        log("  %s: others used %.0f%% of the machine meanwhile%s"
            % (what, 100 * load, "; again" if attempt < a.retries else ""))
    return best[0]


# ------------------------------------------------------------- harness


class Harness:
    """The harness in --serve mode for one shape and type."""

    def __init__(self, exe, meter, args, timeout):
        self.cmd = [exe, "--serve"] + args
        self.meter = meter
        self.timeout = timeout
        log("$ " + " ".join(shlex.quote(c) for c in self.cmd))
        self.p = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        meter.pids.append(self.p.pid)
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError("harness did not start: %r" % ready)
        self.setup_s = ready.get("setup_s")

    def _read(self):
        timer = threading.Timer(self.timeout, self.p.kill)
        timer.start()
        try:
            line = self.p.stdout.readline()
        finally:
            timer.cancel()
        if not line:
            rc = self.p.wait()
            raise RuntimeError("harness exited (%s) without an answer: %s" % (rc, " ".join(self.cmd)))
        return json.loads(line)

    def case(self, args):
        self.p.stdin.write(" ".join(args) + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self):
        try:
            self.p.stdin.write("quit\n")
            self.p.stdin.close()
            self.p.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()
            self.p.wait()
        if self.p.pid in self.meter.pids:
            self.meter.pids.remove(self.p.pid)


# ---------------------------------------------------------------- routes


def route_file(work, name, T, k, E):
    """The suite's fixed routing for (shape, T): the same file name and seed as
    run_suite.ensure_routing, written here if absent (without colibri)."""
    path = os.path.join(work, "%s-e%d-k%d-T%d.route" % (name, E, k, T))
    if not os.path.exists(path):
        ids, w = run_suite.make_routing(T, k, E, seed=1000003 * T + 7919 * E + k)
        lines = ["# %s: %d tokens, top-%d of %d experts, uniformly random, softmax weights" % (name, T, k, E)]
        for t in range(T):
            lines.append(", ".join([str(t)] + [str(int(e)) for e in ids[t]] + ["%.9g" % x for x in w[t]]))
        os.makedirs(work, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.write("\n".join(lines) + "\n")
        os.rename(path + ".tmp", path)
    return path


# ---------------------------------------------------------------- colibri


class Colibri:
    def __init__(self, build_dir, work, threads, isa):
        self.exe = os.path.join(build_dir, "tools", "colibri")
        if not os.access(self.exe, os.X_OK):
            sys.exit("llamacpp_peer.py: no %s (build Colibri first, or leave out --colibri)" % self.exe)
        self.work, self.threads, self.isa = work, threads, isa
        self.models = {}  # (shape, dtype) -> path or RuntimeError

    def model(self, name, E, D, F, dtype):
        key = (name, dtype)
        if key not in self.models:
            try:
                self.models[key] = run_suite.ensure_model(self.exe, self.work, name, E, D, F, dtype)
            except RuntimeError as e:
                msg = str(e).strip()
                log("colibri: no %s model for %s (%s); Colibri may not support this dtype yet, "
                    "llama.cpp rows only" % (dtype, name, " ".join(msg.split())[:300] or "failed"))
                self.models[key] = RuntimeError(msg)
        return self.models[key]

    def bench(self, model, name, T, k, E, routing, iters, warmup):
        cmd = [self.exe, "bench", "--json", "--model", model, "--threads", str(self.threads),
               "--iters", str(iters), "--warmup", str(warmup), "--no-verify"]
        if self.isa:
            cmd += ["--isa", self.isa]
        if routing == "fixed":
            _, binf, _, _ = run_suite.ensure_routing(self.exe, self.work, name, T, k, E)
            cmd += ["--routing", binf]
        else:  # colibri bench's own random routing, a new one every call (as run_suite's cycled rows)
            cmd += ["--tokens", "1", "--top-k", str(k), "--seed", "4242"]
        try:
            return json.loads(run_suite.run_cmd(cmd, 3600, "colibri bench"))
        except (RuntimeError, ValueError) as e:
            log("colibri bench failed: %s" % str(e).strip()[-500:])
            return {"error": str(e).strip()[-2000:]}


# ------------------------------------------------------------------ main


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", default=os.path.join(ROOT, "build", "llamacpp-peer"),
                    help="ggml and harness build directory (bench/llamacpp_peer.sh's)")
    ap.add_argument("--exe", help="an already built harness (skips bench/llamacpp_peer.sh)")
    ap.add_argument("--route-dir", help="where the suite's .route files and Colibri models are cached "
                    "(default BUILD/bench-work with --colibri BUILD, else build/bench-work)")
    ap.add_argument("--shapes", default=",".join(SHAPE_NAMES),
                    help="comma-separated, of: %s, peer-smoke" % ", ".join(list(run_suite.SHAPES) + list(run_suite.GPT_OSS_SHAPES) +
                                                                          list(LARGE_SHAPES)))
    ap.add_argument("--tokens", help="comma-separated token counts (default: the shape's, 1 and 128)")
    ap.add_argument("--types", default=",".join(QUANT_TYPES), help="ggml weight types (q8_0, q4_0, q4_K, mxfp4, f16, bf16)")
    ap.add_argument("--float", action="store_true", help="also f16 and bf16")
    ap.add_argument("--no-cycled", action="store_true", help="no decode rows with a new routing every call")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=100, help="timed iterations of decode rows (T=1)")
    ap.add_argument("--prefill-iters", type=int, default=20, help="timed iterations of rows with T>1")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-seconds", type=float, default=20.0,
                    help="cap on each llama.cpp measurement (iterations are cut, to at least 3); Colibri then "
                         "gets as many iterations as llama.cpp made")
    ap.add_argument("--min-seconds", type=float, default=1.0,
                    help="llama.cpp measurements run more than --iters calls until this long (the load meter "
                         "needs about a second; Colibri gets the same number of calls)")
    ap.add_argument("--check", action="store_true",
                    help="harness checks every output against a float64 reference (slow on big shapes)")
    ap.add_argument("--colibri", metavar="BUILD_DIR", help="also run BUILD_DIR/tools/colibri bench, interleaved")
    ap.add_argument("--colibri-isa", help="--isa for colibri bench (default: Colibri's own choice)")
    ap.add_argument("--quiet-threshold", type=float, default=0.2,
                    help="share of the machine other processes may use during a measurement before it is retried")
    ap.add_argument("--max-wait", type=float, default=30.0, help="seconds to wait for a quiet machine before each measurement")
    ap.add_argument("--retries", type=int, default=1, help="extra attempts of a measurement disturbed by other load")
    ap.add_argument("--no-second-pass", dest="second_pass", action="store_false",
                    help="do not measure rows disturbed by other load again at the end")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny shape, few iterations, every type, output checked: does everything run?")
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "llamacpp-peer", "results.json"))
    a = ap.parse_args(argv)
    known = dict(run_suite.SHAPES, **SMOKE_SHAPES, **run_suite.GPT_OSS_SHAPES, **LARGE_SHAPES)
    if a.smoke:
        a.shapes, a.iters, a.prefill_iters, a.warmup = "peer-smoke", 5, 3, 1
        a.max_wait, a.retries, a.check, a.min_seconds, a.second_pass = 0.0, 0, True, 0.0, False
        a.float = True
    a.shape_list = [s.strip() for s in a.shapes.split(",") if s.strip()]
    bad = [s for s in a.shape_list if s not in known]
    if bad:
        ap.error("unknown shape(s) %s; known: %s" % (", ".join(bad), ", ".join(known)))
    a.shape_table = {s: known[s] for s in a.shape_list}
    a.type_list = [t.strip() for t in a.types.split(",") if t.strip()]
    if a.float:
        a.type_list += [t for t in FLOAT_TYPES if t not in a.type_list]
    for t in a.type_list:
        if t not in COLIBRI_DTYPE:
            ap.error("unknown type %s" % t)
    a.token_list = [int(t) for t in a.tokens.split(",")] if a.tokens else None
    if a.route_dir is None:
        a.route_dir = os.path.join(a.colibri if a.colibri else os.path.join(ROOT, "build"), "bench-work")
    return a


def fmt(x):
    if x is None:
        return ""
    if x >= 100:
        return "%.0f" % x
    if x >= 10:
        return "%.1f" % x
    return "%.3g" % x


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    exe = a.exe or build_harness(a.work_dir)
    colibri = Colibri(a.colibri, a.route_dir, a.threads, a.colibri_isa) if a.colibri else None
    meter = ChildMeter()
    out = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu": run_suite.cpu_model(),
        "threads": a.threads,
        "git": run_suite.git_revision(ROOT),
        "harness": exe,
        "argv": sys.argv[1:] if argv is None else argv,
        "rows": [],
        "package": None,
        "ggml_version": None,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)

    def save():
        with open(a.out + ".tmp", "w") as f:
            json.dump(out, f, indent=1)
        os.rename(a.out + ".tmp", a.out)

    def run_group(name, ty, cases, routes):
        """One shape and type: the harness started once, then every case
        (T, routing), each followed by Colibri's when asked. Returns rows."""
        E, k, D, F, _ = a.shape_table[name]
        rows = []
        log("== %s (E=%d k=%d d_model=%d d_ff=%d) %s" % (name, E, k, D, F, ty))
        cmodel = colibri.model(name, E, D, F, COLIBRI_DTYPE[ty]) if colibri else None
        hargs = ["--type", ty, "--shape", name, "--experts", str(E), "--top-k", str(k), "--d-model", str(D),
                 "--d-ff", str(F), "--threads", str(a.threads), "--seed", "1"] + (["--check"] if a.check else [])
        if run_suite.is_gpt_oss(name):  # both sides compute gpt-oss's biased, clamped experts
            hargs = [x for x in hargs if x != "--check"] + ["--gpt-oss"]
        try:
            h = Harness(exe, meter, hargs, timeout=3600)
        except (RuntimeError, OSError, ValueError) as e:
            log("llama.cpp harness failed for %s %s: %s" % (name, ty, e))
            return [{"shape": name, "type": ty, "error": str(e)}]
        log("  weights made and uploaded in %.1f s" % (h.setup_s or 0))
        try:
            for T, routing in cases:
                iters = a.iters if T == 1 else a.prefill_iters
                cargs = ["--iters", str(iters), "--warmup", str(a.warmup), "--max-seconds", str(a.max_seconds),
                         "--min-seconds", str(a.min_seconds)]
                cargs += ["--route", routes[T]] if routing == "fixed" else ["--tokens", "1", "--routing", "cycled"]
                row = {"shape": name, "type": ty, "T": T, "routing": routing, "experts": E, "top_k": k,
                       "d_model": D, "d_ff": F}
                row["llamacpp"] = measured(meter, a, "llama.cpp %s %s T=%d %s" % (name, ty, T, routing),
                                           lambda: h.case(cargs))
                lc = row["llamacpp"]
                msg = "  llama.cpp %-4s T=%-4d %-6s p50 %8.3f ms  (%d iters, %s%s)" % (
                    ty, T, routing, lc["p50_ms"], lc["iters"], lc["weight_buffer"],
                    " " + lc["repack"] if lc.get("repack") else "")
                if "check_rel_l2" in lc:
                    msg += "  check rel L2 %.2g" % lc["check_rel_l2"]
                log(msg)
                if colibri is not None:
                    if isinstance(cmodel, RuntimeError):
                        row["colibri"] = {"error": "colibri gen --dtype %s failed: %s"
                                          % (COLIBRI_DTYPE[ty], str(cmodel)[-1000:])}
                    else:
                        c_iters = max(3, lc["iters"])
                        row["colibri"] = measured(
                            meter, a, "colibri %s %s T=%d %s" % (name, ty, T, routing),
                            lambda: colibri.bench(cmodel, name, T, k, E, routing, c_iters, a.warmup))
                        cr = row["colibri"]
                        if "p50_ms" in cr:
                            row["speedup"] = lc["p50_ms"] / cr["p50_ms"]
                            log("  colibri   %-4s T=%-4d %-6s p50 %8.3f ms  (%d iters)  llama.cpp/colibri %.2fx"
                                % (COLIBRI_DTYPE[ty], T, routing, cr["p50_ms"], cr.get("iters", 0), row["speedup"]))
                rows.append(row)
        except (RuntimeError, OSError, ValueError, KeyError) as e:
            log("llama.cpp harness failed for %s %s: %s" % (name, ty, e))
            rows.append({"shape": name, "type": ty, "error": str(e)})
        finally:
            h.close()
        return rows

    def load_of(row):
        """The larger of the row's measurements' other_load (None: unmeasured)."""
        loads = [(row.get(e) or {}).get("other_load") for e in ("llamacpp", "colibri")]
        loads = [x for x in loads if x is not None]
        return max(loads) if loads else None

    groups = []  # (name, type, cases, routes)
    for name, (E, k, D, F, Ts) in a.shape_table.items():
        Ts = a.token_list or Ts
        cases = []
        for T in Ts:
            cases.append((T, "fixed"))
            if T == 1 and not a.no_cycled:
                cases.append((1, "cycled"))
        routes = {T: route_file(a.route_dir, name, T, k, E) for T in Ts}
        for ty in a.type_list:
            groups.append((name, ty, cases, routes))
    for name, ty, cases, routes in groups:
        out["rows"] += run_group(name, ty, cases, routes)
        for r in out["rows"]:
            lc = r.get("llamacpp") or {}
            if lc.get("package"):
                out["package"], out["ggml_version"] = lc["package"], lc.get("ggml_version")
        save()

    # Second pass: rows measured while others used a.quiet_threshold or more
    # of the machine, again (one harness start per shape and type), keeping
    # the less disturbed.
    if a.second_pass:
        for name, ty, _, routes in groups:
            idx = [i for i, r in enumerate(out["rows"]) if r["shape"] == name and r["type"] == ty and "T" in r
                   and (load_of(r) or 0.0) >= a.quiet_threshold]
            if not idx:
                continue
            log("second pass: %d disturbed row(s) of %s %s" % (len(idx), name, ty))
            again = run_group(name, ty, [(out["rows"][i]["T"], out["rows"][i]["routing"]) for i in idx], routes)
            for i, r in zip(idx, again):
                if "T" in r and (load_of(r) or 0.0) < (load_of(out["rows"][i]) or 0.0):
                    r["second_pass"] = True
                    out["rows"][i] = r
            save()

    # the table
    lines = ["llama.cpp peer (%s, ggml %s) on %s, %d threads" % (out.get("package"), out.get("ggml_version"),
                                                                  out["cpu"], a.threads), ""]
    head = "| shape | T | routing | type | weights | llama.cpp p50 ms | min ms | iters |"
    sep = "|---|---|---|---|---|---|---|---|"
    if colibri:
        head += " colibri p50 ms | llama.cpp / colibri |"
        sep += "---|---|"
    head += " others' load |"
    sep += "---|"
    lines += [head, sep]
    for r in out["rows"]:
        if "llamacpp" not in r:
            lines.append("| %s | | | %s | error: %s |" % (r["shape"], r["type"], " ".join(r.get("error", "").split())[:100]))
            continue
        lc = r["llamacpp"]
        line = "| %s | %d | %s | %s | %s | %s | %s | %d |" % (
            r["shape"], r["T"], r["routing"], r["type"],
            lc["weight_buffer"] + (" " + lc["repack"] if lc.get("repack") else ""),
            fmt(lc["p50_ms"]), fmt(lc["min_ms"]), lc["iters"])
        if colibri:
            cr = r.get("colibri", {})
            line += " %s | %s |" % (fmt(cr.get("p50_ms")) if "p50_ms" in cr else "n/a",
                                    "%.2fx" % r["speedup"] if "speedup" in r else "")
        load = load_of(r)
        line += " %s |" % ("" if load is None else "%.0f%%" % (100 * load))
        lines.append(line)
    lines += ["", "p50 and min of ggml_backend_graph_compute per call. cycled: a new routing every call. "
              "others' load: the share of the machine other processes used during the row's measurements "
              "(blank: too short to tell)."]
    out["table_md"] = "\n".join(lines)
    save()
    print(out["table_md"])
    log("wrote %s" % a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
