#!/usr/bin/env python3
"""PyTorch baseline for Colibri: a Hugging Face-style sparse MoE block.

The block is the one transformers ships (MixtralSparseMoeBlock; Qwen3-MoE and
OLMoE use the same structure): router linear -> softmax in fp32 -> top-k ->
renormalise -> loop over the experts hit, each selecting its tokens with
`torch.where` on the one-hot expert mask -> SwiGLU expert
w2(silu(w1 x) * w3 x) -> times the routing weight -> `index_add_` into the
output.

Weights come from a Colibri model directory (docs/FORMAT.md), so PyTorch and
Colibri multiply exactly the same numbers. The routing can be GIVEN (expert ids
and weights, e.g. read from the .route file Colibri is benchmarked with): the
router linear, softmax and top-k still run inside the timed region, because a
real MoE layer pays for them, but their result is then replaced by the given
routing so both engines run the same experts for the same tokens.

Used as a module by run_suite.py; also runnable on its own:

  bench/pytorch_moe.py --model DIR --routing FILE.route --dtype bfloat16 --threads 2
"""

import argparse
import gc
import json
import os
import sys
import time

import numpy as np

torch = None  # imported by import_torch(), after the thread variables are set


def import_torch(threads):
    """Imports torch with OpenMP and OpenBLAS limited to `threads`.

    The variables must be set before the libraries start: OpenBLAS sizes its
    pthread pool at load time, and torch.set_num_threads only governs ATen's
    OpenMP pool, not the BLAS that runs fp32 matmuls here.
    """
    global torch
    if torch is None:
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, str(threads))
        import torch as _torch

        torch = _torch
    torch.set_num_threads(threads)
    return torch


# --------------------------------------------------------------- model files


def read_manifest(model_dir):
    with open(os.path.join(model_dir, "colibri.json")) as f:
        return json.load(f)


def expert_path(model_dir, manifest, layer, expert):
    if manifest["n_layers"] > 1:
        return os.path.join(model_dir, "layer_%02d" % layer, "expert_%02d.bin" % expert)
    return os.path.join(model_dir, "expert_%02d.bin" % expert)


def read_expert(path, dtype, n):
    """One expert file as a numpy array of n values: float32 for f32/f16, the
    raw uint16 bit patterns for bf16 (numpy has no bfloat16)."""
    if dtype == "f32":
        a = np.fromfile(path, dtype="<f4")
    elif dtype == "f16":
        a = np.fromfile(path, dtype="<f2")
    elif dtype == "bf16":
        a = np.fromfile(path, dtype="<u2")
    else:
        raise ValueError("%s: unknown dtype %r" % (path, dtype))
    if a.size != n:
        raise ValueError("%s: %d values, expected 3*d_model*d_ff = %d" % (path, a.size, n))
    return a


def bf16_bits_to_f32(u16):
    # bf16 is the top half of an fp32: widening is a 16-bit shift, exact.
    return (u16.astype(np.uint32) << 16).view(np.float32)


def load_experts(model_dir, torch_dtype, layer=0):
    """Returns (manifest, [(w1, w3, w2)] per expert) as torch tensors of
    torch_dtype, shaped as nn.Linear weights ([out][in])."""
    m = read_manifest(model_dir)
    D, F, dt = m["d_model"], m["d_ff"], m["dtype"]
    n = 3 * D * F
    experts = []
    for e in range(m["n_experts"]):
        raw = read_expert(expert_path(model_dir, m, layer, e), dt, n)
        if dt == "bf16" and torch_dtype == torch.bfloat16:
            # Bit-exact and zero-copy: reinterpret the uint16 patterns.
            t = torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
        else:
            f32 = bf16_bits_to_f32(raw) if dt == "bf16" else raw.astype(np.float32, copy=False)
            t = torch.from_numpy(f32).to(torch_dtype)
        del raw
        # .contiguous() copies each matrix out of the file-sized buffer, so
        # the buffer is freed and each weight is an ordinary dense tensor.
        w1 = t[: D * F].view(F, D).contiguous()
        w3 = t[D * F : 2 * D * F].view(F, D).contiguous()
        w2 = t[2 * D * F :].view(D, F).contiguous()
        del t
        experts.append((w1, w3, w2))
    return m, experts


