"""colibri.torch.from_pretrained: a GGUF file (or a Hugging Face checkpoint
directory, _from_checkpoint below) to a running transformers model, every
large weight computed by Colibri in the format the file stores it in.

The model is the real transformers class of the file's architecture, built
on the meta device, so nothing is allocated for what Colibri computes; then

  - the small tensors (norms, routers, the shared expert's gate, biases)
    are read from the file and given to PyTorch;
  - every 2-D projection (attention q/k/v/o, dense MLPs, the LM head)
    becomes a colibri.nn.Linear holding the file's rows as stored, and the
    token embedding a colibri.nn.Embedding that dequantises the rows a
    batch looks up;
  - the MoE blocks run the file's experts (and shared experts) in one
    Colibri model, opened from the file by colibri.torch.accelerate(gguf=),
    so max_resident= works as there; on transformers 5 the router runs
    inside the same C call (_routed_block_forward);
  - the RMS norms become colibri.nn.RMSNorm (one C call each).

Projection and embedding bytes are read with pread, one tensor at a time,
never mapped; the experts' pages are dropped from the mapping as they are
packed, so the process grows by about what Colibri packs.

Each GGUF architecture is one entry of _FAMILIES: how its metadata becomes
the transformers config (with the routing rule llama.cpp computes for it),
the names of its pre-MoE norm and router, and whether its q/k rows were
permuted by llama.cpp's converter, whether its attention is DeepSeek's
latent attention (_latent_attention). Adding a family is an entry there
(and its tensors' places, if they differ, in _from_gguf).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import re
import types

import numpy as np
import torch
from torch import nn

from . import attention as colibri_attention
from . import decode as colibri_decode
from .fp8 import Fp8Weight, checkpoint_block_size
from . import nn as cnn
from . import rope as colibri_rope

__all__ = ["from_pretrained"]

# GGUF tensor types Colibri computes, by the gguf package's type id.
_GGUF_DTYPES = {0: "f32", 1: "f16", 30: "bf16", 8: "q8_0", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1",
                10: "q2_k", 11: "q3_k", 12: "q4_k", 13: "q5_k", 14: "q6_k", 16: "iq2_xxs", 17: "iq2_xs",
                18: "iq3_xxs", 19: "iq1_s", 20: "iq4_nl", 21: "iq3_s", 22: "iq2_s", 23: "iq4_xs", 29: "iq1_m",
                34: "tq1_0", 35: "tq2_0", 39: "mxfp4"}


@dataclasses.dataclass
class _Family:
    model_type: str          # transformers' model_type (AutoConfig.for_model), or a
                             # callable (meta) -> model_type where one GGUF arch is several
    config: callable         # (meta: _Meta) -> dict of config fields
    permuted_qk: bool = False  # llama.cpp's converter permuted q/k rows for its rope layout
    ffn_norm: str = "ffn_norm"  # the GGUF name of the norm before the MoE block
    router: str = "gate"        # the MoE block's router module
    mla: bool = False           # DeepSeek's multi-head latent attention


class _Meta:
    """The GGUF key/value metadata of one architecture, with errors naming the file and key."""

    def __init__(self, path, reader, arch, tensors=()):
        self.path, self.reader, self.arch = path, reader, arch
        self.tensors = tensors  # names, for families whose config depends on which are present

    def get(self, key, default=None, arch_key=True):
        full = "%s.%s" % (self.arch, key) if arch_key else key
        field = self.reader.fields.get(full)
        if field is None:
            return default
        value = field.contents()
        return value

    def need(self, key, arch_key=True):
        v = self.get(key, None, arch_key)
        if v is None:
            raise ValueError("%s: GGUF metadata key %s is missing"
                             % (self.path, "%s.%s" % (self.arch, key) if arch_key else key))
        return v


def _common_config(m, vocab):
    heads = int(m.need("attention.head_count"))
    d_model = int(m.need("embedding_length"))
    head_dim = int(m.get("attention.key_length", d_model // heads))
    cfg = dict(
        vocab_size=vocab,
        hidden_size=d_model,
        num_hidden_layers=int(m.need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(m.get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(m.get("context_length", 4096)),
        rms_norm_eps=float(m.get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(m.get("rope.freq_base", 10000.0)),
        num_experts_per_tok=int(m.need("expert_used_count")),
        hidden_act="silu",
    )
    bos = m.get("tokenizer.ggml.bos_token_id", arch_key=False)
    eos = m.get("tokenizer.ggml.eos_token_id", arch_key=False)
    if bos is not None:
        cfg["bos_token_id"] = int(bos)
    if eos is not None:
        cfg["eos_token_id"] = int(eos)
    return cfg


def _qwen3moe(m, vocab):
    cfg = _common_config(m, vocab)
    cfg.update(num_experts=int(m.need("expert_count")),
               moe_intermediate_size=int(m.need("expert_feed_forward_length")),
               intermediate_size=int(m.get("feed_forward_length", m.need("expert_feed_forward_length"))),
               norm_topk_prob=True,  # llama.cpp renormalises qwen3moe's top-k weights
               decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False)
    return cfg


def _qwen2moe(m, vocab):
    cfg = _common_config(m, vocab)
    cfg.update(num_experts=int(m.need("expert_count")),
               moe_intermediate_size=int(m.need("expert_feed_forward_length")),
               shared_expert_intermediate_size=int(m.need("expert_shared_feed_forward_length")),
               intermediate_size=int(m.get("feed_forward_length", m.need("expert_feed_forward_length"))),
               norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])
    return cfg


def _olmoe(m, vocab):
    cfg = _common_config(m, vocab)
    cfg.pop("head_dim")
    cfg.update(num_experts=int(m.need("expert_count")),
               intermediate_size=int(m.need("expert_feed_forward_length", )
                                     if m.get("expert_feed_forward_length") is not None
                                     else m.need("feed_forward_length")),
               norm_topk_prob=False, clip_qkv=None, attention_bias=False)
    return cfg


def _mixtral(m, vocab):
    cfg = _common_config(m, vocab)
    cfg.update(num_local_experts=int(m.need("expert_count")),
               intermediate_size=int(m.get("expert_feed_forward_length", m.need("feed_forward_length"))),
               sliding_window=None)
    return cfg


def _rope(cfg, model_type, m, extra=None):
    """cfg's rope_theta as transformers 4.57 takes it or as 5.x's
    rope_parameters, with yarn mapped when the file declares it."""
    import inspect

    import transformers

    theta = cfg.pop("rope_theta")
    rope = {"rope_type": "default", "rope_theta": theta}
    if m.get("rope.scaling.type") == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": theta, "factor": float(m.need("rope.scaling.factor")),
                "original_max_position_embeddings": int(m.need("rope.scaling.original_context_length"))}
    rope.update(extra or {})
    config_class = type(transformers.AutoConfig.for_model(model_type))
    if "rope_parameters" in inspect.signature(config_class.__init__).parameters:
        cfg["rope_parameters"] = rope
    else:  # transformers 4.57
        cfg["rope_theta"] = theta
        cfg["rope_scaling"] = None if rope["rope_type"] == "default" else {
            k: v for k, v in rope.items() if k != "rope_theta"}
    return cfg


def _gpt_oss(m, vocab):
    cfg = _common_config(m, vocab)
    n = cfg["num_hidden_layers"]
    cfg.update(num_local_experts=int(m.need("expert_count")),
               intermediate_size=int(m.need("expert_feed_forward_length")),
               sliding_window=int(m.need("attention.sliding_window")),
               # llama.cpp: sliding-window attention on even layers
               layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
               attention_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702)
    # llama.cpp's yarn defaults, as gpt-oss was trained
    yarn = {"beta_fast": 32.0, "beta_slow": 1.0} if m.get("rope.scaling.type") == "yarn" else None
    return _rope(cfg, "gpt_oss", m, yarn)


def _routing_keys(m):
    """DeepSeek-style routing from llama.cpp's keys: expert_gating_func (1
    softmax, 2 sigmoid; absent means softmax, as llama.cpp reads old
    DeepSeek-V2 files), expert_weights_norm/scale, expert groups (llama.cpp
    selects within groups only where the file declares them)."""
    groups = int(m.get("expert_group_count", 1) or 1)
    return dict(n_routed_experts=int(m.need("expert_count")),
                moe_intermediate_size=int(m.need("expert_feed_forward_length")),
                n_shared_experts=int(m.get("expert_shared_count", 0)),
                first_k_dense_replace=int(m.get("leading_dense_block_count", 0)),
                routed_scaling_factor=float(m.get("expert_weights_scale", 1.0) or 1.0),
                norm_topk_prob=bool(m.get("expert_weights_norm", False)),
                n_group=groups, topk_group=int(m.get("expert_group_used_count", 1) or 1) if groups > 1 else 1)


def _dense_width(m, cfg):
    # leading dense blocks' width; a file without them may leave it out
    return int(m.get("feed_forward_length", cfg["moe_intermediate_size"]))


def _glm4moe(m, vocab):
    cfg = _common_config(m, vocab)
    cfg.update(_routing_keys(m))
    n = cfg["num_hidden_layers"] - int(m.get("nextn_predict_layers", 0))
    head_dim = cfg["head_dim"]
    rope_dim = int(m.get("rope.dimension_count", head_dim // 2))
    cfg.update(num_hidden_layers=n, intermediate_size=_dense_width(m, cfg), attention_bias=True,
               partial_rotary_factor=rope_dim / head_dim, use_qk_norm="blk.0.attn_q_norm.weight" in m.tensors,
               num_mtp_layers=0)
    return _rope(cfg, "glm4_moe", m, {"partial_rotary_factor": rope_dim / head_dim})


def _deepseek_type(m):
    return "deepseek_v3" if int(m.get("expert_gating_func", 1)) == 2 else "deepseek_v2"


def _deepseek2(m, vocab):
    cfg = _common_config(m, vocab)
    cfg.pop("head_dim")
    cfg.update(_routing_keys(m))
    heads = cfg["num_attention_heads"]
    rope_dim = int(m.need("rope.dimension_count"))
    # Files converted since llama.cpp split kv_b hold the decompressed head
    # sizes in the *_mla keys; older ones in key_length/value_length.
    qk_head = int(m.get("attention.key_length_mla") or m.need("attention.key_length"))
    v_head = int(m.get("attention.value_length_mla") or m.need("attention.value_length"))
    q_lora = int(m.get("attention.q_lora_rank", 0) or 0)
    model_type = _deepseek_type(m)
    cfg.update(num_key_value_heads=heads, intermediate_size=_dense_width(m, cfg),
               kv_lora_rank=int(m.need("attention.kv_lora_rank")), q_lora_rank=q_lora or None,
               qk_rope_head_dim=rope_dim, qk_nope_head_dim=qk_head - rope_dim, v_head_dim=v_head,
               attention_bias=False, num_mtp_layers=0)
    extra = {}
    if m.get("rope.scaling.type") == "yarn":
        # llama.cpp keeps 0.1 * mscale_all_dim; DeepSeek's mscale equals it
        mscale = float(m.get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        extra = {"mscale": mscale, "mscale_all_dim": mscale, "beta_fast": 32.0, "beta_slow": 1.0}
    if model_type == "deepseek_v3":
        cfg["rope_interleave"] = True  # llama.cpp's rope pairs adjacent elements, as V3's interleave
    else:
        cfg["topk_method"] = "group_limited_greedy" if cfg["n_group"] > 1 else "greedy"
        if cfg["norm_topk_prob"] and cfg["routed_scaling_factor"] != 1.0:
            raise ValueError("%s: deepseek2 with softmax gating, expert_weights_norm and expert_weights_scale %g: "
                             "DeepSeek-V2's rule renormalises or scales, not both"
                             % (m.path, cfg["routed_scaling_factor"]))
    return _rope(cfg, model_type, m, extra)


_FAMILIES = {
    "deepseek2": _Family(_deepseek_type, _deepseek2, mla=True),
    "glm4moe": _Family("glm4_moe", _glm4moe, ffn_norm="post_attention_norm"),
    "gpt-oss": _Family("gpt_oss", _gpt_oss, ffn_norm="post_attention_norm", router="router"),
    "qwen3moe": _Family("qwen3_moe", _qwen3moe),
    "qwen2moe": _Family("qwen2_moe", _qwen2moe),
    "olmoe": _Family("olmoe", _olmoe),
    "llama": _Family("mixtral", _mixtral, permuted_qk=True),
    "mixtral": _Family("mixtral", _mixtral, permuted_qk=True),
}


class _File:
    """A GGUF file (or split set): its metadata and where each tensor's bytes are."""

    def __init__(self, path):
        import gguf

        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise ValueError("%s: no such file" % self.path)
        paths = [self.path]
        m = re.match(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$", self.path)
        if m:
            n = int(m.group(3))
            paths = ["%s-%05d-of-%05d.gguf" % (m.group(1), i, n) for i in range(1, n + 1)]
            missing = [p for p in paths if not os.path.isfile(p)]
            if missing:
                raise ValueError("%s: split set of %d files, %s is missing" % (self.path, n, missing[0]))
        self.tensors = {}  # name -> (file path, offset, n_bytes, gguf type id, shape as numpy sees it)
        self.reader = None
        for p in paths:
            try:
                r = gguf.GGUFReader(p, "r")
            except Exception as e:  # the gguf package raises ValueError, struct.error, ...
                raise ValueError("%s: not a readable GGUF file (%s: %s)" % (p, type(e).__name__, e)) from None
            if self.reader is None:
                self.reader = r
            size = os.path.getsize(p)
            for t in r.tensors:
                end = int(t.data_offset) + int(t.n_bytes)
                if end > size:
                    raise ValueError("%s: tensor %s ends at byte %d, past the file's end (%d): truncated file"
                                     % (p, t.name, end, size))
                shape = tuple(int(d) for d in reversed(list(t.shape)))
                self.tensors[t.name] = (p, int(t.data_offset), int(t.n_bytes), int(t.tensor_type), shape)
        arch = self.reader.fields.get("general.architecture")
        if arch is None:
            raise ValueError("%s: GGUF metadata key general.architecture is missing" % self.path)
        self.arch = arch.contents()

    def has(self, name):
        return name in self.tensors

    def signature(self):
        """sha256 (hex, 16 digits) of each file's header (its metadata and
        tensor table: the bytes before its first tensor's data) and size,
        the files in order: equal for copies of one file wherever they lie,
        different for another model, quantisation or split."""
        h = hashlib.sha256()
        paths = [self.path] + sorted({t[0] for t in self.tensors.values()} - {self.path})
        for p in paths:
            starts = [t[1] for t in self.tensors.values() if t[0] == p]
            size = os.path.getsize(p)
            with open(p, "rb") as fh:
                h.update(fh.read(min(starts) if starts else size))
            h.update(b"size %d;" % size)
        return h.hexdigest()[:16]

    def shape(self, name):
        return self.tensors[name][4]

    def dtype(self, name):
        t = self.tensors[name][3]
        if t not in _GGUF_DTYPES:
            import gguf

            raise ValueError("%s: tensor %s is stored as %s, which Colibri does not compute yet"
                             % (self.path, name, gguf.GGMLQuantizationType(t).name))
        return _GGUF_DTYPES[t]

    def raw(self, name):
        """uint8 numpy [rows, row bytes] of a tensor, as stored."""
        p, off, n, _, shape = self.tensors[name]
        fd = os.open(p, os.O_RDONLY)
        try:
            buf = bytearray(n)
            view = memoryview(buf)
            got = 0
            while got < n:
                k = os.preadv(fd, [view[got:]], off + got)
                if k <= 0:
                    raise ValueError("%s: tensor %s: read %d of %d bytes (truncated file?)" % (p, name, got, n))
                got += k
        finally:
            os.close(fd)
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        return np.frombuffer(buf, dtype=np.uint8).reshape(rows, -1)

    def floats(self, name):
        """A small tensor as float32 in numpy's shape of it."""
        import gguf

        self.dtype(name)
        raw = self.raw(name)
        t = self.tensors[name][3]
        values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t)).astype(np.float32)
        return values.reshape(self.shape(name))


