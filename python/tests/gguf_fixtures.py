"""Small MoE GGUF files written with the gguf package, in the tensor naming
and metadata of each architecture llama.cpp writes, for the GGUF tests.

Weights are random; quantised tensors come from gguf.quants where it can
quantise the type (Q8_0, Q4_0) and from Colibri's quantiser otherwise (the
K formats, which follow ggml's reference quantisation). `write_moe_gguf`
returns the float weights each tensor dequantises to (by the gguf package),
so a test can build a float64 reference from exactly what the file holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q

import colibri

GGUF_TYPE = {
    "f32": Q.F32,
    "f16": Q.F16,
    "bf16": Q.BF16,
    "q8_0": Q.Q8_0,
    "q4_0": Q.Q4_0,
    "q4_k": Q.Q4_K,
    "q5_k": Q.Q5_K,
    "q6_k": Q.Q6_K,
    "mxfp4": Q.MXFP4,
}


def encode(w: np.ndarray, dtype: str, reference: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """float32 [..., n] -> (bytes or floats as the file stores them, the
    float32 values they dequantise to by the gguf package, or None without
    `reference`)."""
    t = GGUF_TYPE[dtype]
    w = np.ascontiguousarray(w, dtype=np.float32)
    if t == Q.F32:
        return w, w
    if t == Q.F16:
        h = w.astype(np.float16)
        return h, h.astype(np.float32)
    if t in (Q.BF16, Q.Q8_0, Q.Q4_0, Q.MXFP4):
        raw = gguf.quants.quantize(w, t)
    else:
        rows = w.reshape(-1, w.shape[-1])
        raw = colibri.quantize(rows, dtype).reshape(*w.shape[:-1], -1)
    return raw, gguf.quants.dequantize(raw, t).astype(np.float32) if reference else None


@dataclass
class Layer:
    gate: np.ndarray  # [E, F, D] float32 as dequantised
    up: np.ndarray
    down: np.ndarray  # [E, D, F]
    router: np.ndarray  # [E, D]
    bias: np.ndarray | None = None  # [E]
    shared_gate_proj: np.ndarray | None = None  # [Fs, D]
    shared_up: np.ndarray | None = None
    shared_down: np.ndarray | None = None  # [D, Fs]
    shared_gate: np.ndarray | None = None  # [D]
    # gpt-oss: expert biases [E, F], [E, F], [E, D] (bias above is the router's)
    gate_bias: np.ndarray | None = None
    up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None


@dataclass
class Fixture:
    path: str
    arch: str
    n_experts: int
    top_k: int
    d_model: int
    d_ff: int
    layers: list[Layer] = field(default_factory=list)
    first_block: int = 0
    norm_topk_prob: bool = False
    shared_d_ff: int = 0


def write_moe_gguf(path, arch="qwen3moe", n_blocks=2, n_experts=8, top_k=2, d_model=256, d_ff=256, dtype="q4_k",
                   down_dtype=None, dense_blocks=0, shared_d_ff=0, fused=False, router_dtype="f32", seed=0,
                   extra_kv=None, split=None, block_down_dtypes=None, reference=True, router_scale=1.0):
    """Writes a GGUF of `n_blocks` blocks, the first `dense_blocks` of which
    hold no experts (with `split`, a split set of at most that many tensors
    per file; fixture.path is then its first file; `block_down_dtypes`: the
    down type of each MoE block, as llama.cpp's Q4_K_M varies it;
    `router_scale` scales the router weights). Returns a
    Fixture with the dequantised weights (None without `reference`: large
    files for benchmarks)."""
    rng = np.random.default_rng(seed)
    down_dtype = down_dtype or dtype
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split or 0)
    w.add_block_count(n_blocks)
    w.add_embedding_length(d_model)
    w.add_expert_count(n_experts)
    w.add_expert_used_count(top_k)
    if arch in ("llama", "olmoe"):
        w.add_feed_forward_length(d_ff)
    else:
        w.add_expert_feed_forward_length(d_ff)
    if dense_blocks:
        w.add_leading_dense_block_count(dense_blocks)
    fix = Fixture(path, arch, n_experts, top_k, d_model, d_ff, first_block=dense_blocks, shared_d_ff=shared_d_ff)
    if arch in ("deepseek2", "glm4moe"):
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_norm(True)
        w.add_expert_weights_scale(2.5)
        w.add_expert_shared_count(1)
    if shared_d_ff and arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(shared_d_ff)
    for key, value in (extra_kv or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, float(value))
    scale = float(1.0 / np.sqrt(d_model))
    for b in range(n_blocks):
        pre = f"blk.{b}."
        if b < dense_blocks:
            # A dense block's FFN, which Colibri skips.
            raw, _ = encode(rng.standard_normal((d_ff, d_model)).astype(np.float32) * scale, "f32")
            w.add_tensor(pre + "ffn_gate.weight", raw)
            continue
        gate = rng.standard_normal((n_experts, d_ff, d_model)).astype(np.float32) * scale
        up = rng.standard_normal((n_experts, d_ff, d_model)).astype(np.float32) * scale
        down = rng.standard_normal((n_experts, d_model, d_ff)).astype(np.float32) * float(1.0 / np.sqrt(d_ff))
        router = (rng.standard_normal((n_experts, d_model)) * router_scale).astype(np.float32)
        layer_down = block_down_dtypes[b - dense_blocks] if block_down_dtypes else down_dtype
        graw, gf = encode(gate, dtype, reference)
        uraw, uf = encode(up, dtype, reference)
        draw, df = encode(down, layer_down, reference)
        rraw, rf = encode(router, router_dtype)
        if fused:
            w.add_tensor(pre + "ffn_gate_up_exps.weight", np.concatenate([graw, uraw], axis=1),
                         raw_dtype=GGUF_TYPE[dtype] if graw.dtype == np.uint8 else None)
        else:
            w.add_tensor(pre + "ffn_gate_exps.weight", graw, raw_dtype=GGUF_TYPE[dtype] if graw.dtype == np.uint8 else None)
            w.add_tensor(pre + "ffn_up_exps.weight", uraw, raw_dtype=GGUF_TYPE[dtype] if uraw.dtype == np.uint8 else None)
        w.add_tensor(pre + "ffn_down_exps.weight", draw,
                     raw_dtype=GGUF_TYPE[layer_down] if draw.dtype == np.uint8 else None)
        w.add_tensor(pre + "ffn_gate_inp.weight", rraw,
                     raw_dtype=GGUF_TYPE[router_dtype] if rraw.dtype == np.uint8 else None)
        layer = Layer(gf, uf, df, rf)
        if arch in ("deepseek2", "glm4moe"):
            layer.bias = (rng.standard_normal(n_experts) * 0.1).astype(np.float32)
            w.add_tensor(pre + "exp_probs_b.bias", layer.bias)
        if arch == "gpt-oss":
            # As llama.cpp's converter writes them: f32, [n_expert, n] in numpy order.
            layer.bias = (rng.standard_normal(n_experts) * 0.5).astype(np.float32)
            w.add_tensor(pre + "ffn_gate_inp.bias", layer.bias)
            for name, n in (("gate", d_ff), ("up", d_ff), ("down", d_model)):
                b = (rng.standard_normal((n_experts, n)) * 1.5).astype(np.float32)
                setattr(layer, name + "_bias", b)
                w.add_tensor(pre + f"ffn_{name}_exps.bias", b)
        if shared_d_ff:
            sg = rng.standard_normal((shared_d_ff, d_model)).astype(np.float32) * scale
            su = rng.standard_normal((shared_d_ff, d_model)).astype(np.float32) * scale
            sd = rng.standard_normal((d_model, shared_d_ff)).astype(np.float32) * float(1.0 / np.sqrt(shared_d_ff))
            for name, m, t in (("ffn_gate_shexp", sg, dtype), ("ffn_up_shexp", su, dtype), ("ffn_down_shexp", sd, layer_down)):
                raw, f = encode(m, t)
                w.add_tensor(pre + name + ".weight", raw, raw_dtype=GGUF_TYPE[t] if raw.dtype == np.uint8 else None)
                if name == "ffn_gate_shexp":
                    layer.shared_gate_proj = f
                elif name == "ffn_up_shexp":
                    layer.shared_up = f
                else:
                    layer.shared_down = f
            if arch == "qwen2moe":
                layer.shared_gate = rng.standard_normal(d_model).astype(np.float32) * scale
                w.add_tensor(pre + "ffn_gate_inp_shexp.weight", layer.shared_gate)
        fix.layers.append(layer)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split:
        import pathlib
        fix.path = str(w.format_shard_names(pathlib.Path(path))[0])
    fix.norm_topk_prob = arch in ("llama", "qwen3moe", "deepseek2", "glm4moe", "gpt-oss")
    return fix


ARCH_OF_FAMILY = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen2_moe_norm": "qwen2moe", "qwen3_moe": "qwen3moe"}


def gguf_from_torch(model, path, family, dtype, down_dtype=None):
    """Writes the MoE blocks of a reference_moe.TinyModel as a GGUF of
    `family`'s architecture (block N = model.layers[N]), experts in
    `dtype`/`down_dtype`, router and shared gate f32, as llama.cpp's
    converter names them. Returns a deep copy of the model whose expert
    weights are what the file dequantises to (the reference)."""
    import copy

    import torch

    down_dtype = down_dtype or dtype
    arch = ARCH_OF_FAMILY[family]
    ref = copy.deepcopy(model)
    layers = ref.layers
    blocks = [getattr(layer, layer.attr) for layer in layers]
    first = blocks[0]
    D = first.gate.weight.shape[1]
    E = first.gate.weight.shape[0]
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    F_ = getattr(first.experts[0], names[0]).weight.shape[0]
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(len(blocks))
    w.add_embedding_length(D)
    w.add_expert_count(E)
    w.add_expert_used_count(first.top_k)
    if arch == "llama":
        w.add_feed_forward_length(F_)
    else:
        w.add_expert_feed_forward_length(F_)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(first.shared_expert.gate_proj.weight.shape[0])
    with torch.no_grad():
        for b, blk in enumerate(blocks):
            pre = f"blk.{b}."
            for name, attr, t in (("ffn_gate_exps", names[0], dtype), ("ffn_up_exps", names[1], dtype),
                                  ("ffn_down_exps", names[2], down_dtype)):
                stacked = torch.stack([getattr(e, attr).weight for e in blk.experts]).float().numpy()
                raw, back = encode(stacked, t)
                w.add_tensor(pre + name + ".weight", raw, raw_dtype=GGUF_TYPE[t] if raw.dtype == np.uint8 else None)
                for e, expert in enumerate(blk.experts):
                    getattr(expert, attr).weight.copy_(torch.from_numpy(back[e]))
            w.add_tensor(pre + "ffn_gate_inp.weight", blk.gate.weight.float().numpy().copy())
            if hasattr(blk, "shared_expert"):
                for name, attr, t in (("ffn_gate_shexp", "gate_proj", dtype), ("ffn_up_shexp", "up_proj", dtype),
                                      ("ffn_down_shexp", "down_proj", down_dtype)):
                    m = getattr(blk.shared_expert, attr).weight.float().numpy()
                    raw, back = encode(m, t)
                    w.add_tensor(pre + name + ".weight", raw, raw_dtype=GGUF_TYPE[t] if raw.dtype == np.uint8 else None)
                    getattr(blk.shared_expert, attr).weight.copy_(torch.from_numpy(back))
                w.add_tensor(pre + "ffn_gate_inp_shexp.weight", blk.shared_expert_gate.weight.float().numpy()[0].copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref
