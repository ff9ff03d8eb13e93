#!/usr/bin/env python3
"""End to end on one GGUF file: llama.cpp's llama-bench against
colibri.torch.from_pretrained + transformers' forward/generate, interleaved
rounds, each engine in a fresh process (peak RSS is that process's own,
from wait4).

  .venv/bin/python bench/e2e_gguf.py --gguf FILE [--gguf FILE2 ...] \\
      [--llama-bench build/llamacpp-bench/bin/llama-bench] [--threads 2] [--rounds 3] \\
      [--prefill 128,512] [--decode 32] [--json OUT.json]

Per round and file:
  llama.cpp  llama-bench -m FILE -t THREADS -p P1,P2 -n DECODE -r 1 -o json
  ik_llama.cpp (with --ik-llama-bench) the same and -rtr 1 -fmoe 1
             (pp: one batch of P tokens; tg: DECODE tokens generated one at
             a time from an empty context)
  Colibri    a child process: from_pretrained(FILE, threads=THREADS) (load
             seconds, RSS), a warm-up, then each prefill size as one forward
             of P tokens with logits_to_keep=1 (median of --reps), and generate() of DECODE new
             tokens from a 16-token prompt, greedy: decode tokens/s is one
             over the median step (time between consecutive logits
             processor calls). One more generate gives
             where a decode step's time goes, timed around the C calls:
             linears (attention projections), head, MoE blocks (router +
             experts), attention, rope, norms, the rest (embedding, cache,
             generate, Python).
PyTorch's threads: from_pretrained's torch_threads="auto" (the cores Colibri
leaves, at least 1), or --torch-threads.

Files: `--make DIR` writes the project's synthetic ones (real widths,
random weights, a 2000-token vocabulary; gguf_fixtures.write_model_gguf,
about 5 minutes) and exits:
  qwen3moe-4b.gguf  Qwen3-30B-A3B: 4 blocks, 2048 wide, 128 experts of 768, top-8,
                    32 heads of 128, 4 KV heads; Q4_K gate/up, Q6_K down, Q8_0
                    attention, embedding and head (1.55 GiB)
  gpt-oss-2b.gguf   gpt-oss-20b: 2 blocks, 2880 wide, 32 experts of 2880, top-4,
                    64 heads of 64, 8 KV heads; MXFP4 experts, Q8_0 attention (0.85 GiB)
  mixtral-1b.gguf   Mixtral-8x7B: 1 block, 4096 wide, 8 experts of 14336, top-2,
                    32 heads of 128, 8 KV heads; Q4_K/Q6_K experts, Q8_0 attention (0.91 GiB)
  deepseek2-3b.gguf DeepSeek-V3's block at DeepSeek-V2-Lite's widths: 3 blocks (the
                    first dense, 10944 wide), 2048 wide, 64 experts of 1408, top-6,
                    2 shared, sigmoid router with selection bias, scale 2.5; latent
                    attention (16 heads, q rank 1536, kv rank 512, nope 128, rope 64,
                    v 128; attn_k_b/attn_v_b as llama.cpp converts today; llama.cpp
                    takes a file without q rank only at V2-Lite's 26-27 blocks);
                    Q4_K gate/up, Q8_0 down (1408-wide rows hold no K-quant
                    super-blocks; the shared expert's down too: Colibri runs a shared
                    expert in the routed ones' types), Q8_0 attention (0.89 GiB)
Routers are written at N(0, 0.5) (router_scale=25), as trained routers
separate their experts.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

from cache_bench import cpu_model  # noqa: E402


def run_child(cmd, env=None):
    """(stdout, peak RSS bytes) of one child process."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out, err = p.communicate()
    if p.returncode != 0:
        raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd[:3]), p.returncode, err.decode()[-2000:]))
    return out.decode()


def measured(cmd):
    """Runs cmd under this script's --measure wrapper: (stdout, peak RSS bytes)."""
    out = run_child([sys.executable, os.path.abspath(__file__), "--measure", "--"] + cmd)
    body, _, last = out.rstrip("\n").rpartition("\n")
    return body, int(last)


