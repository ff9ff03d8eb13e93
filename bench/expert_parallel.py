#!/usr/bin/env python3
"""Expert parallelism on one host: a GGUF model through
colibri.torch.from_pretrained in one process of T threads against N ranks
(torch.distributed, gloo on loopback) of T / N threads each holding about
1 / N of the experts (expert_parallel=True), interleaved round by round.

  COLIBRI_LIBRARY=build/libcolibri.so .venv/bin/python bench/expert_parallel.py \\
      --gguf build/bench-work/e2e/qwen3moe-4b.gguf --ranks 2 --threads 2 --rounds 3 \\
      --json bench/results/expert-parallel/out.json

Per engine and round: prefill tokens/s (one forward of --prefill tokens,
logits_to_keep=1, as bench/e2e_gguf.py), decode tokens/s (median step of
generate over --decode tokens from a 16-token prompt), peak RSS (per rank),
and for the ranks the all-reduce itself: the median latency of
dist.all_reduce on the group expert_parallel made, for one decode token's
block output ([1, d_model]) and a prefill's ([P, d_model]), in fp32 and
bf16 (what a bf16 all-reduce would save), and the bytes each rank sends per
token and MoE layer (gloo's ring: 2 (N - 1) / N of the payload).

On a 2-core machine, 1 x 2 threads against 2 x 1 thread compares the same
cores: what it shows is the cost of the collectives and of running
attention and the dense parts on every rank, not scaling.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def peak_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(model, a):
    import torch

    res = {}
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        ids = torch.randint(3, vocab, (1, a.prefill), generator=g)
        model(ids, logits_to_keep=1)
        times = []
        for _ in range(a.reps):
            t = time.perf_counter()
            model(ids, logits_to_keep=1)
            times.append(time.perf_counter() - t)
        res["pp"] = a.prefill / statistics.median(times)
        prompt = torch.randint(3, vocab, (1, 16), generator=g)
        stamps = []

        class Stamp:
            def __call__(self, input_ids, scores):
                stamps.append(time.perf_counter())
                return scores

        steps = []
        for rep in range(a.reps + 1):
            stamps.clear()
            model.generate(prompt, max_new_tokens=a.decode, min_new_tokens=a.decode, do_sample=False,
                           logits_processor=[Stamp()], pad_token_id=0)
            if rep:  # the first is a warm-up
                steps += [y - x for x, y in zip(stamps, stamps[1:])]
        res["tg"] = 1.0 / statistics.median(steps)
    return res


def all_reduce_costs(group, d_model, prefill, world):
    import torch
    import torch.distributed as dist

    out = {}
    for name, rows in (("decode", 1), ("prefill", prefill)):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.ones(rows, d_model, dtype=dtype)
            for _ in range(20):
                dist.all_reduce(x, group=group)
            t = []
            for _ in range(200 if rows == 1 else 20):
                t0 = time.perf_counter()
                dist.all_reduce(x, group=group)
                t.append(time.perf_counter() - t0)
            key = "%s_%s" % (name, "fp32" if dtype == torch.float32 else "bf16")
            out["all_reduce_us_" + key] = statistics.median(t) * 1e6
    out["bytes_sent_per_token_and_layer_fp32"] = 2 * (world - 1) / world * d_model * 4
    return out


def rank_main(rank, a, init, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=a.ranks)
    try:
        import colibri.torch as ct
        from colibri.metrics import colibri_models

        t0 = time.perf_counter()
        model = ct.from_pretrained(a.gguf, threads=a.threads // a.ranks, expert_parallel=True)
        res = {"load_s": time.perf_counter() - t0}
        res.update(measure(model, a))
        group = None
        for b in model._colibri_report.accelerated:
            routed = model.get_submodule(b.path).__dict__.get("_colibri_routed")
            if routed is not None and len(routed) > 6:
                group = routed[6]
                break
        res.update(all_reduce_costs(group, model.config.hidden_size, a.prefill, a.ranks))
        res["expert_bytes"] = sum(m.stats.bytes_mapped for m in colibri_models(model))
        res["peak_rss"] = peak_rss()
        with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


def single_main(a, out):
    import colibri.torch as ct
    from colibri.metrics import colibri_models

    t0 = time.perf_counter()
    model = ct.from_pretrained(a.gguf, threads=a.threads)
    res = {"load_s": time.perf_counter() - t0}
    res.update(measure(model, a))
    res["expert_bytes"] = sum(m.stats.bytes_mapped for m in colibri_models(model))
    res["peak_rss"] = peak_rss()
    with open(out, "w") as f:
        json.dump(res, f)


def run_child(a, mode, out_dir):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--out-dir", out_dir,
           "--gguf", a.gguf, "--ranks", str(a.ranks), "--threads", str(a.threads), "--prefill", str(a.prefill),
           "--decode", str(a.decode), "--reps", str(a.reps)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError("%s failed: %s" % (mode, p.stderr[-3000:]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="threads of the single process; each rank gets threads / ranks")
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--child", choices=["single", "ranks"], help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.threads % a.ranks:
        ap.error("--threads must be a multiple of --ranks")
    if a.child == "single":
        single_main(a, os.path.join(a.out_dir, "single.json"))
        return
    if a.child == "ranks":
        import torch.multiprocessing as mp

        init = "file://" + os.path.join(a.out_dir, "rendezvous")
        mp.start_processes(rank_main, args=(a, init, a.out_dir), nprocs=a.ranks, join=True, start_method="spawn")
        return
    rounds = []
    for r in range(a.rounds):
        row = {}
        for mode in (("single", "ranks") if r % 2 == 0 else ("ranks", "single")):
            with tempfile.TemporaryDirectory() as d:
                run_child(a, mode, d)
                if mode == "single":
                    row["single"] = json.load(open(os.path.join(d, "single.json")))
                else:
                    row["ranks"] = [json.load(open(os.path.join(d, "rank%d.json" % i))) for i in range(a.ranks)]
        rounds.append(row)
        s, rk = row["single"], row["ranks"]
        print("round %d: 1 x %d threads: pp %.1f tg %.1f tokens/s, peak RSS %.2f GiB | %d ranks x %d: pp %.1f tg %.1f, "
              "peak RSS per rank %s GiB, all-reduce decode %.0f us (bf16 %.0f), prefill %.0f us (bf16 %.0f)"
              % (r, a.threads, s["pp"], s["tg"], s["peak_rss"] / 2**30, a.ranks, a.threads // a.ranks,
                 rk[0]["pp"], rk[0]["tg"], "/".join("%.2f" % (x["peak_rss"] / 2**30) for x in rk),
                 rk[0]["all_reduce_us_decode_fp32"], rk[0]["all_reduce_us_decode_bf16"],
                 rk[0]["all_reduce_us_prefill_fp32"], rk[0]["all_reduce_us_prefill_bf16"]), flush=True)

    def med(f):
        return statistics.median(f(row) for row in rounds)

    summary = {
        "single_pp": med(lambda r: r["single"]["pp"]), "single_tg": med(lambda r: r["single"]["tg"]),
        "ranks_pp": med(lambda r: r["ranks"][0]["pp"]), "ranks_tg": med(lambda r: r["ranks"][0]["tg"]),
        "single_peak_rss": med(lambda r: r["single"]["peak_rss"]),
        "rank_peak_rss": med(lambda r: max(x["peak_rss"] for x in r["ranks"])),
        "single_expert_bytes": rounds[0]["single"]["expert_bytes"],
        "rank_expert_bytes": [x["expert_bytes"] for x in rounds[0]["ranks"]],
    }
    for k in rounds[0]["ranks"][0]:
        if k.startswith("all_reduce_us_"):
            summary[k] = med(lambda r, k=k: r["ranks"][0][k])
    summary["bytes_sent_per_token_and_layer_fp32"] = rounds[0]["ranks"][0]["bytes_sent_per_token_and_layer_fp32"]
    print(json.dumps(summary, indent=1))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"gguf": a.gguf, "ranks": a.ranks, "threads": a.threads, "rounds": rounds, "summary": summary,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, f, indent=1)


if __name__ == "__main__":
    main()
