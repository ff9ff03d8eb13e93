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
    "q4_1": Q.Q4_1,
    "q5_0": Q.Q5_0,
    "q5_1": Q.Q5_1,
    "iq4_nl": Q.IQ4_NL,
    "iq4_xs": Q.IQ4_XS,
    "q2_k": Q.Q2_K,
    "q3_k": Q.Q3_K,
    "iq2_xxs": Q.IQ2_XXS,
    "iq3_xxs": Q.IQ3_XXS,
    "iq1_s": Q.IQ1_S,
    "iq1_m": Q.IQ1_M,
    "iq2_xs": Q.IQ2_XS,
    "iq2_s": Q.IQ2_S,
    "iq3_s": Q.IQ3_S,
    "tq1_0": Q.TQ1_0,
    "tq2_0": Q.TQ2_0,
}


# The grid i-quants (read, not made): block bytes and the mean magnitude of
# a value per unit of d (IQ2_XXS: grid values about 20 times sub-scales
# (0.5 + ls) / 4 about 2; IQ3_XXS: about 30 times (0.5 + ls) / 2 about 4;
# IQ1: |g +- 1/8| about 0.6 times 2 s + 1 about 8).
_GRID_BLOCKS = {"iq2_xxs": (66, 40.0), "iq3_xxs": (98, 120.0), "iq1_s": (50, 5.0), "iq1_m": (56, 5.0),
                "iq2_xs": (74, 40.0), "iq2_s": (82, 40.0), "iq3_s": (110, 120.0)}


def _random_grid_blocks(dtype, shape, magnitude, seed=7):
    """uint8 [..., n / 256 * block bytes]: blocks of random grid points,
    signs, shifts and sub-scales, d such that the mean magnitude is about
    `magnitude`."""
    block_bytes, per_d = _GRID_BLOCKS[dtype]
    rng = np.random.default_rng(seed + int(np.prod(shape)))
    rows = int(np.prod(shape[:-1]))
    blocks = rows * (shape[-1] // 256)
    raw = rng.integers(0, 256, (blocks, block_bytes), dtype=np.uint8)
    d = np.full(blocks, magnitude / per_d, np.float16).view("<u2")
    if dtype == "iq1_m":
        # d's four nibbles in the top of the four scale words.
        words = raw[:, 48:56].copy().view("<u2")
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        raw[:, 48:56] = words.view(np.uint8)
    else:
        raw[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(*shape[:-1], -1)


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
    if t in (Q.BF16, Q.Q8_0, Q.Q4_0, Q.MXFP4, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.TQ1_0, Q.TQ2_0):
        raw = gguf.quants.quantize(w, t)
    elif dtype in _GRID_BLOCKS:
        # Read, not made (no quantiser without an importance matrix): random
        # grid blocks with a scale that gives values of w's magnitude; the
        # reference is what they dequantise to.
        raw = _random_grid_blocks(dtype, w.shape, float(np.abs(w).mean()) if w.size else 0.0)
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


# ---------------------------------------------------------------- whole models
# What each architecture's llama.cpp loader (src/models/<arch>.cpp) requires,
# beyond the attention + MoE skeleton they share:
#   ff_key     the key holding the expert width: "expert" (expert_feed_forward_length)
#              or "ff" (feed_forward_length: llama, olmoe)
#   qk_norm    RMS norms on q and k: per head ("head", [head_dim]) or over the
#              whole projection ("full", [n_heads * head_dim] / [n_kv * head_dim])
#   qkv_bias, o_bias, sinks, router_bias, expert_bias, shexp: tensors it has
#   ffn_norm   the pre-MoE norm's tensor (gpt-oss calls it post_attention_norm)
#   q_is_d     attn_q/attn_output must be [d_model, d_model] (n_heads*head_dim == d_model)
#   kv_full    n_kv_heads must equal n_heads (olmoe's k_norm is [d_model])
#   tie_ok     output.weight may be left out (tied to token_embd)
#   norm_topk  whether llama.cpp renormalises the top-k softmax weights
#   gating     "softmax" (softmax over all experts, then top-k) or
#              "softmax_weight" (top-k of the logits, softmax over those k)
#   rope       "neox" (rotate halves) or "norm" (rotate adjacent pairs)
#   swa        sliding window on even layers (layer i is SWA when i % 2 == 0)
#   pre        tokenizer.ggml.pre; theta, eps: rope base and RMS eps defaults
_ARCH = {
    "qwen3moe": dict(ff_key="expert", qk_norm="head", ffn_norm="ffn_norm", tie_ok=True, norm_topk=True,
                     rope="neox", pre="qwen2", theta=1e6, eps=1e-6),
    "qwen2moe": dict(ff_key="expert", qkv_bias=True, shexp=True, q_is_d=True, ffn_norm="ffn_norm",
                     norm_topk=False, rope="neox", pre="qwen2", theta=1e6, eps=1e-6),
    "olmoe": dict(ff_key="ff", qk_norm="full", q_is_d=True, kv_full=True, ffn_norm="ffn_norm",
                  norm_topk=False, rope="neox", pre="olmo", theta=1e4, eps=1e-5),
    "llama": dict(ff_key="ff", ffn_norm="ffn_norm", tie_ok=True, norm_topk=True, rope="norm", pre="default",
                  theta=1e6, eps=1e-5),
    "gpt-oss": dict(ff_key="expert", qkv_bias=True, o_bias=True, sinks=True, router_bias=True, expert_bias=True,
                    ffn_norm="post_attention_norm", norm_topk=True, gating="softmax_weight", rope="neox", swa=True,
                    pre="gpt-4o", theta=150000.0, eps=1e-5, experts=("mxfp4", "mxfp4", "mxfp4")),
    # GLM-4.5: q/k/v biases, partial NeoX rope (half of each head), DeepSeek-V3's
    # router (sigmoid, selection bias exp_probs_b, renormalised, scaled), one
    # shared expert, a leading dense block, trailing nextn (MTP) blocks.
    "glm4moe": dict(ff_key="expert", qkv_bias=True, shexp_count=True, ffn_norm="post_attention_norm", norm_topk=True,
                    gating="sigmoid", probs_bias=True, rope="neox", partial_rope=0.5, pre="glm4", theta=1e6,
                    eps=1e-5),
    # DeepSeek-V2/V3 (and Kimi K2): multi-head latent attention stored as
    # llama.cpp's converter writes it today (kv_b split into attn_k_b, per
    # head transposed, and attn_v_b; head_count_kv 1), adjacent-pair rope on
    # the rope part. gating "sigmoid" with exp_probs_b is V3's router,
    # "softmax" V2's.
    "deepseek2": dict(ff_key="expert", mla=True, shexp_count=True, ffn_norm="ffn_norm", norm_topk=True,
                      gating="sigmoid", probs_bias=True, rope="norm", pre="deepseek-v3", theta=1e4, eps=1e-6),
}

# A K-format row must be a whole number of 256-value super-blocks, the others
# of 32-value blocks; a tensor whose rows are not is stored in the fallback
# (llama.cpp's quantiser falls back likewise, Q6_K -> Q8_0).
_BLOCK = {"q4_k": 256, "q5_k": 256, "q6_k": 256, "q8_0": 32, "q4_0": 32, "mxfp4": 32, "q4_1": 32, "q5_0": 32,
          "q5_1": 32, "iq4_nl": 32, "iq4_xs": 256, "q2_k": 256, "q3_k": 256, "iq2_xxs": 256,
          "iq3_xxs": 256, "iq1_s": 256, "iq1_m": 256, "iq2_xs": 256, "iq2_s": 256, "iq3_s": 256,
          "tq1_0": 256, "tq2_0": 256}

_FILE_TYPE = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
              "q4_0": "MOSTLY_Q4_0", "q4_k": "MOSTLY_Q4_K_M", "q5_k": "MOSTLY_Q5_K_M", "q6_k": "MOSTLY_Q6_K",
              "mxfp4": "MOSTLY_MXFP4_MOE", "q4_1": "MOSTLY_Q4_1", "q5_0": "MOSTLY_Q5_0", "q5_1": "MOSTLY_Q5_1",
              "iq4_nl": "MOSTLY_IQ4_NL", "iq4_xs": "MOSTLY_IQ4_XS", "q2_k": "MOSTLY_Q2_K", "q3_k": "MOSTLY_Q3_K_M",
              "iq2_xxs": "MOSTLY_IQ2_XXS", "iq3_xxs": "MOSTLY_IQ3_XXS", "iq1_s": "MOSTLY_IQ1_S",
              "iq1_m": "MOSTLY_IQ1_M", "iq2_xs": "MOSTLY_IQ2_XS", "iq2_s": "MOSTLY_IQ2_S", "iq3_s": "MOSTLY_IQ3_S",
              "tq1_0": "MOSTLY_TQ1_0", "tq2_0": "MOSTLY_TQ2_0"}


def _byte_level_vocab(n: int, specials=("<|endoftext|>", "<|startoftext|>")):
    """A byte-level BPE vocabulary of n tokens as GPT-2 writes it: the 256
    byte characters, merges of "Ġ"/letter prefixes with letters (each merge
    joins two tokens already in the vocabulary) and `specials` last.
    Returns (tokens, token types, merges)."""
    if n < 256 + len(specials):
        raise ValueError(f"vocab must be at least {256 + len(specials)}")
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = iter(range(256, 512))
    chars = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}
    tokens = [chars[b] for b in range(256)]
    have, merges = set(tokens), []
    letters = "etaoinsrhldcumfpgwybvkxjqz"
    lefts = [chars[ord(" ")]] + list(letters)
    i = 0
    while len(tokens) < n - len(specials):
        left = lefts[i]
        i += 1
        for right in letters:
            if len(tokens) == n - len(specials):
                break
            if left + right not in have:
                have.add(left + right)
                tokens.append(left + right)
                lefts.append(left + right)
                merges.append(f"{left} {right}")
    types = [gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * len(specials)
    return tokens + list(specials), types, merges


def write_model_gguf(path, arch, *, n_blocks, d_model, n_experts, top_k, d_ff, n_heads, n_kv_heads, head_dim, vocab,
                     expert_types=None, attn_type="q8_0", embd_type="q8_0", head_type="q8_0", router_type="f32",
                     seed=0, tie_embeddings=False, n_dense_blocks=0, dense_d_ff=None, shared_d_ff=0,
                     rope_theta=None, rms_eps=None, context_length=4096, sliding_window=128,
                     reference=True, extra_kv=None, omit=(), shapes=None, router_scale=1.0, mla=None,
                     gating=None, weights_scale=1.0, nextn=0, kv_b_split=True):
    """Writes a complete model GGUF of `arch` (qwen3moe, qwen2moe, olmoe,
    llama with experts = Mixtral, gpt-oss, glm4moe, deepseek2): embeddings, every block's
    attention and MoE, output norm and head, hyperparameters and a small
    byte-level BPE tokenizer, named as llama.cpp's converter names them, so
    llama.cpp loads and runs it.

    expert_types: (gate, up, down) of the experts (and shared expert / dense
    FFN); default Q4_K, Q4_K, Q6_K (llama.cpp's Q4_K_M), MXFP4 for gpt-oss.
    Norms, biases, sinks and the router (`router_type`) are F32. Rows a type
    cannot hold (a 128-wide Q6_K row) fall back to Q8_0. qwen2moe's shared
    expert is 4 * d_ff wide unless `shared_d_ff`. The first `n_dense_blocks`
    blocks get a dense SwiGLU FFN (ffn_gate/up/down, `dense_d_ff`, default
    4 * d_ff) instead of experts, and leading_dense_block_count says so;
    llama.cpp runs such blocks in glm4moe and deepseek2 files only.

    deepseek2 takes `mla` = dict(q_lora_rank (0: one attn_q), kv_lora_rank,
    qk_nope, qk_rope, v_head) and writes attn_k_b/attn_v_b, or attn_kv_b as
    files converted before llama.cpp split it with `kv_b_split=False`;
    `gating` "softmax" makes it DeepSeek-V2's router (no exp_probs_b).
    deepseek2 and glm4moe write expert_shared_count (shared_d_ff // d_ff),
    expert_weights_scale (`weights_scale`) and expert_weights_norm; glm4moe
    `nextn` trailing multi-token-prediction blocks (a whole block plus its
    nextn.* tensors, which from_pretrained skips as llama.cpp does).

    Weights are random (seeded): projections, embeddings, router N(0, 0.02),
    norms 1 + N(0, 0.02), biases N(0, 0.02), sinks N(0, 1).

    Returns {tensor name: float32 array it dequantises to (gguf.quants),
    numpy shape of the stored tensor: [rows, cols] as nn.Linear.weight,
    [E, rows, cols] for expert stacks, [E, n] for expert biases}, plus
    "__meta__": the configuration and the semantics llama.cpp applies
    (see _ARCH). Without `reference` only "__meta__" (large files).
    `omit` (tensor names left out) and `shapes` (name: shape written
    instead) make broken files for the error tests. `router_scale` scales
    the router weights: at N(0, 0.02) a small model's router logits lie so
    close that rounding flips which experts a token takes."""
    spec = dict(_ARCH[arch])
    if gating is not None:
        spec["gating"] = gating
        spec["probs_bias"] = gating == "sigmoid" and spec.get("probs_bias", False)
        spec["norm_topk"] = gating == "sigmoid"  # DeepSeek-V2 does not renormalise
    if spec.get("mla") and not mla:
        raise ValueError(f"{arch}: needs mla=dict(q_lora_rank, kv_lora_rank, qk_nope, qk_rope, v_head)")
    if nextn and arch != "glm4moe":
        raise ValueError("nextn blocks are written for glm4moe only")
    expert_types = tuple(expert_types or spec.get("experts", ("q4_k", "q4_k", "q6_k")))
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    if spec.get("q_is_d") and q_dim != d_model:
        raise ValueError(f"{arch}: llama.cpp needs n_heads * head_dim == d_model")
    if spec.get("kv_full") and n_kv_heads != n_heads:
        raise ValueError(f"{arch}: llama.cpp needs n_kv_heads == n_heads")
    if tie_embeddings and not spec.get("tie_ok"):
        raise ValueError(f"{arch}: llama.cpp needs output.weight")
    if spec.get("shexp"):
        shared_d_ff = shared_d_ff or 4 * d_ff
    dense_d_ff = dense_d_ff or 4 * d_ff
    rope_theta = spec["theta"] if rope_theta is None else rope_theta
    rms_eps = spec["eps"] if rms_eps is None else rms_eps

    tokens, token_types, merges = _byte_level_vocab(vocab)
    eos, bos = vocab - 2, vocab - 1
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"colibri-test-{arch}")
    w.add_file_type(getattr(gguf.LlamaFileType, _FILE_TYPE[expert_types[0]]))
    w.add_context_length(context_length)
    w.add_block_count(n_blocks + nextn)
    w.add_embedding_length(d_model)
    w.add_head_count(n_heads)
    if spec.get("mla"):
        # llama.cpp's converter: MLA as multi-query attention over the latent
        # (head_count_kv 1, keys kv_lora + rope wide), the decompressed
        # head sizes in the *_mla keys.
        q_lora, kv_lora = mla.get("q_lora_rank", 0), mla["kv_lora_rank"]
        nope, rope_d, v_head = mla["qk_nope"], mla["qk_rope"], mla["v_head"]
        w.add_head_count_kv(1)
        w.add_key_length(kv_lora + rope_d)
        w.add_value_length(kv_lora)
        w.add_key_length_mla(nope + rope_d)
        w.add_value_length_mla(v_head)
        w.add_kv_lora_rank(kv_lora)
        if q_lora:
            w.add_q_lora_rank(q_lora)
        w.add_rope_dimension_count(rope_d)
        q_dim = n_heads * (nope + rope_d)
    else:
        w.add_head_count_kv(n_kv_heads)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        if spec.get("partial_rope"):
            w.add_rope_dimension_count(int(head_dim * spec["partial_rope"]))
    if nextn:
        w.add_nextn_predict_layers(nextn)
    if spec.get("shexp_count"):
        if shared_d_ff % d_ff:
            raise ValueError(f"{arch}: the shared expert is expert_shared_count experts wide")
        w.add_expert_shared_count(shared_d_ff // d_ff)
        w.add_expert_weights_scale(weights_scale)
        if spec["norm_topk"]:
            w.add_expert_weights_norm(True)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if spec["gating"] == "sigmoid"
                                 else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_expert_count(n_experts)
    w.add_expert_used_count(top_k)
    if spec["ff_key"] == "ff":
        w.add_feed_forward_length(d_ff)
    else:
        w.add_expert_feed_forward_length(d_ff)
        w.add_feed_forward_length(dense_d_ff if n_dense_blocks else d_ff)
    if shared_d_ff:
        w.add_expert_shared_feed_forward_length(shared_d_ff)
    if n_dense_blocks:
        w.add_leading_dense_block_count(n_dense_blocks)
    if spec.get("swa"):
        w.add_sliding_window(sliding_window)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(spec["pre"])
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    for key, value in (extra_kv or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_float32(key, float(value))

    # (name, numpy shape, type, kind): kind "norm" ~ 1, "sink" ~ N(0, 1), else N(0, 0.02)
    T = gguf.TENSOR_NAMES
    M = gguf.MODEL_TENSOR
    gate_t, up_t, down_t = expert_types
    table = [(T[M.TOKEN_EMBD] + ".weight", (vocab, d_model), embd_type, "w"),
             (T[M.OUTPUT_NORM] + ".weight", (d_model,), "f32", "norm")]
    if not tie_embeddings:
        table.append((T[M.OUTPUT] + ".weight", (vocab, d_model), head_type, "w"))
    qk_norm = {"head": (head_dim, head_dim), "full": (q_dim, kv_dim)}.get(spec.get("qk_norm"))
    ffn_norm = M.ATTN_POST_NORM if spec["ffn_norm"] == "post_attention_norm" else M.FFN_NORM
    for b in range(n_blocks + nextn):
        def n(t, suffix="weight"):
            return T[t].format(bid=b) + "." + suffix
        table.append((n(M.ATTN_NORM), (d_model,), "f32", "norm"))
        if spec.get("mla"):
            if q_lora:
                table += [(n(M.ATTN_Q_A), (q_lora, d_model), attn_type, "w"),
                          (n(M.ATTN_Q_A_NORM), (q_lora,), "f32", "norm"),
                          (n(M.ATTN_Q_B), (q_dim, q_lora), attn_type, "w")]
            else:
                table.append((n(M.ATTN_Q), (q_dim, d_model), attn_type, "w"))
            table += [(n(M.ATTN_KV_A_MQA), (kv_lora + rope_d, d_model), attn_type, "w"),
                      (n(M.ATTN_KV_A_NORM), (kv_lora,), "f32", "norm")]
            if kv_b_split:
                table += [(n(M.ATTN_K_B), (n_heads, kv_lora, nope), attn_type, "w"),
                          (n(M.ATTN_V_B), (n_heads, v_head, kv_lora), attn_type, "w")]
            else:
                table.append((n(M.ATTN_KV_B), (n_heads * (nope + v_head), kv_lora), attn_type, "w"))
            table.append((n(M.ATTN_OUT), (d_model, n_heads * v_head), attn_type, "w"))
        else:
            table += [(n(M.ATTN_Q), (q_dim, d_model), attn_type, "w"),
                      (n(M.ATTN_K), (kv_dim, d_model), attn_type, "w"),
                      (n(M.ATTN_V), (kv_dim, d_model), attn_type, "w"),
                      (n(M.ATTN_OUT), (d_model, q_dim), attn_type, "w")]
        if b >= n_blocks:  # a multi-token-prediction block's own tensors
            table += [(n(M.NEXTN_EH_PROJ), (d_model, 2 * d_model), attn_type, "w"),
                      (n(M.NEXTN_ENORM), (d_model,), "f32", "norm"),
                      (n(M.NEXTN_HNORM), (d_model,), "f32", "norm"),
                      (n(M.NEXTN_SHARED_HEAD_NORM), (d_model,), "f32", "norm")]
        if spec.get("qkv_bias"):
            table += [(n(M.ATTN_Q, "bias"), (q_dim,), "f32", "w"), (n(M.ATTN_K, "bias"), (kv_dim,), "f32", "w"),
                      (n(M.ATTN_V, "bias"), (kv_dim,), "f32", "w")]
        if spec.get("o_bias"):
            table.append((n(M.ATTN_OUT, "bias"), (d_model,), "f32", "w"))
        if qk_norm:
            table += [(n(M.ATTN_Q_NORM), (qk_norm[0],), "f32", "norm"),
                      (n(M.ATTN_K_NORM), (qk_norm[1],), "f32", "norm")]
        if spec.get("sinks"):
            table.append((n(M.ATTN_SINKS), (n_heads,), "f32", "sink"))
        table.append((n(ffn_norm), (d_model,), "f32", "norm"))
        if b < n_dense_blocks:
            table += [(n(M.FFN_GATE), (dense_d_ff, d_model), gate_t, "w"),
                      (n(M.FFN_UP), (dense_d_ff, d_model), up_t, "w"),
                      (n(M.FFN_DOWN), (d_model, dense_d_ff), down_t, "w")]
            continue
        table += [(n(M.FFN_GATE_INP), (n_experts, d_model), router_type, "w"),
                  (n(M.FFN_GATE_EXP), (n_experts, d_ff, d_model), gate_t, "w"),
                  (n(M.FFN_UP_EXP), (n_experts, d_ff, d_model), up_t, "w"),
                  (n(M.FFN_DOWN_EXP), (n_experts, d_model, d_ff), down_t, "w")]
        if spec.get("router_bias"):
            table.append((n(M.FFN_GATE_INP, "bias"), (n_experts,), "f32", "w"))
        if spec.get("probs_bias"):
            table.append((n(M.FFN_EXP_PROBS_B, "bias"), (n_experts,), "f32", "w"))
        if spec.get("expert_bias"):
            table += [(n(M.FFN_GATE_EXP, "bias"), (n_experts, d_ff), "f32", "w"),
                      (n(M.FFN_UP_EXP, "bias"), (n_experts, d_ff), "f32", "w"),
                      (n(M.FFN_DOWN_EXP, "bias"), (n_experts, d_model), "f32", "w")]
        if spec.get("shexp") or (spec.get("shexp_count") and shared_d_ff):
            if spec.get("shexp"):
                table.append((n(M.FFN_GATE_INP_SHEXP), (d_model,), "f32", "w"))
            table += [(n(M.FFN_GATE_SHEXP), (shared_d_ff, d_model), gate_t, "w"),
                      (n(M.FFN_UP_SHEXP), (shared_d_ff, d_model), up_t, "w"),
                      (n(M.FFN_DOWN_SHEXP), (d_model, shared_d_ff), down_t, "w")]

    rng = np.random.default_rng(seed)
    out, types = {}, {}
    for name, shape, dtype, kind in table:
        if name in omit:
            continue
        shape = tuple((shapes or {}).get(name, shape))
        if dtype in _BLOCK and shape[-1] % _BLOCK[dtype]:
            dtype = "q8_0" if shape[-1] % 32 == 0 else "f16"
        types[name] = dtype
        # Generated and encoded a slice of the leading axis at a time (a
        # 128-expert stack is 0.8 GB as float32).
        step = max(1, (1 << 24) // max(1, int(np.prod(shape[1:])))) if len(shape) > 1 else shape[0]
        raws, refs = [], []
        for i in range(0, shape[0], step):
            part = rng.standard_normal((min(step, shape[0] - i),) + shape[1:], dtype=np.float32)
            if kind == "norm":
                part = 1.0 + 0.02 * part
            elif kind == "w":
                part *= 0.02 * (router_scale if name.endswith(".ffn_gate_inp.weight") else 1.0)
            raw, ref = encode(part, dtype, reference)
            raws.append(raw)
            refs.append(ref)
        raw = np.concatenate(raws) if len(raws) > 1 else raws[0]
        w.add_tensor(name, raw, raw_dtype=GGUF_TYPE[dtype] if raw.dtype == np.uint8 else None)
        if reference:
            out[name] = np.concatenate(refs) if len(refs) > 1 else refs[0]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out["__meta__"] = dict(
        arch=arch, n_blocks=n_blocks, d_model=d_model, n_experts=n_experts, top_k=top_k, d_ff=d_ff,
        n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, vocab=vocab, shared_d_ff=shared_d_ff,
        n_dense_blocks=n_dense_blocks, dense_d_ff=dense_d_ff if n_dense_blocks else 0,
        tie_embeddings=tie_embeddings, rope_theta=rope_theta, rope=spec["rope"], rms_eps=rms_eps,
        context_length=context_length, qk_norm=spec.get("qk_norm"), norm_topk_prob=spec["norm_topk"],
        gating=spec.get("gating", "softmax"), mla=mla, nextn=nextn, weights_scale=weights_scale,
        rope_dim=int(head_dim * spec["partial_rope"]) if spec.get("partial_rope") else None,
        # gpt-oss: llama.cpp's swiglu_oai (alpha 1.702, clamp 7, (up + 1) * glu)
        activation="swiglu_oai" if arch == "gpt-oss" else "silu",
        sliding_window=sliding_window if spec.get("swa") else 0,
        swa_layers=[i for i in range(n_blocks) if i % 2 == 0] if spec.get("swa") else [],
        bos_id=bos, eos_id=eos, types=types)
    return out