# ------------------------------------------------------------------ routing


def read_route(path):
    """Parses .route text (docs/FORMAT.md) into (ids [T][k] int64, weights
    [T][k] float32), rows ordered by token id. Weights are parsed as float32
    from the same decimal text Colibri's compiler reads, so both get the same
    values when the text was written with 9 significant digits."""
    rows = {}
    k = None
    with open(path) as f:
        for line in f:
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            cols = [c.strip() for c in s.split(",")]
            kk = (len(cols) - 1) // 2
            if k is None:
                k = kk
            rows[int(cols[0])] = (
                [int(c) for c in cols[1 : 1 + kk]],
                [np.float32(float(c)) for c in cols[1 + kk :]],
            )
    T = len(rows)
    ids = np.array([rows[t][0] for t in range(T)], dtype=np.int64).reshape(T, k)
    w = np.array([rows[t][1] for t in range(T)], dtype=np.float32).reshape(T, k)
    return ids, w


# -------------------------------------------------------------------- block


class SparseMoeBlock:
    """transformers' MixtralSparseMoeBlock.forward, with the experts' weights
    held as plain tensors and an optional given routing."""

    def __init__(self, experts, n_experts, d_model, top_k, dtype, seed=0):
        self.experts = experts
        self.n_experts = n_experts
        self.top_k = top_k
        self.dtype = dtype
        g = torch.Generator().manual_seed(seed)
        # The router's weights play no part in the result when the routing is
        # given; they only cost what a real router costs.
        self.gate = (torch.randn(n_experts, d_model, generator=g) * d_model**-0.5).to(dtype)

    def __call__(self, hidden, given_ids=None, given_weights=None):
        F = torch.nn.functional
        T, D = hidden.shape
        router_logits = F.linear(hidden, self.gate)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        if given_ids is not None:
            # Same experts and weights as Colibri gets (see module docstring).
            selected_experts, routing_weights = given_ids, given_weights
        routing_weights = routing_weights.to(hidden.dtype)

        final = torch.zeros((T, D), dtype=hidden.dtype)
        expert_mask = F.one_hot(selected_experts, num_classes=self.n_experts).permute(2, 1, 0)
        # Current transformers loops over the experts that were hit only;
        # older releases looped over all of them, slower for 128 experts.
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in expert_hit.flatten().tolist():
            w1, w3, w2 = self.experts[e]
            idx, top_x = torch.where(expert_mask[e])
            current_state = hidden[None, top_x].reshape(-1, D)
            h = F.silu(F.linear(current_state, w1)) * F.linear(current_state, w3)
            current = F.linear(h, w2) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, current.to(hidden.dtype))
        return final


def percentile(sorted_s, q):
    """Nearest-rank percentile, as colibri bench reports it."""
    if not sorted_s:
        return float("nan")
    i = min(len(sorted_s) - 1, max(0, int(np.ceil(q / 100.0 * len(sorted_s))) - 1))
    return sorted_s[i]


def time_block(block, hidden, ids, weights, iters, warmup, max_seconds=None):
    """Times block(hidden, ids, weights). ids and weights may be lists of
    routings, used in turn one per call (as successive decode steps hit
    different experts). Returns a dict of latency figures in ms. max_seconds
    caps the timed iterations (at least 3) for slow shapes."""
    if not isinstance(ids, (list, tuple)):
        ids, weights = [ids], [weights]
    n = len(ids)
    with torch.inference_mode():
        t_warm = 0.0
        for i in range(warmup):
            t0 = time.perf_counter()
            block(hidden, ids[i % n], weights[i % n])
            t_warm = time.perf_counter() - t0
        if max_seconds and t_warm > 0:
            iters = max(3, min(iters, int(max_seconds / t_warm)))
        s = []
        for i in range(iters):
            r = (warmup + i) % n
            t0 = time.perf_counter()
            block(hidden, ids[r], weights[r])
            s.append(time.perf_counter() - t0)
    s.sort()
    return {
        "iters": iters,
        "warmup": warmup,
        "routings": n,
        "p50_ms": percentile(s, 50) * 1e3,
        "p90_ms": percentile(s, 90) * 1e3,
        "p99_ms": percentile(s, 99) * 1e3,
        "min_ms": s[0] * 1e3,
        "mean_ms": sum(s) / len(s) * 1e3,
        "max_ms": s[-1] * 1e3,
        "tokens_per_s": hidden.shape[0] / percentile(s, 50),
    }