def _latent_attention(f, blk, attn, module, config, linear, tensor, linear_opts, used, model):
    """DeepSeek's multi-head latent attention from a deepseek2 file. q (or
    its low-rank pair), the latent kv projection and the output stay as
    stored. kv_b, which transformers applies as one projection, is as stored
    in files converted before llama.cpp split it; in today's files it is
    attn_k_b (each head's nope rows transposed: blocks run along the wrong
    axis for a row kernel) and attn_v_b, so it is rebuilt once, exactly, as
    an f32 weight (DeepSeek-V3: 64 MiB a block, 1% of a Q4_K_M file). On
    transformers 5 decode steps run the absorbed form (_absorb), which keeps
    k_b and v_b as f32 tensors too (as much again)."""
    if config.q_lora_rank:
        linear(blk + "attn_q_a.weight", attn + "q_a_proj")
        tensor(blk + "attn_q_a_norm.weight", attn + "q_a_layernorm.weight")
        linear(blk + "attn_q_b.weight", attn + "q_b_proj")
    else:
        linear(blk + "attn_q.weight", attn + "q_proj")
    linear(blk + "attn_kv_a_mqa.weight", attn + "kv_a_proj_with_mqa")
    tensor(blk + "attn_kv_a_norm.weight", attn + "kv_a_layernorm.weight")
    heads, rank = config.num_attention_heads, config.kv_lora_rank
    nope, v_head = config.qk_nope_head_dim, config.v_head_dim
    if f.has(blk + "attn_kv_b.weight"):
        linear(blk + "attn_kv_b.weight", attn + "kv_b_proj")
        if hasattr(module, "expand_kv"):
            # k_b's rows here would run across kv_b's blocks: f32 per-head matrices.
            kv_b = f.floats(blk + "attn_kv_b.weight").reshape(heads, nope + v_head, rank)
            k_b = np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1))  # [heads, rank, nope]
            v_b = np.ascontiguousarray(kv_b[:, nope:])                      # [heads, v_head, rank]
            name = blk + "attn_kv_b.weight"
            _absorb(module,
                    cnn.Linear(k_b.view(np.uint8), "f32", rank, nope, groups=heads, name=name + " (k_b)",
                               **linear_opts),
                    cnn.Linear(v_b.view(np.uint8), "f32", v_head, rank, groups=heads, name=name + " (v_b)",
                               **linear_opts))
        return
    for name, want in ((blk + "attn_k_b.weight", (heads, rank, nope)), (blk + "attn_v_b.weight", (heads, v_head, rank))):
        if not f.has(name):
            raise ValueError("%s: tensor %s is missing (and %sattn_kv_b.weight)" % (f.path, name, blk))
        if f.shape(name) != want:
            raise ValueError("%s: tensor %s has shape %s, the model's kv_b_proj needs %s"
                             % (f.path, name, f.shape(name), want))
    k_name, v_name = blk + "attn_k_b.weight", blk + "attn_v_b.weight"
    used.update((k_name, v_name))
    if hasattr(module, "expand_kv"):
        # The absorbed products as the file stores them: per head, k_b's
        # rows run along nope and v_b's along the rank, a row kernel's axis.
        _absorb(module,
                cnn.Linear(f.raw(k_name), f.dtype(k_name), rank, nope, groups=heads, name=k_name, **linear_opts),
                cnn.Linear(f.raw(v_name), f.dtype(v_name), v_head, rank, groups=heads, name=v_name, **linear_opts))
    k_b = f.floats(k_name)  # [heads, rank, nope]
    v_b = f.floats(v_name)  # [heads, v_head, rank]
    kv_b = np.ascontiguousarray(np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, rank))
    _set_module(model, attn + "kv_b_proj",
                cnn.Linear(kv_b.view(np.uint8), "f32", kv_b.shape[0], rank, None,
                           name=blk + "attn_k_b.weight+attn_v_b.weight", **linear_opts))