def measure_main(cmd):
    pid = os.fork()
    if pid == 0:
        os.execvp(cmd[0], cmd)
    _, status, usage = os.wait4(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(code)
    print(usage.ru_maxrss * 1024)


# ------------------------------------------------------------ Colibri child


def colibri_child(a):
    import torch

    import colibri.nn as cnn
    import colibri.torch as ct

    res = {}
    t0 = time.perf_counter()
    model = ct.from_pretrained(a.gguf[0], threads=a.threads, torch_threads=a.torch_threads or "auto")
    res["load_s"] = time.perf_counter() - t0
    res["rss_after_load"] = rss()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for P in a.prefill_sizes:
            ids = torch.randint(3, vocab, (1, P), generator=g)
            # As llama-bench's pp and generate's prefill: the cache written,
            # the last position's logits only (so, as in llama.cpp, the last
            # block's feed-forward runs on that position alone).
            model(ids, logits_to_keep=1)  # warm-up
            times = []
            for _ in range(a.reps):
                t = time.perf_counter()
                model(ids, logits_to_keep=1)
                times.append(time.perf_counter() - t)
            res["pp%d" % P] = P / statistics.median(times)
        prompt = torch.randint(3, vocab, (1, 16), generator=g)
        stamps = []

        class Stamp:
            def __call__(self, input_ids, scores):
                stamps.append(time.perf_counter())
                return scores

        def generate():
            stamps.clear()
            model.generate(prompt, max_new_tokens=a.decode, min_new_tokens=a.decode, do_sample=False,
                           logits_processor=[Stamp()], pad_token_id=0)
            return [y - x for x, y in zip(stamps, stamps[1:])]

        generate()  # warm-up
        steps = []
        for _ in range(a.reps):
            steps += generate()
        res["tg"] = 1.0 / statistics.median(steps)
        res["decode_step_ms"] = statistics.median(steps) * 1e3
        res["breakdown_ms"] = decode_breakdown(model, generate, cnn)
    res["rss_end"] = rss()
    print(json.dumps(res))


def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def decode_breakdown(model, generate, cnn):
    """ms per decode step in each kind of C call, timed around the calls
    themselves (so forward hooks do not turn the direct decode step off):
    linears (attention projections, DeepSeek's latent ones, dense MLPs),
    head (the LM head), moe (router + experts + shared expert), attention
    (colibri_attention), rope, norms, and rest (embedding, cache updates,
    generate's own work, Python between calls). Also `direct_steps`: the
    decode steps colibri.decode took."""
    import torch

    from colibri import _lib as L

    spans = {"linears": 0.0, "head": 0.0, "moe": 0.0, "attention": 0.0, "rope": 0.0, "norms": 0.0}
    undo = []

    def timed(owner, attr, kind):
        inner = getattr(owner, attr)

        def call(*args):
            t = time.perf_counter()
            r = inner(*args)
            spans[kind] += time.perf_counter() - t
            return r

        undo.append((owner, attr, inner))
        setattr(owner, attr, call)

    head = getattr(model, "lm_head", None)
    for m in model.modules():
        if isinstance(m, cnn.Linear):
            timed(m, "_forward_fn", "head" if m is head else "linears")
        elif isinstance(m, cnn.RMSNorm):
            timed(m, "_fn", "norms")
    seen = set()
    for m in model.modules():
        routed = m.__dict__.get("_colibri_routed")
        if routed is not None and id(routed[0]) not in seen:
            seen.add(id(routed[0]))
            timed(routed[0], "_infer_pointers", "moe")
    lib = L.lib()
    for name, kind in (("colibri_attention", "attention"), ("colibri_rope", "rope"), ("colibri_rms_norm", "norms")):
        timed(lib, name, kind)
    step = model.model.__dict__.get("_colibri_decode_step")
    if step is not None:
        # The direct step holds the C functions it calls (and calls each
        # Linear's handle, not its Python side).
        timed(step, "attention", "attention")
        timed(step, "rope", "rope")
        timed(step, "norm", "norms")
        timed(step, "linear", "linears")
        before = step.steps
    try:
        steps = generate()
    finally:
        for owner, attr, inner in reversed(undo):
            setattr(owner, attr, inner)
    # The prompt's forward is counted too; per-step figures divide by all
    # forwards, which the decode steps dominate.
    n = len(steps) + 1
    out = {k: v / n * 1e3 for k, v in spans.items()}
    out["step"] = statistics.median(steps) * 1e3
    out["rest"] = out["step"] - sum(v for k, v in out.items() if k != "step")
    out["direct_steps"] = (step.steps - before) if step is not None else 0
    return out


# ------------------------------------------------------------------- parent


def llama_bench(a, path, exe=None, extra=()):
    cmd = [exe or a.llama_bench, "-m", path, "-t", str(a.threads), "-p", ",".join(map(str, a.prefill_sizes)),
           "-n", str(a.decode), "-r", "1", "-o", "json"] + list(extra)
    out, peak = measured(cmd)
    res = {"peak_rss": peak}
    for row in json.loads(out):
        tps = row.get("avg_ts")
        if row.get("n_gen", 0) > 0:
            res["tg"] = tps
        else:
            res["pp%d" % row["n_prompt"]] = tps
    return res


# ik_llama.cpp's llama-bench with its run-time repacking and fused MoE on
# (flash attention and its MLA mode 3 are its defaults).
IK_ARGS = ("-rtr", "1", "-fmoe", "1")


def ik_llama_bench(a, path):
    return llama_bench(a, path, exe=a.ik_llama_bench, extra=IK_ARGS)


def colibri_run(a, path):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--gguf", path, "--threads", str(a.threads),
           "--prefill", ",".join(map(str, a.prefill_sizes)), "--decode", str(a.decode), "--reps", str(a.reps),
           "--torch-threads", str(a.torch_threads)]
    out, peak = measured(cmd)
    res = json.loads(out.strip().splitlines()[-1])
    res["peak_rss"] = peak
    return res


