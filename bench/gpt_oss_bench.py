#!/usr/bin/env python3
"""gpt-oss experts: transformers' own GptOssExperts (torch, bf16 weights, as
people run gpt-oss on CPUs) against Colibri on the same weights in one run.

The layer is gpt-oss-20b's (E=32, top-4, d_model = d_ff = 2880) unless told
otherwise; weights are random (nothing downloaded), biases included. Both
engines get the same tokens and the same routing (ids and softmax weights,
fixed per token count), so they run the same experts. Colibri runs the block
through colibri.torch (ColibriExperts.from_moe_block, the path accelerate()
takes) in bf16 (the same weights) and in MXFP4 (the checkpoints' format:
the bf16 weights quantised by Colibri's reference quantiser). Each output is
compared with transformers' bf16 output.

  bench/gpt_oss_bench.py --threads 2 --out bench/results/gpt-oss-zen3/transformers.json
  bench/gpt_oss_bench.py --tiny                  # seconds: does it run?

Timing: warm-up calls, then calls until --max-seconds (at least 3); p50.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import colibri.torch as ct  # noqa: E402


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def block(E, k, D, F, seed, implementation):
    import transformers

    cfg = transformers.GptOssConfig(hidden_size=D, intermediate_size=F, num_local_experts=E, num_experts_per_tok=k,
                                    num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8,
                                    head_dim=64, vocab_size=128)
    # transformers 5's experts dispatch (transformers.integrations.moe):
    # "eager" (the module's own loop over experts) or "grouped_mm".
    cfg._experts_implementation = implementation
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    torch.manual_seed(seed)
    mlp = GptOssMLP(cfg).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            # gpt-oss-like scales: weights ~ N(0, 1/fan_in), biases of a few tenths
            scale = 0.3 if "bias" in name else (1.0 / D ** 0.5 if "gate_up" in name or "router" in name else 1.0 / F ** 0.5)
            p.copy_((scale * torch.randn(p.shape, generator=g)).to(p.dtype))
    return mlp, transformers.__version__


def routing(T, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    top, ids = torch.topk(logits, k, dim=-1)
    return ids, torch.softmax(top, dim=-1)


def timed(fn, max_seconds, warmup=2, min_iters=3, max_iters=200):
    for _ in range(warmup):
        fn()
    ms, t_end = [], time.perf_counter() + max_seconds
    while len(ms) < max_iters and (len(ms) < min_iters or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t0) * 1e3)
    return {"p50_ms": statistics.median(ms), "min_ms": min(ms), "iters": len(ms)}


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=2880)
    ap.add_argument("--d-ff", type=int, default=2880)
    ap.add_argument("--tokens", default="1,96")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-seconds", type=float, default=6.0)
    ap.add_argument("--dtypes", default="bf16,mxfp4")
    ap.add_argument("--torch-dtype", default="bf16", choices=["bf16", "f32"],
                    help="the transformers module's weights (bf16: as gpt-oss is run; f32: faster on CPUs "
                         "without bf16 instructions); Colibri's bf16 engine gets the same values rounded to bf16")
    ap.add_argument("--implementations", default="eager,grouped_mm",
                    help="transformers 5 experts implementations to time (4.57 has only its own forward)")
    ap.add_argument("--tiny", action="store_true", help="a small layer, short timings")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.tiny:
        a.experts, a.top_k, a.d_model, a.d_ff, a.max_seconds = 8, 2, 128, 96, 0.2
    torch.set_num_threads(a.threads)
    E, k, D, F = a.experts, a.top_k, a.d_model, a.d_ff
    impls = [i for i in a.implementations.split(",") if i]
    mlp, tf_version = block(E, k, D, F, seed=1, implementation=impls[0])
    tdtype = torch.bfloat16 if a.torch_dtype == "bf16" else torch.float32
    mlp = mlp.to(tdtype)
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": cpu_model(), "threads": a.threads,
           "torch": torch.__version__, "transformers": tf_version, "torch_dtype": a.torch_dtype, "shape": {"experts": E, "top_k": k, "d_model": D,
                                                                            "d_ff": F}, "rows": []}
    engines = {}
    for dtype in [d for d in a.dtypes.split(",") if d]:
        engines[dtype] = ct.ColibriExperts.from_moe_block(mlp, dtype=dtype, router=False, threads=a.threads,
                                                          lock=False)
    dense = ct._recognise_gpt_oss(mlp, mlp.experts).dense_scores  # 4.57 takes [T, E] scores
    for T in [int(t) for t in a.tokens.split(",") if t]:
        ids, w = routing(T, E, k, seed=100 + T)
        x = (torch.randn(T, D, generator=torch.Generator().manual_seed(7 + T))).to(torch.bfloat16).to(tdtype)
        scores = torch.zeros(T, E).scatter_(1, ids, w) if dense else w
        scores = scores.to(tdtype)
        with torch.inference_mode():
            row = {"T": T}
            for impl in impls:
                mlp.experts.config._experts_implementation = impl
                row["transformers_%s_%s" % (a.torch_dtype, impl)] = timed(lambda: mlp.experts(x, ids, scores), a.max_seconds)
            mlp.experts.config._experts_implementation = impls[0]
            ref = mlp.experts(x, ids, scores)
            best = min(row["transformers_%s_%s" % (a.torch_dtype, i)]["p50_ms"] for i in impls)
            for dtype, ex in engines.items():
                got = ex(x, ids, w)
                r = timed(lambda: ex(x, ids, w), a.max_seconds)
                r["rel_l2_vs_transformers"] = rel_l2(got.float(), ref.float())
                r["speedup_vs_fastest"] = best / r["p50_ms"]
                row["colibri_" + dtype] = r
        out["rows"].append(row)
        print("T=%-4d %s | %s" % (T, " ".join("transformers %s %s %.3f ms" % (
            a.torch_dtype, i, row["transformers_%s_%s" % (a.torch_dtype, i)]["p50_ms"]) for i in impls), " | ".join(
            "colibri %s %.3f ms (%.2fx the fastest, rel L2 %.2g)" % (
                d, row["colibri_" + d]["p50_ms"], row["colibri_" + d]["speedup_vs_fastest"],
                row["colibri_" + d]["rel_l2_vs_transformers"]) for d in engines)), flush=True)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