def _absorb(module, k_b, v_b):
    """DeepSeek's latent attention in its absorbed form (as llama.cpp runs
    it) on transformers 5, whose cache holds the compressed latent: q's nope
    part is taken into the latent space through k_b, attention runs over the
    cached latents, and v_b expands only the output. transformers' own
    forward instead decompresses the whole cache through kv_b_proj at every
    step (its cost grows with the context). Decode steps only: a prefill
    (more than one new token) runs transformers' forward, whose kv_b_proj
    is the Colibri linear. k_b and v_b are Colibri linears with one matrix
    per head (groups): k_b maps [T, heads x nope] to [T, heads x rank], v_b
    [T, heads x rank] to [T, heads x v_head], in the file's format."""
    module.__dict__["_colibri_absorbed"] = (k_b, v_b, module.forward)
    module.forward = types.MethodType(_absorbed_mla_forward, module)


def _absorbed_mla_forward(self, hidden_states, *args, **kwargs):
    import inspect
    import sys

    k_b, v_b, original = self.__dict__["_colibri_absorbed"]
    if hidden_states.shape[-2] != 1:
        return original(hidden_states, *args, **kwargs)
    if "past_key_values" in kwargs and "cache" not in kwargs:
        kwargs["cache"] = kwargs.pop("past_key_values")
    signature = self.__dict__.get("_colibri_signature")
    if signature is None:  # inspect.signature costs more than a small block's projections
        signature = self.__dict__["_colibri_signature"] = inspect.signature(original)
    bound = signature.bind(hidden_states, *args, **kwargs)
    a = bound.arguments
    extra = a.get("kwargs", {})
    mask, cache, pos = a.get("attention_mask"), a.get("cache"), a.get("position_embeddings")
    B, T = hidden_states.shape[:-1]
    nope, rope, rank = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q = q.view(B, T, -1, nope + rope).transpose(1, 2)
    q_nope, q_rot = torch.split(q, [nope, rope], dim=-1)
    kv_nope, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
    kv_nope = self.kv_a_layernorm(kv_nope).view(B, 1, T, rank)
    k_rot = k_rot.view(B, 1, T, rope)
    mod = sys.modules[type(self).__module__]
    if hasattr(mod, "apply_rotary_emb"):  # DeepSeek-V2: complex rotation of adjacent pairs
        q_rot, k_rot = mod.apply_rotary_emb(q_rot, k_rot, pos.to(q_rot.device))
    elif getattr(self.config, "rope_interleave", True):
        q_rot, k_rot = mod.apply_rotary_pos_emb_interleave(q_rot, k_rot, *pos)
    else:
        q_rot, k_rot = mod.apply_rotary_pos_emb(q_rot, k_rot, *pos)
    if cache is not None:
        kv_nope, k_rot = cache.update(kv_nope, k_rot, self.layer_idx, kwargs=extra)
    S = kv_nope.shape[2]
    H = q_nope.shape[1]
    q_lat = k_b(q_nope.transpose(1, 2).reshape(B * T, H * nope).float())     # [B T, H rank]
    q_lat = q_lat.view(B, T, H, rank).transpose(1, 2)                          # [B, H, T, rank]
    if colibri_attention.fits(q_lat, kv_nope, mask, S):
        # One C call over the cached latents, the rope part as the key's
        # second part, the latents themselves as the values (MQA: one kv head).
        lat = colibri_attention.attention(
            torch.cat([q_lat, q_rot.float()], dim=-1), kv_nope, kv_nope, key2=k_rot, scale=self.scaling,
            mask=None if mask is None else mask[..., :S], threads=self.__dict__.get("_colibri_threads", 0))
        out = v_b(lat.reshape(B * T, H * rank))                                # [B T, H v]
        return self.o_proj(out.view(B, T, -1).to(hidden_states.dtype)), None
    latent = kv_nope[:, 0].float()                                  # [B, S, rank]
    scores = (torch.einsum("bhtr,bsr->bhts", q_lat, latent)
              + torch.einsum("bhtp,bsp->bhts", q_rot.float(), k_rot[:, 0].float())) * self.scaling
    if mask is None:
        if T > 1:  # causal over the new tokens, which end the cache
            keep = torch.ones(T, S, dtype=torch.bool).tril(S - T)
            scores = scores.masked_fill(~keep, float("-inf"))
    elif mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask[..., :S], float("-inf"))
    else:
        scores = scores + mask[..., :S]
    # A padded query row masks every key: zeros, not NaN (they would reach
    # the real tokens through the next layer's latents).
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    lat = torch.einsum("bhts,bsr->bthr", p, latent)                            # [B, T, H, rank]
    out = v_b(lat.reshape(B * T, H * rank))                                    # [B T, H v]
    return self.o_proj(out.view(B, T, -1).to(hidden_states.dtype)), None


def _unpermute_rows(rows, n_head):
    """Undoes llama.cpp's converter's q/k row permutation (its rope pairs
    adjacent elements; transformers' pairs the two halves of each head)."""
    r = rows.shape[0]
    half = r // n_head // 2
    return np.ascontiguousarray(rows.reshape(n_head, half, 2, -1).swapaxes(1, 2).reshape(r, -1))


def _set_module(root, path, module):
    parent, _, leaf = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def _placeholder_weights(module, dtype=torch.float32):
    """Gives the meta parameters of `module` (experts Colibri reads from the
    file) CPU stand-ins of their shape that own no memory (one element,
    broadcast), so accelerate() recognises the block; it releases them.
    `dtype`: the stored one, which accelerate() keeps when not quantising."""
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            if p.is_meta:
                stand_in = torch.zeros((), dtype=dtype).expand(p.shape)
                setattr(sub, name, nn.Parameter(stand_in, requires_grad=False))