FILES = {
    "qwen3moe-4b.gguf": dict(arch="qwen3moe", n_blocks=4, d_model=2048, n_experts=128, top_k=8, d_ff=768,
                             n_heads=32, n_kv_heads=4, head_dim=128),
    "gpt-oss-2b.gguf": dict(arch="gpt-oss", n_blocks=2, d_model=2880, n_experts=32, top_k=4, d_ff=2880,
                            n_heads=64, n_kv_heads=8, head_dim=64),
    "mixtral-1b.gguf": dict(arch="llama", n_blocks=1, d_model=4096, n_experts=8, top_k=2, d_ff=14336,
                            n_heads=32, n_kv_heads=8, head_dim=128),
    "deepseek2-3b.gguf": dict(arch="deepseek2", n_blocks=3, n_dense_blocks=1, dense_d_ff=10944, d_model=2048,
                              n_experts=64, top_k=6, d_ff=1408, shared_d_ff=2816, n_heads=16, n_kv_heads=16,
                              head_dim=192, weights_scale=2.5, expert_types=("q4_k", "q4_k", "q8_0"),
                              mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128)),
}


def make_files(folder):
    sys.path.insert(0, os.path.join(HERE, "..", "python", "tests"))
    from gguf_fixtures import write_model_gguf

    os.makedirs(folder, exist_ok=True)
    for name, spec in FILES.items():
        spec = dict(spec)
        arch = spec.pop("arch")
        path = os.path.join(folder, name)
        t = time.time()
        write_model_gguf(path, arch, vocab=2000, reference=False, router_scale=25.0, **spec)
        print("wrote %s (%.2f GiB) in %.0f s" % (path, os.path.getsize(path) / 2**30, time.time() - t),
              file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--make", metavar="DIR", help="write the synthetic files into DIR and exit")
    ap.add_argument("--gguf", action="append")
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--ik-llama-bench", default=None,
                    help="ik_llama.cpp's llama-bench (bench/ik_llama_bench.sh), run with %s" % " ".join(IK_ARGS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill", default="128,512")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--torch-threads", type=int, default=0, help="PyTorch's intra-op threads (0: from_pretrained's 'auto')")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.prefill_sizes = [int(p) for p in a.prefill.split(",") if p]
    if a.make:
        make_files(a.make)
        return
    if not a.gguf:
        ap.error("--gguf FILE is required (or --make DIR)")
    if a.child:
        colibri_child(a)
        return
    results = {"cpu": cpu_model(), "threads": a.threads, "date": time.strftime("%Y-%m-%d"), "files": {}}
    for path in a.gguf:
        results["files"][path] = {"llama.cpp": [], "ik_llama.cpp": [], "colibri": [], "size": os.path.getsize(path)}
    for r in range(a.rounds):
        for path in a.gguf:
            runs = results["files"][path]
            engines = [("colibri", colibri_run)]
            if a.llama_bench:
                engines.insert(0, ("llama.cpp", llama_bench))
            if a.ik_llama_bench:
                engines.insert(0, ("ik_llama.cpp", ik_llama_bench))
            if r % 2:
                engines.reverse()
            for name, fn in engines:
                res = fn(a, path)
                runs[name].append(res)
                print("round %d %s %s: %s" % (r, os.path.basename(path), name,
                                              {k: (round(v, 2) if isinstance(v, float) else v)
                                               for k, v in res.items() if k != "breakdown_ms"}),
                      file=sys.stderr, flush=True)
                if "breakdown_ms" in res:
                    print("  decode step breakdown (ms): %s"
                          % {k: round(v, 2) for k, v in res["breakdown_ms"].items()}, file=sys.stderr)
    print(table(results, a))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


def table(results, a):
    keys = ["pp%d" % p for p in a.prefill_sizes] + ["tg"]
    lines = ["%s, %d threads, %s; medians of %d interleaved rounds (min-max)"
             % (results["cpu"], a.threads, results["date"], a.rounds), "",
             "| file | engine | " + " | ".join(k + " tokens/s" for k in keys) + " | peak RSS | load s |",
             "|---|---|" + "---|" * (len(keys) + 2)]
    for path, runs in results["files"].items():
        for name in ("llama.cpp", "ik_llama.cpp", "colibri"):
            rs = runs.get(name)
            if not rs:
                continue
            cells = []
            for k in keys:
                v = [r[k] for r in rs if k in r]
                cells.append("%.1f (%.1f-%.1f)" % (statistics.median(v), min(v), max(v)) if v else "-")
            peak = statistics.median([r["peak_rss"] for r in rs]) / 2**30
            load = statistics.median([r["load_s"] for r in rs]) if "load_s" in rs[0] else float("nan")
            lines.append("| %s (%.2f GiB) | %s | %s | %.2f GiB | %.1f |"
                         % (os.path.basename(path), runs["size"] / 2**30, name, " | ".join(cells), peak, load))
        for peer in ("llama.cpp", "ik_llama.cpp"):
            if not runs.get(peer) or not runs["colibri"]:
                continue
            ratios = []
            for k in keys:
                c = statistics.median([r[k] for r in runs["colibri"]])
                v = [r[k] for r in runs[peer] if k in r]
                ratios.append("%.2fx" % (c / statistics.median(v)) if v else "-")
            pc = statistics.median([r["peak_rss"] for r in runs["colibri"]])
            pl = statistics.median([r["peak_rss"] for r in runs[peer]])
            lines.append("| | Colibri / %s | %s | %.2fx | |" % (peer, " | ".join(ratios), pc / pl))
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--measure":
        measure_main(sys.argv[3:])
    else:
        main()