def torch_info():
    """Thread counts torch reports (parallel_info is text) and the BLAS and
    oneDNN it runs on."""
    info = torch.__config__.parallel_info()
    out = {"version": torch.__version__, "get_num_threads": torch.get_num_threads()}
    for line in info.splitlines():
        line = line.strip()
        if line.startswith("at::get_num_threads()"):
            out["parallel_info_threads"] = int(line.rsplit(":", 1)[1])
        elif line.startswith("omp_get_max_threads()"):
            out["omp_max_threads"] = int(line.rsplit(":", 1)[1])
        elif line.startswith("ATen parallel backend"):
            out["parallel_backend"] = line.split(":", 1)[1].strip()
    out["parallel_info"] = info
    out["mkldnn"] = bool(torch.backends.mkldnn.is_available())
    libs = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split()[-1]
                if any(x in p for x in ("blas", "lapack", "dnnl", "mkldnn", "gomp")):
                    libs.add(os.path.realpath(p))
    except OSError:
        pass
    out["libraries"] = sorted(libs)
    return out


def run(model_dir, routes, dtype_name, threads, iters, warmup, max_seconds=None, seed=0):
    """Loads the model once in dtype_name ('float32'/'bfloat16'), times the
    block for every routing in routes, then frees the weights. Each route is
    a dict: label; ids [T][k] and weights [T][k] (or lists of such arrays,
    cycled one per call); optionally iters (overrides iters); optionally x, a
    float32 [T][d_model] input whose output (first routing) is returned as
    "output" for a correctness check. Returns {label: latency dict}."""
    import_torch(threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    t0 = time.perf_counter()
    m, experts = load_experts(model_dir, dtype)
    load_s = time.perf_counter() - t0
    results = {}
    try:
        for r in routes:
            many = isinstance(r["ids"], (list, tuple))
            ids = [torch.from_numpy(i) for i in r["ids"]] if many else torch.from_numpy(r["ids"])
            weights = [torch.from_numpy(w) for w in r["weights"]] if many else torch.from_numpy(r["weights"])
            T, k = (ids[0] if many else ids).shape
            block = SparseMoeBlock(experts, m["n_experts"], m["d_model"], k, dtype, seed)
            g = torch.Generator().manual_seed(seed + 1)
            hidden = (torch.rand(T, m["d_model"], generator=g) * 2 - 1).to(dtype)
            res = time_block(block, hidden, ids, weights, r.get("iters", iters), warmup, max_seconds)
            res["load_s"] = load_s
            if r.get("x") is not None:
                with torch.inference_mode():
                    y = block(torch.from_numpy(r["x"]).to(dtype), ids[0] if many else ids, weights[0] if many else weights)
                res["output"] = y.float().numpy()
            results[r["label"]] = res
            del block, hidden
    finally:
        del experts
        gc.collect()
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Colibri model directory")
    ap.add_argument("--routing", required=True, help=".route text file")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args(argv)
    import_torch(a.threads)
    ids, w = read_route(a.routing)
    r = run(a.model, [{"label": "routing", "ids": ids, "weights": w}], a.dtype, a.threads, a.iters, a.warmup)["routing"]
    r["torch"] = torch_info()
    del r["torch"]["parallel_info"]
    print(json.dumps(r, indent=2))


if __name__ == "__main__":
    sys.exit(main())