def _moe_block(layer):
    for name, child in layer.named_children():
        if hasattr(child, "experts"):
            return name, child
    return None, None


def _hand_over_cores(threads, torch_threads):
    """PyTorch's intra-op threads spin after each operator on the cores
    Colibri's pool needs next (and the other way round): on 2 cores a
    Qwen3-MoE decode step took 3.7x as long with both at 2 threads as with
    PyTorch at 1 (bench/e2e_gguf.py --torch-threads). With every large
    product in Colibri, what PyTorch has left (norms, rope, attention over
    the cache) runs on the cores Colibri does not take."""
    if torch_threads is None:
        return
    if torch_threads == "auto":
        cores = os.cpu_count() or 1
        mine = cores if threads == 0 else min(threads, cores)
        torch_threads = max(1, cores - mine)
    torch.set_num_threads(int(torch_threads))


def _routed_block_forward(self, hidden_states):
    """A transformers 5 MoE block's forward with the router in Colibri too:
    the file's router, routing rule and shared expert in one C call (the
    PyTorch router cost a Qwen3-MoE decode step about 0.1 ms per block).
    transformers 5's blocks return the hidden states alone. Under
    torch.compile it is the custom operator colibri::moe."""
    routed = self.__dict__["_colibri_routed"]
    model, key, layer, d_model, fallback, with_scores = routed[:6]
    if (self.training or hidden_states.device.type != "cpu"
            or (torch.is_grad_enabled() and hidden_states.requires_grad)):
        return fallback(hidden_states)
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, d_model)
    if x.dtype != torch.float32:
        x = x.float()
    if torch.compiler.is_compiling():
        out = torch.ops.colibri.moe(x, key, layer)
    else:
        out = cnn.run_moe(model, layer, x.contiguous())
    colibri_decode.all_reduce_share(out, routed)
    out = out.reshape(shape).to(hidden_states.dtype)
    # gpt-oss's block returns (hidden, router scores); its layer drops the scores.
    return (out, None) if with_scores else out


def _reduce_over(model, report, group, path):
    """Expert parallelism: each routed block's output is this rank's share;
    an all-reduce (SUM) over `group` after it makes the whole block's. Only
    blocks routed in Colibri (transformers 5) carry it."""
    for b in report.accelerated:
        block = model.get_submodule(b.path)
        routed = block.__dict__.get("_colibri_routed")
        if routed is None:
            raise ValueError("%s: expert_parallel needs every MoE block routed in Colibri (transformers 5, "
                             "no router logits asked for); block %s is not" % (path, b.path))
        block.__dict__["_colibri_routed"] = routed + (group,)


def _route_in_colibri(model, report):
    """Moves each accelerated block's router into its Colibri call, where
    the blocks' forwards are transformers 5's (a tensor in, a tensor out)
    and nothing asks for the router logits."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5 or getattr(model.config, "output_router_logits", False):
        return
    for b in report.accelerated:
        block = model.get_submodule(b.path)
        state = block.__dict__.get("_colibri_state") or block.experts.__dict__.get("_colibri_state")
        cmodel = state.experts.colibri_model
        if cmodel.info.router_family is None:
            continue
        fallback = block.forward
        with_scores = b.layout == "gpt_oss"
        block.__dict__["_colibri_routed"] = (cmodel, cnn.moe_key(cmodel), b.colibri_layer, b.d_model, fallback,
                                             with_scores)
        block.__dict__["forward"] = types.MethodType(_routed_block_forward, block)


def from_pretrained(path, *, threads=0, exact_prefill=False, max_resident=None, lock=True, huge_pages=True,
                    bf16_compute=False, torch_threads="auto", dtype=None, dense_dtype=None, attention="colibri",
                    direct_decode=True, progress=None, expert_parallel=None, expert_parallel_timeout=60.0,
                    expert_placement=None):
    """A transformers model (eval mode) for a GGUF file (or the first file of
    a split set) or a Hugging Face checkpoint directory, its large weights
    computed by Colibri. See colibri.torch.from_pretrained."""
    if torch_threads is not None and torch_threads != "auto" and int(torch_threads) < 1:
        raise ValueError("torch_threads must be 'auto', None or >= 1, got %r" % (torch_threads,))
    if attention not in ("colibri", "model"):
        raise ValueError("attention must be 'colibri' or 'model', got %r" % (attention,))
    options = dict(threads=threads, exact_prefill=exact_prefill, lock=lock, huge_pages=huge_pages,
                   bf16_compute=bf16_compute, progress=progress, attention=attention,
                   expert_parallel=_expert_group(expert_parallel, expert_parallel_timeout))
    if expert_placement is not None and options["expert_parallel"] is None:
        raise ValueError("expert_placement places experts on the ranks of expert_parallel, which is not set")
    options["expert_placement"] = _resolve_placement(expert_placement, options["expert_parallel"])
    if options["expert_parallel"] is not None and os.path.isdir(path):
        raise ValueError("%s: expert_parallel takes a GGUF file (each rank opens its share of the file's experts)"
                         % path)
    if os.path.isdir(path):
        if max_resident is not None:
            raise ValueError("%s: max_resident needs a GGUF file (experts read on demand come from a file Colibri "
                             "reads; convert the checkpoint with `colibri convert --hf`)" % path)
        model = _from_checkpoint(os.fspath(path), dtype, dense_dtype, options)
    else:
        if dtype is not None or dense_dtype is not None:
            raise ValueError("%s: dtype= quantises a 16/32-bit checkpoint as it is read; a GGUF file runs in the "
                             "types it stores" % path)
        model = _from_gguf(path, max_resident, options)
    model.eval()
    _last_block_computes_kept_positions(model)
    if attention == "colibri":
        colibri_attention.install(model, threads=threads)
        colibri_rope.install(model)
        if direct_decode:
            colibri_decode.install(model)
    _hand_over_cores(threads, torch_threads)
    return model


_FFN_NAMES = ("mlp", "block_sparse_moe", "feed_forward")


def _expert_group(expert_parallel, timeout):
    """from_pretrained's expert_parallel: None/False, True (every rank of
    the default process group) or a torch.distributed group; returns the
    group to reduce over, or None for no parallelism. For True that is a
    new gloo group of the same ranks whose collectives give up after
    `timeout` seconds (a peer that stopped answering; a dead peer's closed
    connection fails sooner), where the default group waits 30 minutes. A
    group given keeps its own timeout."""
    if expert_parallel is None or expert_parallel is False:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("expert_parallel needs torch.distributed initialised (torchrun, or "
                         "torch.distributed.init_process_group(\"gloo\", ...)) first")
    if expert_parallel is not True:
        return expert_parallel
    if not timeout or float(timeout) <= 0:
        raise ValueError("expert_parallel_timeout must be > 0 seconds, got %r" % (timeout,))
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=float(timeout)))


def _colibri_version():
    from . import __version__

    return __version__


def _agree_across_ranks(group, path, mine):
    """Every rank of an expert-parallel group must open the same file with
    the options that change its numbers, or their partial sums would add up
    to nothing meaningful; each rank compares its own with every other's and
    raises, naming the first difference, before anything is opened."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    rank = dist.get_rank(group)
    for other, theirs in enumerate(everyone):
        diff = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
        if diff:
            k = diff[0]
            field = "file (digest of its header and size)" if k == "file" else k
            raise ValueError("%s: expert_parallel ranks must open the same file with the same options; rank %d "
                             "(this one) and rank %d of %d differ in %s: %r here, %r there"
                             % (path, rank, other, world, field, mine.get(k), theirs.get(k)))


def _expert_share(group, n_experts, placement, n_moe_layers, path):
    """(mask of this rank's experts, whether it leaves the shared expert to
    rank 0) for the expert-parallel group: `placement`'s rows for this rank
    ([n_moe_layers, n_experts]), else a contiguous block of about E / N."""
    import torch.distributed as dist

    from . import placement as colibri_placement

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if placement is None:
        try:
            placement = colibri_placement.contiguous(1, n_experts, world)
        except ValueError as e:
            raise ValueError("expert_parallel: %s" % e) from None
        return placement.mask(rank)[0], rank != 0
    if (placement.n_layers, placement.n_experts) != (n_moe_layers, n_experts):
        raise ValueError("%s: expert_placement is for %d MoE layers of %d experts; the file has %d of %d"
                         % (path, placement.n_layers, placement.n_experts, n_moe_layers, n_experts))
    return placement.mask(rank), rank != 0


