#!/usr/bin/env python3
"""PyTorch baselines for Colibri: a Hugging Face-style sparse MoE block,
transformers 5's own experts implementations, and torch.compile of the block.

Engines (ENGINES; run_suite.py --torch-baselines picks them):

  eager       the block below, as transformers writes MixtralSparseMoeBlock
  grouped_mm  transformers 5's experts class (Qwen3MoeExperts, from a
              Qwen3MoeConfig of the shape) with experts_implementation
              "grouped_mm" (transformers.integrations.moe): tokens sorted by
              expert, torch's grouped_mm over the stacked weights
  batched_mm  the same class with "batched_mm": each (token, expert) pair's
              weights gathered, one torch.bmm; its gather copies T*k experts
              per call, so large T is skipped (run(max_gather_bytes=...))
  compile     torch.compile (inductor, default options) of the eager block

All four get the same router computation (inside the timed region) and, when
the routing is given, the same experts and weights.

The eager block is the one transformers ships (MixtralSparseMoeBlock; Qwen3-MoE and
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

  bench/pytorch_moe.py --model DIR --routing FILE.route --dtype bfloat16 --threads 2 [--engine grouped_mm]
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


def load_stacked(model_dir, torch_dtype, layer=0):
    """Returns (manifest, gate_up [E][2F][D], down [E][D][F]): the experts'
    weights as torch tensors of torch_dtype in transformers 5's fused layout
    (gate_up_proj = [w1; w3] per expert, down_proj = w2), which its experts
    modules (e.g. Qwen3MoeExperts) hold. One copy serves every engine: the
    per-expert nn.Linear-shaped weights of load_experts are views into it."""
    m = read_manifest(model_dir)
    E, D, F, dt = m["n_experts"], m["d_model"], m["d_ff"], m["dtype"]
    n = 3 * D * F
    gate_up = torch.empty(E, 2 * F, D, dtype=torch_dtype)
    down = torch.empty(E, D, F, dtype=torch_dtype)
    for e in range(E):
        raw = read_expert(expert_path(model_dir, m, layer, e), dt, n)
        if dt == "bf16" and torch_dtype == torch.bfloat16:
            # Bit-exact: reinterpret the uint16 patterns.
            t = torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
        else:
            f32 = bf16_bits_to_f32(raw) if dt == "bf16" else raw.astype(np.float32, copy=False)
            t = torch.from_numpy(f32).to(torch_dtype)
        del raw
        # File order: w1 (gate) [F][D], w3 (up) [F][D], w2 (down) [D][F].
        gate_up[e].copy_(t[: 2 * D * F].view(2 * F, D))
        down[e].copy_(t[2 * D * F :].view(D, F))
        del t
    return m, gate_up, down


def experts_of(gate_up, down):
    """[(w1, w3, w2)] per expert, shaped as nn.Linear weights ([out][in]):
    contiguous views into the stacked tensors (each an ordinary dense
    matrix, 64-byte aligned as long as D*F is a multiple of 16)."""
    F = down.shape[2]
    return [(gate_up[e, :F], gate_up[e, F:], down[e]) for e in range(gate_up.shape[0])]


def load_experts(model_dir, torch_dtype, layer=0):
    """Returns (manifest, [(w1, w3, w2)] per expert) as torch tensors of
    torch_dtype, shaped as nn.Linear weights ([out][in])."""
    m, gate_up, down = load_stacked(model_dir, torch_dtype, layer)
    return m, experts_of(gate_up, down)


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



def route(hidden, gate, top_k):
    """Mixtral's router, as the HF block computes it: (ids [T, k], weights
    float32 [T, k]) from softmax(hidden . gate^T), renormalised over the top k."""
    import torch
    F = torch.nn.functional
    probs = F.softmax(F.linear(hidden, gate), dim=1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True)

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
        selected_experts, routing_weights = route(hidden, self.gate, self.top_k)
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


# The engines run_suite.py can measure, in the order it runs them. "eager" is
# SparseMoeBlock above; "grouped_mm" and "batched_mm" are transformers 5's own
# experts implementations (transformers.integrations.moe) run by its real
# experts class; "compile" is torch.compile of SparseMoeBlock.
ENGINES = ("eager", "grouped_mm", "batched_mm", "compile")
ENGINE_TEXT = {
    "eager": "HF-style sparse MoE block (loop over the experts hit, index_add_)",
    "grouped_mm": "transformers 5 Qwen3MoeExperts, experts_implementation=grouped_mm (sort by expert, "
                  "torch grouped_mm over all experts' stacked weights)",
    "batched_mm": "transformers 5 Qwen3MoeExperts, experts_implementation=batched_mm (gathers each "
                  "(token, expert) pair's weights, torch.bmm)",
    "compile": "torch.compile (inductor, default mode) of the HF-style block",
}


class ExpertsModuleBlock:
    """SparseMoeBlock's router, then the experts computed by transformers 5's
    own experts module: transformers.models.qwen3_moe Qwen3MoeExperts built
    from a Qwen3MoeConfig of this shape (Mixtral's and OLMoE's experts classes
    are the same code under other names), holding the suite's weights as its
    gate_up_proj [E][2F][D] and down_proj [E][D][F], with
    config._experts_implementation = implementation ("eager", "grouped_mm" or
    "batched_mm"), which its forward dispatches on through
    transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS."""

    def __init__(self, gate_up, down, top_k, implementation, seed=0):
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        E, F2, D = gate_up.shape
        self.n_experts, self.top_k, self.dtype = E, top_k, gate_up.dtype
        cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F2 // 2, num_experts=E,
                             num_experts_per_tok=top_k, hidden_act="silu", norm_topk_prob=True)
        cfg._experts_implementation = implementation
        with torch.device("meta"):  # no [E][2F][D] allocation; the parameters are set below
            experts = Qwen3MoeExperts(cfg)
        experts.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
        experts.down_proj = torch.nn.Parameter(down, requires_grad=False)
        self.experts = experts.eval()
        self.implementation = cfg._experts_implementation
        g = torch.Generator().manual_seed(seed)
        self.gate = (torch.randn(E, D, generator=g) * D**-0.5).to(self.dtype)

    def __call__(self, hidden, given_ids=None, given_weights=None):
        selected_experts, routing_weights = route(hidden, self.gate, self.top_k)
        if given_ids is not None:
            selected_experts, routing_weights = given_ids, given_weights
        return self.experts(hidden, selected_experts, routing_weights.to(hidden.dtype))


def batched_mm_gather_bytes(T, k, d_model, d_ff, dtype):
    """Bytes batched_mm copies per call: it gathers the full weights of every
    (token, expert) pair (gate_up_proj[expert_ids], down_proj[expert_ids])
    before one torch.bmm, e.g. 180 GB for mixtral at T=128 in fp32."""
    return T * k * 3 * d_model * d_ff * torch.tensor([], dtype=dtype).element_size()


def dynamo_summary():
    """What torch._dynamo did since its last reset: graphs compiled, graph
    breaks (with their reasons) and frames it gave up on."""
    from torch._dynamo.utils import counters

    out = {"stats": dict(counters.get("stats", {})),
           "graph_breaks": int(sum(counters.get("graph_break", {}).values())),
           "graph_break_reasons": sorted({str(k)[:160] for k in counters.get("graph_break", {})})[:8]}
    for key in ("recompiles", "frames", "unimplemented"):
        if counters.get(key):
            out[key] = {str(k)[:160]: v for k, v in list(counters[key].items())[:8]}
    return out


def make_block(engine, gate_up, down, top_k, seed=0):
    """The callable block(hidden, ids, weights) of one engine (ENGINES) on the
    stacked weights."""
    E, _, D = gate_up.shape
    if engine in ("eager", "compile"):
        block = SparseMoeBlock(experts_of(gate_up, down), E, D, top_k, gate_up.dtype, seed)
        if engine == "compile":
            # The bound method: dynamo traces the block's own forward. The
            # loop over the experts hit is data-dependent (a .tolist() and
            # torch.where), so dynamo breaks the graph there: this measures
            # what torch.compile makes of the block as transformers writes it.
            return torch.compile(block.__call__)
        return block
    if engine in ("grouped_mm", "batched_mm"):
        return ExpertsModuleBlock(gate_up, down, top_k, engine, seed)
    raise ValueError("unknown engine %r (known: %s)" % (engine, ", ".join(ENGINES)))


# The weights of the last (model, dtype) loaded, kept between run() calls
# with keep_loaded=True, so each engine of one dtype is its own measurement
# (and can be repeated) without reading and converting the files again.
_LOADED = {}


def release():
    """Frees the weights kept by run(..., keep_loaded=True)."""
    _LOADED.clear()
    gc.collect()


def loaded(model_dir, dtype):
    """(manifest, gate_up, down, load_s) of model_dir in dtype, loaded once."""
    key = (os.path.realpath(model_dir), str(dtype))
    if _LOADED.get("key") != key:
        release()  # one model's weights in memory at a time
        t0 = time.perf_counter()
        m, gate_up, down = load_stacked(model_dir, dtype)
        _LOADED.update(key=key, value=(m, gate_up, down, time.perf_counter() - t0))
    return _LOADED["value"]


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


def run(model_dir, routes, dtype_name, threads, iters, warmup, max_seconds=None, seed=0, engine="eager",
        keep_loaded=False, max_gather_bytes=None):
    """Loads the model in dtype_name ('float32'/'bfloat16') (or reuses the
    weights kept by an earlier keep_loaded call), times one engine's block
    (ENGINES) for every routing in routes, then frees the weights unless
    keep_loaded. Each route is a dict: label; ids [T][k] and weights [T][k]
    (or lists of such arrays, cycled one per call); optionally iters
    (overrides iters); optionally x, a float32 [T][d_model] input whose
    output (first routing) is returned as "output" for a correctness check.
    Returns {label: latency dict}; a route the engine cannot run here (only
    batched_mm, when its per-call weight gather would exceed
    max_gather_bytes) gets {"skipped": reason} instead. For "compile" each
    latency dict also has compile_s (the label's first call, which compiles
    for its shapes) and dynamo (graphs, graph breaks); its warm-up covers
    every routing, so recompilations are not timed."""
    import_torch(threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    m, gate_up, down, load_s = loaded(model_dir, dtype)
    results = {}
    blocks = {}
    try:
        if engine == "compile":
            torch._dynamo.reset()  # no code cached for another shape or dtype
            from torch._dynamo.utils import counters

            counters.clear()
        for r in routes:
            many = isinstance(r["ids"], (list, tuple))
            ids = [torch.from_numpy(i) for i in r["ids"]] if many else torch.from_numpy(r["ids"])
            weights = [torch.from_numpy(w) for w in r["weights"]] if many else torch.from_numpy(r["weights"])
            T, k = (ids[0] if many else ids).shape
            if engine == "batched_mm" and max_gather_bytes is not None:
                need = batched_mm_gather_bytes(T, k, m["d_model"], m["d_ff"], dtype)
                if need > max_gather_bytes:
                    results[r["label"]] = {"skipped": "batched_mm would gather %.1f GB of weights per call "
                                                      "(T=%d x top-%d copies of an expert), over the %.1f GB cap"
                                                      % (need / 1e9, T, k, max_gather_bytes / 1e9)}
                    continue
            if k not in blocks:
                blocks[k] = make_block(engine, gate_up, down, k, seed)
            block = blocks[k]
            g = torch.Generator().manual_seed(seed + 1)
            hidden = (torch.rand(T, m["d_model"], generator=g) * 2 - 1).to(dtype)
            wu, extra = warmup, {}
            if engine == "compile":
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    block(hidden, ids[0] if many else ids, weights[0] if many else weights)
                    extra["compile_s"] = time.perf_counter() - t0
                # Every routing once before timing: a new routing may recompile.
                wu = max(warmup, len(ids) if many else 1)
            res = time_block(block, hidden, ids, weights, r.get("iters", iters), wu, max_seconds)
            res["load_s"] = load_s
            res.update(extra)
            if engine == "compile":
                res["dynamo"] = dynamo_summary()
            if engine in ("grouped_mm", "batched_mm"):
                res["experts_implementation"] = block.implementation
            if r.get("x") is not None:
                with torch.inference_mode():
                    y = block(torch.from_numpy(r["x"]).to(dtype), ids[0] if many else ids,
                              weights[0] if many else weights)
                res["output"] = y.float().numpy()
            results[r["label"]] = res
            del hidden
    finally:
        del blocks
        if not keep_loaded:
            del gate_up, down
            release()
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Colibri model directory")
    ap.add_argument("--routing", required=True, help=".route text file")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--engine", choices=ENGINES, default="eager", help="which PyTorch implementation")
    a = ap.parse_args(argv)
    import_torch(a.threads)
    ids, w = read_route(a.routing)
    r = run(a.model, [{"label": "routing", "ids": ids, "weights": w}], a.dtype, a.threads, a.iters, a.warmup,
            engine=a.engine)["routing"]
    r["torch"] = torch_info()
    del r["torch"]["parallel_info"]
    print(json.dumps(r, indent=2))


if __name__ == "__main__":
    sys.exit(main())
