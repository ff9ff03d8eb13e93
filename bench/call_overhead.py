#!/usr/bin/env python3
"""The fixed cost of one Colibri call from Python, on layers so small that
the kernels take about a microsecond: what a decode step pays per MoE
block and per projection beyond the C call itself.

  COLIBRI_LIBRARY=build/libcolibri.so PYTHONPATH=python \\
      .venv/bin/python bench/call_overhead.py [--calls 20000]

Paths, each the median of 5 runs of --calls calls (µs per call):
  raw C infer          colibri_infer through ctypes with a prepared struct (the floor)
  Model.infer          the NumPy/tensor API with every check (dtype, shape, overlap)
  ColibriExperts       the module's forward with ids (accelerate()'s path)
  built-in router      colibri.nn.run_moe (from_pretrained's MoE blocks)
  colibri::moe op      the same through the custom operator, eager
  Linear               colibri.nn.Linear forward
  colibri::linear op   the same through the custom operator, eager
"""

import argparse
import ctypes
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import colibri  # noqa: E402
import colibri.nn as cnn  # noqa: E402
import colibri.torch as ct  # noqa: E402
from colibri import _lib as L  # noqa: E402
from cache_bench import cpu_model  # noqa: E402


def per_call(fn, calls):
    for _ in range(min(1000, calls)):
        fn()
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(runs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    a = ap.parse_args()
    torch.set_num_threads(1)
    E, D, F, k = 8, 64, 64, 2
    g = torch.randn(E, F, D) * 0.1
    u = torch.randn(E, F, D) * 0.1
    d = torch.randn(E, D, F) * 0.1
    router = torch.randn(E, D)
    experts = ct.ColibriExperts(g, u, d, router=router, router_config={"family": "mixtral", "top_k": k}, threads=1)
    model = experts.colibri_model
    x = torch.randn(1, D)
    ids = torch.tensor([[1, 5]])
    w = torch.rand(1, k)
    ids32 = ids.to(torch.int32)
    out = torch.empty_like(x)
    args = L.InferArgs()
    args.layer, args.n_tokens, args.top_k = 0, 1, k
    args.input, args.output = x.data_ptr(), out.data_ptr()
    args.expert_ids, args.expert_weights = ids32.data_ptr(), w.data_ptr()
    infer, ref, h = L.lib().colibri_infer, ctypes.byref(args), model._handle
    key = cnn.moe_key(model)
    lin = cnn.Linear(torch.randn(64, 64), None, 64, 64, quantize="q8_0", threads=1)
    rows = [
        ("raw C infer", lambda: infer(h, ref)),
        ("Model.infer", lambda: model.infer(x, ids32, w)),
        ("ColibriExperts", lambda: experts(x, ids, w)),
        ("built-in router", lambda: cnn.run_moe(model, 0, x)),
        ("colibri::moe op", lambda: torch.ops.colibri.moe(x, key, 0)),
        ("Linear", lambda: lin(x)),
        ("colibri::linear op", lambda: torch.ops.colibri.linear(x, lin._handle)),
    ]
    print("CPU: %s; colibri %s; %d calls x 5" % (cpu_model(), colibri.library_version(), a.calls))
    print("| path | µs per call |\n|---|---|")
    with torch.inference_mode():
        for name, fn in rows:
            print("| %s | %.1f |" % (name, per_call(fn, a.calls)))


if __name__ == "__main__":
    main()