def _resolve_placement(expert_placement, group):
    """from_pretrained's expert_placement: None, an ExpertPlacement for the
    group's size, or a RoutingTrace (or the path of a saved one, .ctrace)
    to balance over the group's ranks (colibri.placement.balanced)."""
    if expert_placement is None:
        return None
    import torch.distributed as dist

    from . import placement as colibri_placement
    from .routing import RoutingTrace

    world = dist.get_world_size(group)
    if isinstance(expert_placement, (str, os.PathLike)):
        expert_placement = RoutingTrace.load(os.fspath(expert_placement))
    if isinstance(expert_placement, RoutingTrace):
        return colibri_placement.balanced(expert_placement, world)
    if isinstance(expert_placement, colibri_placement.ExpertPlacement):
        if expert_placement.n_ranks != world:
            raise ValueError("expert_placement is for %d ranks; the expert_parallel group has %d"
                             % (expert_placement.n_ranks, world))
        return expert_placement
    raise TypeError("expert_placement must be a colibri.placement.ExpertPlacement, a RoutingTrace or the path "
                    "of a .ctrace file, got %s" % type(expert_placement).__name__)


def _last_block_computes_kept_positions(model):
    """A forward asked for the logits of its last `logits_to_keep`
    positions only (generate's prefill asks for 1) reads the last block's
    output at those positions alone: every position's keys and values come
    from the attention, before the feed-forward, so the last block's
    feed-forward (a whole MoE layer) runs on the kept positions only, as
    llama.cpp's graphs do (its pp benchmark counts on it). The other
    positions leave the block holding the residual alone; a forward that
    returns hidden states (output_hidden_states) or router logits, or
    gives logits_to_keep as anything but a positive int, computes every
    position. Off under torch.compile (a traced graph must not depend on
    this Python state)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return
    last = layers[-1]
    name = next((n for n in _FFN_NAMES if isinstance(getattr(last, n, None), nn.Module)), None)
    if name is None:
        return
    ffn = getattr(last, name)
    state = {"keep": None}
    config = model.config

    def note_kept(module, args, kwargs):
        keep = kwargs.get("logits_to_keep")
        wanted = (isinstance(keep, int) and not isinstance(keep, bool) and keep > 0
                  and not torch.compiler.is_compiling()
                  and not kwargs.get("output_hidden_states", config.output_hidden_states)
                  and not kwargs.get("output_router_logits", getattr(config, "output_router_logits", False)))
        state["keep"] = keep if wanted else None

    def forget(module, args, kwargs, out):
        state["keep"] = None

    # The feed-forward's own forward, looked up at each call.
    ffn.__dict__["_colibri_all_positions"] = ffn.forward

    def kept_positions_forward(hidden_states, *args, **kwargs):
        inner = ffn.__dict__["_colibri_all_positions"]
        keep = state["keep"]
        if keep is None or hidden_states.dim() != 3 or keep >= hidden_states.shape[1]:
            return inner(hidden_states, *args, **kwargs)
        out = inner(hidden_states[:, -keep:].contiguous(), *args, **kwargs)
        first = out[0] if isinstance(out, tuple) else out
        full = first.new_zeros(hidden_states.shape[:2] + first.shape[2:])
        full[:, -keep:] = first
        return (full,) + tuple(out[1:]) if isinstance(out, tuple) else full

    ffn.__dict__["forward"] = kept_positions_forward
    model.register_forward_pre_hook(note_kept, with_kwargs=True)
    model.register_forward_hook(forget, with_kwargs=True, always_call=True)


def _materialise_buffers(model, path):
    """Buffers computed in __init__ (rotary inverse frequencies) were made
    on the meta device: those modules are made again on the CPU."""
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            try:
                fresh = type(module)(config=model.config)
            except TypeError:
                raise ValueError("%s: cannot materialise %s (%s) of the %s model"
                                 % (path, name, type(module).__name__, model.config.model_type)) from None
            _set_module(model, name, fresh)


def _colibri_norms(model):
    """Every RMS norm of the model (the families' *RMSNorm modules: a 1-D
    weight and variance_epsilon, y = w * x * rsqrt(mean(x^2) + eps)) as a
    colibri.nn.RMSNorm: one C call where PyTorch runs six operators (about
    17 norms in a 4-block Qwen3-MoE decode step)."""
    for name, module in list(model.named_modules()):
        if (type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)
                and module.weight.dim() == 1 and not module.weight.is_meta
                and isinstance(getattr(module, "variance_epsilon", None), float)):
            _set_module(model, name, cnn.RMSNorm.replacing(module))


def _check_complete(model, path):
    left = [n for n, p in model.named_parameters() if p.is_meta]
    left += [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise ValueError("%s: no weights in the file for %s" % (path, ", ".join(left[:5])))


def _from_gguf(path, max_resident, options):
    from transformers import AutoConfig, AutoModelForCausalLM

    from . import torch as ctorch

    threads, exact_prefill = options["threads"], options["exact_prefill"]
    lock, huge_pages, bf16_compute = options["lock"], options["huge_pages"], options["bf16_compute"]
    f = _File(path)
    family = _FAMILIES.get(f.arch)
    if family is None:
        raise ValueError("%s: GGUF architecture %r is not one from_pretrained maps (it maps %s)"
                         % (f.path, f.arch, ", ".join(sorted(_FAMILIES))))
    if options.get("expert_parallel") is not None:
        _agree_across_ranks(options["expert_parallel"], f.path, {
            "file": f.signature(), "exact_prefill": bool(exact_prefill), "bf16_compute": bool(bf16_compute),
            "attention": options.get("attention"), "colibri": _colibri_version(),
            "expert_placement": placement.digest() if (placement := options.get("expert_placement")) else "contiguous"})
    meta = _Meta(f.path, f.reader, f.arch, f.tensors)
    if meta.get("expert_count") in (None, 0):
        raise ValueError("%s: %s file without experts (%s.expert_count missing or 0): not a MoE model"
                         % (f.path, f.arch, f.arch))
    if not f.has("token_embd.weight"):
        raise ValueError("%s: tensor token_embd.weight is missing" % f.path)
    vocab = f.shape("token_embd.weight")[0]
    fields = family.config(meta, vocab)
    fields["tie_word_embeddings"] = not f.has("output.weight")
    model_type = family.model_type(meta) if callable(family.model_type) else family.model_type
    config = AutoConfig.for_model(model_type, **fields)
    config.dtype = torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.eval()

    linear_opts = dict(threads=threads, exact=exact_prefill, huge_pages=huge_pages, lock=lock)
    n_heads = config.num_attention_heads
    n_kv = config.num_key_value_heads
    small = {}
    used = set()

    def projection(name, module_path, permute_heads=None):
        """(rows as stored, dtype, bias or None, (out, in)) of a 2-D tensor
        checked against the model's module at module_path."""
        if not f.has(name):
            raise ValueError("%s: tensor %s is missing" % (f.path, name))
        target = model.get_submodule(module_path)
        shape = f.shape(name)
        want = (target.out_features, target.in_features)
        if tuple(shape) != want:
            raise ValueError("%s: tensor %s has shape %s, the model's %s needs %s"
                             % (f.path, name, shape, module_path, want))
        rows = f.raw(name)
        if permute_heads is not None:
            rows = _unpermute_rows(rows, permute_heads)
        bias = None
        bias_name = name[:-len(".weight")] + ".bias"
        if f.has(bias_name):
            bias = f.floats(bias_name).reshape(-1)
            if permute_heads is not None:
                bias = _unpermute_rows(bias.reshape(-1, 1), permute_heads).reshape(-1)
            used.add(bias_name)
        elif getattr(target, "bias", None) is not None:
            raise ValueError("%s: tensor %s is missing (the model's %s has a bias)" % (f.path, bias_name, module_path))
        used.add(name)
        return rows, f.dtype(name), bias, want

    def linear(name, module_path, permute_heads=None):
        rows, dtype, bias, (out, inp) = projection(name, module_path, permute_heads)
        _set_module(model, module_path, cnn.Linear(rows, dtype, out, inp, bias, name=name, **linear_opts))

    def tensor(name, param_path, reshape=None):
        if not f.has(name):
            raise ValueError("%s: tensor %s is missing" % (f.path, name))
        owner, _, leaf = param_path.rpartition(".")
        p = getattr(model.get_submodule(owner), leaf)  # a parameter, or a buffer (a router's selection bias)
        v = torch.from_numpy(f.floats(name).copy())
        if reshape is not None or tuple(v.shape) != tuple(p.shape):
            if v.numel() != p.numel():
                raise ValueError("%s: tensor %s has shape %s, the model's %s needs %s"
                                 % (f.path, name, tuple(v.shape), param_path, tuple(p.shape)))
            v = v.reshape(p.shape)
        small[param_path] = v
        used.add(name)

    base = model.model
    prefix = "model."
    dense_blocks = 0
    for i, layer in enumerate(base.layers):
        blk, lp = "blk.%d." % i, "%slayers.%d." % (prefix, i)
        tensor(blk + "attn_norm.weight", lp + "input_layernorm.weight")
        tensor(blk + family.ffn_norm + ".weight", lp + "post_attention_layernorm.weight")
        attn = lp + "self_attn."
        if family.mla:
            _latent_attention(f, blk, attn, layer.self_attn, config, linear, tensor, linear_opts, used, model)
        else:
            # q, k and v stay three calls: one fused call over their stacked
            # rows measured no faster (Qwen3-MoE decode, docs/PYTORCH.md).
            linear(blk + "attn_q.weight", attn + "q_proj", n_heads if family.permuted_qk else None)
            linear(blk + "attn_k.weight", attn + "k_proj", n_kv if family.permuted_qk else None)
            linear(blk + "attn_v.weight", attn + "v_proj")
        linear(blk + "attn_output.weight", attn + "o_proj")
        for g, h in (("attn_q_norm", "q_norm"), ("attn_k_norm", "k_norm")):
            if hasattr(layer.self_attn, h):
                tensor(blk + g + ".weight", attn + h + ".weight")
        if isinstance(getattr(layer.self_attn, "sinks", None), torch.Tensor):
            tensor(blk + "attn_sinks.weight", attn + "sinks")
        block_name, block = _moe_block(layer)
        if block is None:
            if f.has(blk + "ffn_gate_exps.weight") or not hasattr(getattr(layer, "mlp", None), "gate_proj"):
                raise ValueError("%s: block %d: the %s model has no MoE block there (leading_dense_block_count?)"
                                 % (f.path, i, model_type))
            dense_blocks += 1  # a leading dense block (DeepSeek, GLM-4-MoE)
            for part in ("gate", "up", "down"):
                linear(blk + "ffn_%s.weight" % part, lp + "mlp.%s_proj" % part)
            continue
        bp = lp + block_name + "."
        router = getattr(block, family.router)
        tensor(blk + "ffn_gate_inp.weight", bp + family.router + ".weight")
        if isinstance(getattr(router, "bias", None), torch.Tensor):
            tensor(blk + "ffn_gate_inp.bias", bp + family.router + ".bias")
        if isinstance(getattr(router, "e_score_correction_bias", None), torch.Tensor):
            tensor(blk + "exp_probs_b.bias", bp + family.router + ".e_score_correction_bias")
        if hasattr(block, "shared_expert_gate"):
            tensor(blk + "ffn_gate_inp_shexp.weight", bp + "shared_expert_gate.weight", reshape=True)
        _placeholder_weights(block.experts)
        for shared in ("shared_expert", "shared_experts"):
            if getattr(block, shared, None) is not None:
                _placeholder_weights(getattr(block, shared))
        for part in ("gate", "up", "down"):
            for kind in ("exps", "shexp"):
                for what in ("weight", "bias"):
                    if f.has(blk + "ffn_%s_%s.%s" % (part, kind, what)):
                        used.add(blk + "ffn_%s_%s.%s" % (part, kind, what))
    tensor("output_norm.weight", prefix + "norm.weight")
    emb_shape = f.shape("token_embd.weight")
    if emb_shape != (config.vocab_size, config.hidden_size):
        raise ValueError("%s: tensor token_embd.weight has shape %s, expected %s"
                         % (f.path, emb_shape, (config.vocab_size, config.hidden_size)))
    base.embed_tokens = cnn.Embedding(f.raw("token_embd.weight"), f.dtype("token_embd.weight"), *emb_shape,
                                      name="token_embd.weight")
    used.add("token_embd.weight")
    head = "output.weight" if f.has("output.weight") else "token_embd.weight"
    model.lm_head = nn.Identity()  # replaced below; keeps tie_weights() from touching it
    model.lm_head = cnn.Linear(f.raw(head), f.dtype(head), config.vocab_size, config.hidden_size,
                               name=head, **linear_opts)
    used.add(head)

    model.load_state_dict(small, strict=False, assign=True)
    _materialise_buffers(model, f.path)
    group = options.get("expert_parallel")
    share = None
    if group is not None:
        share = _expert_share(group, int(meta.get("expert_count")), options.get("expert_placement"),
                              config.num_hidden_layers - dense_blocks, f.path)
    report = ctorch.accelerate(model, gguf=f.path, threads=threads, exact_prefill=exact_prefill,
                               max_resident=max_resident, lock=lock, huge_pages=huge_pages,
                               bf16_compute=bf16_compute, progress=options.get("progress"), _expert_share=share)
    if len(report.accelerated) != config.num_hidden_layers - dense_blocks:
        raise ValueError("%s: Colibri took %d of the %d MoE blocks (skipped: %s)"
                         % (f.path, len(report.accelerated), config.num_hidden_layers - dense_blocks,
                            report.skipped))
    _route_in_colibri(model, report)
    if group is not None:
        _reduce_over(model, report, group, f.path)
    _colibri_norms(model)
    _check_complete(model, f.path)
    # Multi-token-prediction blocks follow the model's (GLM-4-MoE's nextn):
    # llama.cpp does not run them, nor does transformers' model.
    mtp = re.compile(r"^blk\.(\d+)\.")
    used.update(n for n in f.tensors if (b := mtp.match(n)) and int(b.group(1)) >= config.num_hidden_layers
                and int(b.group(1)) < int(meta.get("block_count")))
    unused = sorted(set(f.tensors) - used)
    if unused:
        raise ValueError("%s: tensors the %s model has no place for: %s"
                         % (f.path, family.model_type, ", ".join(unused[:5])))
    model._colibri_report = report
    return model


