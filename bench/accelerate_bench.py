#!/usr/bin/env python3
"""colibri.torch.accelerate on a Mixtral-shaped MoE block: plain PyTorch fp32
forward against the same model with its experts run by Colibri.

One HF-style MixtralSparseMoeBlock (router Linear -> softmax fp32 -> top-k ->
renormalise -> per-expert loop with index_add_), E=8, k=2, d_model=1024,
d_ff=3584 by default, fp32 weights, inside a one-layer model. For each token
count T it times model(x) under torch.no_grad(): plain PyTorch, then after
accelerate(model, dtype=...) for each Colibri dtype (the router stays in
PyTorch in both), and prints p50/p90 in ms, the speed-up and the relative L2
difference of the outputs. A measurement, not a test: nothing here fails on
timing.

  .venv/bin/python bench/accelerate_bench.py --threads 2 --tokens 1 128 --dtypes f32 f16
  .venv/bin/python bench/accelerate_bench.py --weights-from fp8_e4m3 --torch-dtype bf16 --dtypes fp8_e4m3
    (an FP8 checkpoint's experts: PyTorch on the dequantised bf16 weights against Colibri on the FP8 codes)
  (PYTHONPATH=python and COLIBRI_LIBRARY=build/libcolibri.so if not installed)
"""

import argparse
import os
import statistics
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--d-ff", type=int, default=3584)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 128])
    p.add_argument("--dtypes", nargs="+", default=["f32", "f16"],
                   help="Colibri types: f32 f16 bf16, or a block format (fp8_e4m3, q8_0, ...)")
    p.add_argument("--torch-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="the PyTorch baseline's weights and activations (bf16: as a user runs a bf16 checkpoint)")
    p.add_argument("--weights-from", metavar="TYPE",
                   help="replace the expert weights by their TYPE-dequantised values first (e.g. fp8_e4m3), so "
                        "PyTorch and Colibri hold the same weights")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads and Colibri threads")
    p.add_argument("--iters", type=int, default=50, help="timed calls at T=1 (fewer for large T, see --budget)")
    p.add_argument("--budget", type=float, default=20.0, help="rough seconds per (engine, T) measurement")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


args = parse_args()
# Before torch loads: OpenBLAS sizes its thread pool at load time.
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(var, str(args.threads))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))

import torch  # noqa: E402

import colibri  # noqa: E402
import colibri.torch as ct  # noqa: E402
import reference_moe  # noqa: E402  (python/tests: the families' reference blocks)


def timed(fn, T):
    """p50 and p90 in ms of fn(); warm-up first, then as many calls as fit
    the budget (at least 5, at most --iters)."""
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    fn()
    one = time.perf_counter() - t0
    n = max(5, min(args.iters, int(args.budget / max(one, 1e-6))))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.9 * len(times)))], n


def main():
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    D, F_, E, k = args.d_model, args.d_ff, args.experts, args.top_k
    # The tests' Mixtral reference block (transformers' MixtralSparseMoeBlock
    # forward), one decoder layer, weights at nn.Linear scale.
    model = reference_moe.make_model("mixtral", seed=args.seed, n_layers=1, D=D, F_=F_, E=E, k=k)
    if args.weights_from:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".experts." in name and p.dim() == 2:
                    rows = p.detach().numpy()
                    q = colibri.quantize(rows, args.weights_from)
                    p.copy_(torch.from_numpy(colibri.dequantize(q, args.weights_from, rows.shape[1])))
    torch_dtype = torch.bfloat16 if args.torch_dtype == "bf16" else torch.float32
    model = model.to(torch_dtype)
    print("# colibri.torch.accelerate vs PyTorch %s %s; E=%d k=%d d_model=%d d_ff=%d; %d threads; experts %s; %s"
          % (torch.__version__, args.torch_dtype, E, k, D, F_, args.threads,
             "%s-dequantised" % args.weights_from if args.weights_from else "random", colibri.library_path()))
    xs = {T: torch.randn(1, T, D).to(torch_dtype) for T in args.tokens}
    rows = []
    with torch.no_grad():
        base = {}
        for T in args.tokens:
            want = model(xs[T])
            p50, p90, n = timed(lambda: model(xs[T]), T)
            base[T] = (p50, want)
            rows.append(("pytorch " + args.torch_dtype, T, p50, p90, n, 1.0, 0.0, ""))
        for dt in args.dtypes:
            report = ct.accelerate(model, dtype=dt, threads=args.threads, keep_pytorch_weights=True)
            assert len(report.accelerated) == 1, report
            kernels = report.models[0].kernels
            for T in args.tokens:
                got = model(xs[T])
                err = float((got.float() - base[T][1].float()).norm() / base[T][1].float().norm())
                p50, p90, n = timed(lambda: model(xs[T]), T)
                rows.append(("colibri %s" % dt, T, p50, p90, n, base[T][0] / p50, err, kernels))
            ct.restore(model)
            for m in report.models:
                m.close()
    print("| engine | T | p50 ms | p90 ms | calls | speed-up vs PyTorch %s | rel. L2 vs PyTorch |" % args.torch_dtype)
    print("|---|---|---|---|---|---|---|")
    for name, T, p50, p90, n, ratio, err, _ in sorted(rows, key=lambda r: (r[1], not r[0].startswith("pytorch"))):
        print("| %s | %d | %.3f | %.3f | %d | %.2fx | %.1e |" % (name, T, p50, p90, n, ratio, err))
    for name, _, _, _, _, _, _, kernels in rows:
        if kernels:
            print("# %s kernels: %s" % (name, kernels))
            break


if __name__ == "__main__":
    main()
