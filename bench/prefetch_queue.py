#!/usr/bin/env python3
"""A call's reads against a queue of prefetches, under a memory budget.

A caller that prefetches a whole layer (colibri_prefetch, or a router
speculation that guessed wrong) queues many reads; the next call needs
other experts now. The cache serves a call's own reads before queued
prefetches (docs/CACHE.md), so the call should take about its own reads,
not the whole queue. Each round: page cache dropped (root), the model
opened cold under --max-resident, every expert of layer 1 prefetched, then
one token timed on layer 0 with --top-k experts none of which is queued.
Compare libraries built before and after a change with COLIBRI_LIBRARY.

  COLIBRI_LIBRARY=build/libcolibri.so \\
    .venv/bin/python bench/prefetch_queue.py --model build/bench-work/cache-l8-e64-d2048-f1024-bf16
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from cache_bench import cpu_model, drop_page_cache  # also puts python/ on sys.path

import colibri  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model directory or GGUF file (2 layers or more)")
    ap.add_argument("--max-resident", default="25%")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    times = []
    for r in range(args.rounds):
        if not drop_page_cache():
            sys.exit("prefetch_queue.py: dropping the page cache needs root")
        m = colibri.Model(args.model, threads=args.threads, verify=False, max_resident=args.max_resident)
        info = m.info
        if info.n_layers < 2 or info.n_experts < args.top_k:
            sys.exit("prefetch_queue.py: the model needs 2 layers and at least --top-k experts")
        rng = np.random.default_rng(r)
        x = rng.standard_normal((1, info.d_model)).astype(np.float32)
        ids = rng.choice(info.n_experts, size=args.top_k, replace=False).astype(np.int32).reshape(1, -1)
        w = np.full((1, args.top_k), 1.0 / args.top_k, np.float32)
        queued = m.prefetch(1, list(range(info.n_experts)))
        t0 = time.perf_counter()
        m.infer(x, ids, w, layer=0)
        times.append((time.perf_counter() - t0) * 1e3)
        s = m.stats
        print("round %d: %d prefetches queued, call %.0f ms (%d reads done by then)"
              % (r, queued, times[-1], s.expert_reads), file=sys.stderr)
        del m
    print(json.dumps({"cpu": cpu_model(), "library": os.environ.get("COLIBRI_LIBRARY", ""), "model": args.model,
                      "max_resident": args.max_resident, "top_k": args.top_k,
                      "call_ms": times, "median_ms": statistics.median(times)}))


if __name__ == "__main__":
    main()