# ------------------------------------------------ Hugging Face checkpoints

_TORCH_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_FLOAT_TORCH = {v: k for k, v in _TORCH_DTYPES.items()}


def _quantize_rows(weight, dtype, block_rows=256):
    """A 2-D float tensor quantised to `dtype` rows (uint8 numpy), converting
    `block_rows` rows to float32 at a time."""
    from .quant import quantize, row_bytes

    rows, n = weight.shape
    out = np.empty((rows, row_bytes(dtype, n)), dtype=np.uint8)
    for r in range(0, rows, block_rows):
        out[r:r + block_rows] = quantize(weight[r:r + block_rows].to(torch.float32).numpy(), dtype)
    return out


class _Checkpoint:
    """A checkpoint directory's safetensors shards: tensor name -> shard,
    read one tensor at a time (safetensors maps the shard; a tensor read is
    copied out, so nothing of the file stays resident)."""

    def __init__(self, path):
        from safetensors import safe_open

        self.path = path
        self._open = safe_open
        self.fp8_block = None  # (rows, columns) of the scale tiles of a block-scaled FP8 checkpoint
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not files:
            raise ValueError("%s: no .safetensors files (from_pretrained reads safetensors checkpoints)" % path)
        self.where = {}
        for name in files:
            full = os.path.join(path, name)
            try:
                with safe_open(full, "pt") as f:
                    for key in f.keys():
                        self.where[key] = full
            except Exception as e:  # safetensors raises its own SafetensorError
                raise ValueError("%s: not a readable safetensors file (%s)" % (full, e)) from None

    def has(self, key):
        return key in self.where

    def weight(self, key, get=None):
        """The tensor `key` (get: how to read it, default self.get), or for a
        float8_e4m3fn one a colibri.fp8.Fp8Weight with its `_scale_inv`."""
        w = (get or self.get)(key)
        if w.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return w
        if self.fp8_block is None or w.dtype != torch.float8_e4m3fn:
            raise ValueError("%s: tensor %s is %s, but config.json has no quantization_config with quant_method "
                             "\"fp8\" and fmt \"e4m3\"" % (self.path, key, w.dtype))
        scale_key = key + "_scale_inv"
        if scale_key not in self.where:
            raise ValueError("%s: FP8 tensor %s has no %s" % (self.path, key, scale_key))
        return Fp8Weight(w, (get or self.get)(scale_key), self.fp8_block, "%s: %s" % (self.path, key))

    def floats(self, key):
        """The tensor `key` as float32 (an FP8 one times its scales)."""
        w = self.weight(key)
        return w.dequantize() if isinstance(w, Fp8Weight) else w.float()

    def get(self, key):
        if key not in self.where:
            raise ValueError("%s: tensor %s is missing" % (self.path, key))
        try:
            with self._open(self.where[key], "pt") as f:
                return f.get_tensor(key)
        except Exception as e:
            raise ValueError("%s: tensor %s cannot be read from %s (%s)"
                             % (self.path, key, self.where[key], e)) from None

    def get_item(self, key, index):
        """key[index] (one expert of a stacked tensor), reading only its bytes."""
        try:
            with self._open(self.where[key], "pt") as f:
                return f.get_slice(key)[index]
        except Exception as e:
            raise ValueError("%s: tensor %s[%d] cannot be read from %s (%s)"
                             % (self.path, key, index, self.where[key], e)) from None

    def find(self, *candidates):
        """The first candidate name the checkpoint holds, else None."""
        for c in candidates:
            if c in self.where:
                return c
        return None


# Hub names of an MoE block and its experts' matrices where transformers 5
# renames them on load (Mixtral's block_sparse_moe and w1/w3/w2).
_BLOCK_ALIASES = {"mlp": ("mlp", "block_sparse_moe")}
_EXPERT_NAMES = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}


def _aliases(key):
    out = [key]
    if ".mlp." in key:
        out.append(key.replace(".mlp.", ".block_sparse_moe.", 1))
    return out


def _expert_matrix(ck, block_path, e, which):
    names = [block_path + ".experts.%d.%s.weight" % (e, n) for n in _EXPERT_NAMES[which]]
    found = ck.find(*[a for n in names for a in _aliases(n)])
    if found is None:
        raise ValueError("%s: tensor %s is missing" % (ck.path, names[0]))
    return ck.weight(found)


def _lazy_experts(ck, block_path, experts, n_experts, layout):
    """The block's routed experts as colibri._arrays.Lazy (gate [F, D], up
    [F, D], down [D, F]) triples read from the checkpoint one expert at a
    time: hub tensors per expert, or one expert's slice of a stacked
    tensor (transformers 5's [E, 2F, D] / [E, D, F]; gpt-oss's [E, D, 2F]
    with gate and up interleaved, [E, F, D]). The experts module's own
    matrices stay stand-ins: no block of experts ever exists whole."""
    from ._arrays import Lazy

    params = dict(experts.named_parameters())
    fused_gu = ck.find(*_aliases(block_path + ".experts.gate_up_proj"))
    fused_dn = ck.find(*_aliases(block_path + ".experts.down_proj"))
    if "gate_up_proj" in params:
        E, a, b = params["gate_up_proj"].shape
        F, D = (b // 2, a) if layout == "gpt_oss" else (a // 2, b)
    else:
        F, D = params["0.%s.weight" % next(n for n in ("gate_proj", "w1") if "0.%s.weight" % n in params)].shape
    size = next(p for n, p in params.items() if not n.endswith(("_bias", ".bias"))).element_size()
    stored = {}

    def fused(e):
        # one read of the expert's gate/up and down, shared by its three Lazies
        if e not in stored:
            stored.clear()
            gu = ck.weight(fused_gu, lambda k: ck.get_item(k, e))
            dn = ck.weight(fused_dn, lambda k: ck.get_item(k, e))
            if isinstance(gu, Fp8Weight) and layout == "gpt_oss":
                raise ValueError("%s: %s is FP8 in gpt-oss's interleaved layout, which Colibri does not read"
                                 % (ck.path, fused_gu))
            want_gu, want_dn = ((D, 2 * F), (F, D)) if layout == "gpt_oss" else ((2 * F, D), (D, F))
            if tuple(gu.shape) != want_gu or tuple(dn.shape) != want_dn:
                raise ValueError("%s: %s[%d] / %s[%d] have shapes %s / %s, the model needs %s / %s"
                                 % (ck.path, fused_gu, e, fused_dn, e, tuple(gu.shape), tuple(dn.shape), want_gu,
                                    want_dn))
            if layout == "gpt_oss":
                stored[e] = (gu[:, 0::2].t(), gu[:, 1::2].t(), dn.t())
            elif isinstance(gu, Fp8Weight):
                stored[e] = (gu.rows(0, F), gu.rows(F, 2 * F), dn)
            else:
                stored[e] = (gu[:F], gu[F:], dn)
        return stored[e]

    def lazy(e, i, shape):
        if fused_gu is not None and fused_dn is not None:
            return Lazy(shape, lambda: fused(e)[i], shape[0] * shape[1] * size)
        which = ("gate", "up", "down")[i]

        def read():
            w = _expert_matrix(ck, block_path, e, which)
            if tuple(w.shape) != shape:
                raise ValueError("%s: %s.experts.%d %s has shape %s, the model needs %s"
                                 % (ck.path, block_path, e, which, tuple(w.shape), shape))
            return w
        return Lazy(shape, read, shape[0] * shape[1] * size)

    return [(lazy(e, 0, (F, D)), lazy(e, 1, (F, D)), lazy(e, 2, (D, F))) for e in range(n_experts)]


def _load_expert_biases(ck, block_path, experts):
    """The experts module's biases (gpt-oss), small enough to read whole."""
    for name, p in list(experts.named_parameters()):
        if not name.endswith(("_bias", ".bias")):
            continue
        found = ck.find(*_aliases(block_path + ".experts." + name))
        if found is None:
            raise ValueError("%s: tensor %s.experts.%s is missing" % (ck.path, block_path, name))
        value = ck.get(found)
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError("%s: %s has shape %s in the checkpoint, the model needs %s"
                             % (ck.path, found, tuple(value.shape), tuple(p.shape)))
        owner = experts.get_submodule(name.rpartition(".")[0]) if "." in name else experts
        setattr(owner, name.rpartition(".")[2], nn.Parameter(value, requires_grad=False))


def _with_shared(ck, block_path, experts, fp8):
    """What an expert_source returns for a block: its routed experts, and
    with an FP8 shared expert ({linear name: Fp8Weight}) a dict that also
    gives Colibri the shared expert's weights with their scales."""
    if not fp8:
        return experts
    names = next((n for n in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")) if all(k in fp8 for k in n)),
                 None)
    if names is None or len(fp8) != 3:
        raise ValueError("%s: block %s's FP8 shared expert has weights %s; expected gate_proj, up_proj and down_proj"
                         % (ck.path, block_path, sorted(fp8)))
    return {"experts": experts, "shared": tuple(fp8[n] for n in names)}


def open_checkpoint(path):
    """A checkpoint directory for accelerate(checkpoint=): its safetensors
    index, and for a block-scaled FP8 one (config.json's
    quantization_config) the scale tiles."""
    import json

    cfg_path = os.path.join(path, "config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError("%s: cannot be read as a checkpoint's config.json (%s)" % (cfg_path, e)) from None
    quant = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    ck = _Checkpoint(path)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        if method != "fp8":
            raise ValueError("%s: quantization_config.quant_method = %r: accelerate(checkpoint=) reads 16/32-bit and "
                             "block-scaled FP8 checkpoints" % (cfg_path, method))
        ck.fp8_block = checkpoint_block_size(quant, cfg_path)
    return ck


def checkpoint_stored_dtype(ck, block_path, block):
    """The stored type of a block's first expert matrix in the checkpoint:
    "fp8_e4m3" or a torch float dtype (accelerate(checkpoint=)'s default)."""
    fused = ck.find(*_aliases(block_path + ".experts.gate_up_proj"))
    first = (ck.weight(fused, lambda k: ck.get_item(k, 0)) if fused is not None
             else _expert_matrix(ck, block_path, 0, "gate"))
    return first.dtype_name if isinstance(first, Fp8Weight) else first.dtype


def checkpoint_expert_source(ck, blocks):
    """accelerate()'s expert_source for the checkpoint `ck` (open_checkpoint)
    and the model's blocks {path: module}: each block's routed experts read
    from the checkpoint one expert at a time as stored (an FP8 one with its
    scales), and an FP8 shared expert's weights; float shared experts run
    from the model's own weights."""
    def source(bpath, spec):
        block = blocks[bpath]
        fp8 = {}
        for attr in ("shared_expert", "shared_experts"):
            shared = getattr(block, attr, None)
            if shared is None:
                continue
            for name, mod in shared.named_modules():
                if not isinstance(mod, nn.Linear):
                    continue
                found = ck.find(*_aliases("%s.%s.%s.weight" % (bpath, attr, name)))
                w = ck.weight(found) if found is not None else None
                if isinstance(w, Fp8Weight):
                    if tuple(w.shape) != tuple(mod.weight.shape):
                        raise ValueError("%s: %s has shape %s, the model's %s.%s.%s needs %s"
                                         % (ck.path, found, tuple(w.shape), bpath, attr, name, tuple(mod.weight.shape)))
                    fp8[name] = w
        return _with_shared(ck, bpath, _lazy_experts(ck, bpath, block.experts, spec.n_experts, spec.layout), fp8)
    return source


def _from_checkpoint(path, dtype, dense_dtype, options):
    """A checkpoint directory: the model built on meta; projections and the
    head read one at a time into colibri.nn.Linear (as stored, or quantised
    to dense_dtype / dtype's type), the embedding as stored, each MoE
    block's experts handed to Colibri (accelerate(), quantised to `dtype`
    if given) one expert at a time (_lazy_experts): each is read, converted
    and copied into the packed model before the next is read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from . import torch as ctorch
    from .quant import QUANTIZED, block_elements, split_dtype

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError("%s: no config.json (not a Hugging Face checkpoint directory)" % path)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:
        raise ValueError("%s: config.json cannot be read by transformers (%s)" % (path, e)) from None
    quant = getattr(config, "quantization_config", None)
    fp8_block = None
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
        if method != "fp8":
            raise ValueError("%s: quantization_config.quant_method = %s: from_pretrained reads 16/32-bit and "
                             "block-scaled FP8 checkpoints; convert this one with `colibri convert --hf`, or use a "
                             "GGUF file" % (path, method))
        fp8_block = checkpoint_block_size(quant, os.path.join(path, "config.json"))
        # Built without transformers' FP8 layers (CUDA/XPU only); Colibri
        # computes the FP8 tensors as stored (colibri.fp8).
        del config.quantization_config
    if dtype is not None:
        split_dtype(dtype)  # ValueError naming the known types
    if dense_dtype is None and dtype is not None:
        dense_dtype = split_dtype(dtype)[0]
    ck = _Checkpoint(path)
    ck.fp8_block = fp8_block
    config.dtype = torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    blocks = {name: m for name, m in model.named_modules() if isinstance(getattr(m, "experts", None), nn.Module)}
    if not blocks:
        raise ValueError("%s: the %s model has no MoE blocks Colibri recognises" % (path, config.model_type))
    in_blocks = [b + s for b in blocks for s in (".experts", ".shared_expert", ".shared_experts")]
    linear_opts = dict(threads=options["threads"], exact=options["exact_prefill"], huge_pages=options["huge_pages"],
                       lock=options["lock"])

    def stored_dtype(weight, key):
        if isinstance(weight, Fp8Weight):
            return weight.dtype_name
        stored = _TORCH_DTYPES.get(weight.dtype)
        if stored is None:
            raise ValueError("%s: tensor %s is %s; from_pretrained reads f32, f16 and bf16 checkpoints"
                             % (path, key, weight.dtype))
        return stored

    def as_bytes(weight):
        if isinstance(weight, Fp8Weight):
            return weight.packed()
        return weight.contiguous().view(torch.uint8).reshape(weight.shape[0], -1)

    def checked(name, want_shape):
        key = ck.find(*_aliases(name + ".weight"))
        if key is None and name == "lm_head" and getattr(config, "tie_word_embeddings", False):
            key = ck.find("model.embed_tokens.weight")
        if key is None:
            raise ValueError("%s: tensor %s.weight is missing" % (path, name))
        w = ck.weight(key)
        if tuple(w.shape) != want_shape:
            raise ValueError("%s: tensor %s has shape %s, the model's %s needs %s"
                             % (path, key, tuple(w.shape), name, want_shape))
        return key, w

    for name, mod in list(model.named_modules()):
        if any(name == p or name.startswith(p + ".") for p in in_blocks):
            continue
        parent, _, leaf = name.rpartition(".")
        if isinstance(mod, nn.Linear) and not (parent in blocks and leaf in ("gate", "shared_expert_gate")):
            key, w = checked(name, (mod.out_features, mod.in_features))
            bias = None
            if mod.bias is not None:
                bias = ck.get(ck.find(*_aliases(name + ".bias")) or name + ".bias").float()
            stored = stored_dtype(w, key)
            want = dense_dtype or stored
            if want in QUANTIZED and mod.in_features % block_elements(want):
                want = stored  # rows too short for the format's blocks
            if want in QUANTIZED and mod.in_features % block_elements(want):
                want = "f32"  # an FP8 tensor whose rows end inside a block: widened (Linear takes whole blocks)
            if want == stored:
                rows, lin_dtype = as_bytes(w), stored
            elif isinstance(w, Fp8Weight):
                w = w.dequantize()
                rows = as_bytes(w.to(_FLOAT_TORCH[want])) if want in _FLOAT_TORCH else _quantize_rows(w, want)
                lin_dtype = want
            else:
                # Quantised a block of rows at a time, and the 16-bit tensor
                # dropped before Colibri copies the rows: the transient is
                # the tensor plus its quantised rows, not a float32 copy too.
                rows, lin_dtype = _quantize_rows(w, want), want
            del w
            lin = cnn.Linear(rows, lin_dtype, mod.out_features, mod.in_features, bias, name=key, **linear_opts)
            del rows
            _set_module(model, name, lin)
        elif isinstance(mod, nn.Embedding):
            key, w = checked(name, (mod.num_embeddings, mod.embedding_dim))
            _set_module(model, name, cnn.Embedding(as_bytes(w), stored_dtype(w, key), mod.num_embeddings,
                                                   mod.embedding_dim, name=key))
    small = {}
    for key, p in model.state_dict(keep_vars=True).items():
        if not p.is_meta or any(key.startswith(pre + ".") for pre in in_blocks):
            continue
        found = ck.find(*_aliases(key))
        if found is None:
            raise ValueError("%s: tensor %s is missing" % (path, key))
        v = ck.floats(found)
        if tuple(v.shape) != tuple(p.shape):
            if v.numel() != p.numel():
                raise ValueError("%s: tensor %s has shape %s, the model needs %s"
                                 % (path, found, tuple(v.shape), tuple(p.shape)))
            v = v.reshape(p.shape)
        small[key] = v.float()
    model.load_state_dict(small, strict=False, assign=True)
    _materialise_buffers(model, path)
    n_experts = (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
                 or getattr(config, "n_routed_experts", None))
    reports = []
    for bpath, block in blocks.items():
        _load_expert_biases(ck, bpath, block.experts)
        fused = ck.find(*_aliases(bpath + ".experts.gate_up_proj"))
        first = (ck.weight(fused, lambda k: ck.get_item(k, 0)) if fused is not None
                 else _expert_matrix(ck, bpath, 0, "gate"))
        _placeholder_weights(block.experts, first.dtype)
        del first
        shared_fp8 = {}  # an FP8 shared expert: its weights go to Colibri with their scales, stand-ins stay here
        for attr in ("shared_expert", "shared_experts"):  # Qwen's one, DeepSeek's and GLM's merged ones
            shared = getattr(block, attr, None)
            if shared is None:
                continue
            for pname, p in list(shared.named_parameters()):
                key = bpath + "." + attr + "." + pname
                found = ck.find(*_aliases(key))
                if found is None:
                    raise ValueError("%s: tensor %s is missing" % (path, key))
                owner = shared.get_submodule(pname.rpartition(".")[0]) if "." in pname else shared
                w = ck.weight(found)
                if isinstance(w, Fp8Weight):
                    shared_fp8[pname.rpartition(".")[0]] = w
                    w = torch.zeros((), dtype=w.dtype).expand(w.shape)
                setattr(owner, pname.rpartition(".")[2], nn.Parameter(w, requires_grad=False))

        def source(_, spec, b=bpath, m=block.experts, fp8=shared_fp8):
            return _with_shared(ck, b, _lazy_experts(ck, b, m, n_experts, spec.layout), fp8)

        report = ctorch.accelerate(
            block, dtype=dtype, threads=options["threads"], exact_prefill=options["exact_prefill"],
            lock=options["lock"], huge_pages=options["huge_pages"], bf16_compute=options["bf16_compute"],
            expert_source=source)
        if not report.accelerated:
            raise ValueError("%s: Colibri cannot run block %s: %s" % (path, bpath, report.skipped))
        reports.append(report)
    _colibri_norms(model)
    _check_complete(model, path)
    model._colibri_report = reports
    return model
