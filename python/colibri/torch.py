"""PyTorch integration: ColibriExperts and accelerate(model).

    import colibri.torch as ct

    experts = ct.ColibriExperts(gate_up_proj=gu, down_proj=dp, dtype="f16")
    y = experts(x, ids, weights)               # x [N, D], ids/weights [N, k]

    report = ct.accelerate(model)              # every recognised MoE block
    print(report)

Both run the experts' SwiGLU FFNs in Colibri (the C library copies the
weights at open, so a ColibriExperts keeps no reference to the tensors it was
built from). accelerate() keeps each block's router in PyTorch and replaces
only the expert computation, so the model's outputs stay what they were
within rounding. Inference only: a block falls back to its original PyTorch
forward whenever gradients are wanted (training mode, or autograd recording
with an input that requires grad), so run the model under torch.no_grad() or
torch.inference_mode() to get Colibri.

Blocks are recognised by attribute names and shapes, without importing
transformers:

  family        block                                       experts
  mixtral       .gate (Linear [E, D]), .top_k               .experts[i].w1/.w3/.w2
  qwen2_moe     .gate, .top_k, .norm_topk_prob,             .experts[i].gate_proj/.up_proj/.down_proj
                .shared_expert, .shared_expert_gate
  qwen3_moe,    .gate, .top_k, .norm_topk_prob              .experts[i].gate_proj/.up_proj/.down_proj
  olmoe
  deepseek_v2   .gate (weight, top_k, scoring_func softmax, .experts[i].gate_proj/..., .shared_experts
                topk_method, n_group, topk_group, ...)
  deepseek_v3   .gate (... e_score_correction_bias)         as deepseek_v2
  fused         .experts.gate_up_proj [E, 2F, D] (gate rows first), .experts.down_proj [E, D, F],
                experts(hidden, top_k_index, top_k_weights) (transformers' fused experts modules)
  gpt_oss       .router (weight [E, D], bias [E], top_k)    GptOssExperts: gate_up_proj [E, D, 2F]
                                                            (gate and up columns interleaved) and
                                                            down_proj [E, F, D] with their biases,
                                                            .alpha, .limit (the clamped SwiGLU)
"""

import ctypes
import dataclasses
import re
import types
import warnings
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import _arrays as A
from . import _lib as L
from .model import Model, RouterConfig

__all__ = ["ColibriExperts", "accelerate", "restore", "AccelerateReport", "AcceleratedBlock", "recognise", "from_pretrained"]

_DTYPES = {
    "f32": "f32", "float32": "f32", "fp32": "f32", torch.float32: "f32",
    "f16": "f16", "float16": "f16", "fp16": "f16", "half": "f16", torch.float16: "f16",
    "bf16": "bf16", "bfloat16": "bf16", torch.bfloat16: "bf16",
}


_BLOCK_DTYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "mxfp4", "iq4_nl",
                 "iq4_xs", "fp8_e4m3", "tq1_0", "tq2_0", "q4_k_m")


def _colibri_dtype(dtype, like=None):
    """'f32'/'f16'/'bf16' from a name or torch dtype, or a block format's
    name (the weights are quantised on load); None = like's dtype (float32
    for anything Colibri does not store)."""
    if dtype is None:
        if like is not None and like.dtype in _DTYPES:
            return _DTYPES[like.dtype]
        if like is not None and like.dtype == torch.float8_e4m3fn:
            return "fp8_e4m3"  # stand-ins of a block-scaled FP8 checkpoint's experts (colibri.fp8)
        return "f32"
    if isinstance(dtype, str) and dtype in _BLOCK_DTYPES:
        return dtype
    try:
        return _DTYPES[dtype]
    except (KeyError, TypeError):
        raise ValueError("dtype must be 'f32', 'f16', 'bf16', the matching torch dtype, or a block format (%s), "
                         "got %r" % (", ".join(_BLOCK_DTYPES), dtype)) from None


def _tensor_bytes(layer):
    """Bytes of the expert (and shared expert) weights in a layer dict."""
    total = 0
    for key in ("experts", "shared", "gate_up_proj", "down_proj"):
        v = layer.get(key)
        items = v if isinstance(v, (list, tuple)) else [v]
        for item in items:
            for t in (item if isinstance(item, (list, tuple)) else [item]):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
                elif isinstance(t, A.Lazy):
                    total += t.nbytes
    return total


_grad_warned = False


def _warn_no_grad():
    global _grad_warned
    if not _grad_warned:
        _grad_warned = True
        warnings.warn("ColibriExperts computes no gradients: its output is detached from autograd "
                      "(run under torch.no_grad() or torch.inference_mode())", stacklevel=3)


# --------------------------------------------------------------- ColibriExperts


class ColibriExperts(nn.Module):
    """The experts of one MoE layer, run by Colibri.

    Built from in-memory weights through colibri_open_memory:

      ColibriExperts(gate, up, down, dtype=None, threads=0)
        gate/up: per-expert [F, D] tensors (a list) or stacked [E, F, D];
        down: per-expert [D, F] or stacked [E, D, F] (nn.Linear.weight layout:
        w1/gate_proj, w3/up_proj, w2/down_proj).
      ColibriExperts(gate_up_proj=..., down_proj=...)
        the fused layout, gate_up_proj [E, 2F, D] (gate rows first),
        down_proj [E, D, F].

    Options: dtype ('f32', 'f16', 'bf16' or a torch dtype; None = the
    weights' dtype), shared=(gate [S, D], up [S, D], down [D, S]) a shared
    expert added to every token, shared_gate [D] (or [1, D]: Qwen2-MoE's
    shared_expert_gate.weight) scaling it by sigmoid(shared_gate . x);
    router [E, D] + router_config (RouterConfig or dict: family, top_k,
    norm_topk_prob, n_group, topk_group, routed_scaling_factor) + router_bias
    [E] for a built-in router; threads, bf16_compute, exact_prefill, lock,
    huge_pages as in colibri.Model.

    forward(x [..., D], ids [..., k] = None, weights [..., k] = None) ->
    [..., D] in x's dtype. ids int64 (torch.topk's) or int32, -1 = no
    expert; weights any float dtype, applied as given. Without ids the
    built-in router chooses. No parameters are registered (the weights live
    in Colibri), so state_dict() is empty and gradients are not computed.
    """

    def __init__(self, gate=None, up=None, down=None, *, gate_up_proj=None, down_proj=None, dtype=None,
                 shared=None, shared_gate=None, router=None, router_config=None, router_bias=None,
                 threads=0, bf16_compute=False, lock=True, huge_pages=True, exact_prefill=False):
        super().__init__()
        if gate_up_proj is not None or (down_proj is not None and gate is None):
            if gate is not None or up is not None or down is not None:
                raise ValueError("give gate/up/down or gate_up_proj/down_proj, not both")
            if gate_up_proj is None or down_proj is None:
                raise ValueError("the fused layout needs both gate_up_proj [E, 2F, D] and down_proj [E, D, F]")
            layer = {"gate_up_proj": _detached(gate_up_proj), "down_proj": _detached(down_proj)}
            like = gate_up_proj
        else:
            if gate is None or up is None or down is None:
                raise ValueError("ColibriExperts needs gate, up and down weights (or gate_up_proj and down_proj)")
            layer = {"experts": _triples(gate, up, down)}
            like = layer["experts"][0][0]
        if not isinstance(like, torch.Tensor):
            raise TypeError("expert weights must be torch tensors, got %s" % type(like).__name__)
        cdtype = _colibri_dtype(dtype, like)
        if shared is not None:
            if not isinstance(shared, (tuple, list)) or len(shared) != 3:
                raise ValueError("shared must be (gate [S, D], up [S, D], down [D, S])")
            layer["shared"] = tuple(_detached(t) for t in shared)
        if shared_gate is not None:
            layer["shared_gate"] = _detached(shared_gate)
        rc = RouterConfig.coerce(router_config)
        if (router is None) != (rc is None):
            raise ValueError("a built-in router needs both router (weights [E, D]) and router_config")
        if router is not None:
            layer["router"] = _detached(router)
        if router_bias is not None:
            layer["router_bias"] = _detached(router_bias)
        model = Model.from_arrays([layer], dtype=cdtype, router=rc, threads=threads, lock=lock,
                                  huge_pages=huge_pages, bf16_compute=bf16_compute, exact_prefill=exact_prefill)
        self._bind(model, 0)

    def _bind(self, model, layer):
        self.colibri_model = model
        self.layer = layer
        info = model.info
        self.n_experts = info.n_experts
        self.d_model = info.d_model
        self.d_ff = info.d_ff
        self.dtype_name = info.dtype
        self.top_k = info.router_top_k or None

    @classmethod
    def _view(cls, model, layer):
        """A ColibriExperts for layer `layer` of an existing (multi-layer) model."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._bind(model, layer)
        return self

    @classmethod
    def from_moe_block(cls, block, dtype=None, threads=0, router=True, **options):
        """A ColibriExperts holding a recognised MoE block's experts, shared
        expert (with its gate) and, with router=True, the block's router as
        Colibri's built-in router of the block's family, so that
        forward(x) with no ids computes what the block computes."""
        spec = recognise(block)
        if isinstance(spec, str):
            raise ValueError("not a recognised MoE block: %s" % spec)
        layer = spec.layer_dict(shared_in_colibri=True)
        if spec.shared is not None and not spec.shared_in_colibri:
            raise ValueError("the block's shared expert cannot be represented in Colibri: %s" % spec.shared_note)
        rc = None
        if router:
            rc, rw, rb = spec.router_for_colibri()
            layer["router"] = rw
            if rb is not None:
                layer["router_bias"] = rb
        cdtype = _colibri_dtype(dtype, spec.weight_like)
        model = Model.from_arrays([layer], dtype=cdtype, router=rc, threads=threads, **spec.model_options(),
                                  **options)
        return cls._view(model, 0)

    def extra_repr(self):
        s = "experts=%d, d_model=%d, d_ff=%d, dtype=%s" % (self.n_experts, self.d_model, self.d_ff, self.dtype_name)
        info = self.colibri_model.info if not self.colibri_model.closed else None
        if info is not None:
            if info.n_layers > 1:
                s += ", layer=%d of %d" % (self.layer, info.n_layers)
            if info.shared_d_ff:
                s += ", shared_d_ff=%d" % info.shared_d_ff
            if info.router_family:
                s += ", router=%s, top_k=%d" % (info.router_family, info.router_top_k)
        else:
            s += ", closed"
        return s

    def close(self):
        """Frees the Colibri model (shared by every layer view of it)."""
        self.colibri_model.close()

    def forward(self, x, ids=None, weights=None):
        out = self._forward_fast(x, ids, weights)
        if out is not None:
            return out
        if not isinstance(x, torch.Tensor):
            raise TypeError("x must be a torch.Tensor, got %s" % type(x).__name__)
        if torch.is_grad_enabled() and x.requires_grad:
            _warn_no_grad()
        if x.dim() < 1 or x.shape[-1] != self.d_model:
            raise ValueError("x must be [..., %d] (d_model), got shape %s" % (self.d_model, list(x.shape)))
        shape = x.shape
        x2 = x.detach().reshape(-1, self.d_model)
        x32 = x2 if x2.dtype == torch.float32 else x2.float()
        x32 = x32.contiguous()
        if ids is not None:
            if weights is None:
                raise ValueError("ids and weights go together: give both, or neither to use the built-in router")
            if not isinstance(ids, torch.Tensor) or not isinstance(weights, torch.Tensor):
                raise TypeError("ids and weights must be torch tensors")
            k = ids.shape[-1] if ids.dim() else 0
            ids = ids.detach().reshape(-1, k)
            if ids.dtype not in (torch.int32, torch.int64):
                raise TypeError("ids must be int32 or int64, got %s" % ids.dtype)
            ids = ids.contiguous()
            weights = weights.detach().reshape(-1, k)
            if not weights.is_floating_point():
                raise TypeError("weights must be floating point, got %s" % weights.dtype)
            if weights.dtype != torch.float32:
                weights = weights.float()
            weights = weights.contiguous()
        elif weights is not None:
            raise ValueError("weights given without ids")
        out = self.colibri_model.infer(x32, ids, weights, layer=self.layer)
        if x.dtype != torch.float32:
            out = out.to(x.dtype)
        return out.view(shape)

    def _forward_fast(self, x, ids, weights):
        """The common call inside a model (float32 CPU x [N, D], ids [N, k]
        int64 or int32, float32 weights, contiguous, no autograd) with
        attribute tests for checks and one C call; None for anything else,
        which forward() then checks and converts in full."""
        if (ids is None or weights is None or type(x) is not torch.Tensor or type(ids) is not torch.Tensor
                or type(weights) is not torch.Tensor or x.dtype is not torch.float32
                or weights.dtype is not torch.float32 or x.device.type != "cpu" or ids.device.type != "cpu"
                or weights.device.type != "cpu" or x.dim() != 2 or ids.dim() != 2
                or x.shape[1] != self.d_model or (x.requires_grad and torch.is_grad_enabled())
                or not x.is_contiguous()):
            return None
        n, k = ids.shape
        if n != x.shape[0] or tuple(weights.shape) != (n, k) or not 1 <= k <= self.n_experts:
            return None
        if ids.dtype is torch.int64:
            ids = ids.to(torch.int32)
        elif ids.dtype is not torch.int32:
            return None
        if not ids.is_contiguous():
            ids = ids.contiguous()
        if not weights.is_contiguous():
            weights = weights.contiguous()
        out = torch.empty_like(x)
        if n:
            self.colibri_model._infer_pointers(self.layer, n, k, x.data_ptr(), ids.data_ptr(), weights.data_ptr(),
                                               out.data_ptr())
        return out

    def route(self, x):
        """The built-in router's choice for x [N, D]: (ids int32 [N, k],
        weights float32 [N, k])."""
        x32 = x.detach().reshape(-1, self.d_model).float().contiguous()
        return self.colibri_model.route(x32, layer=self.layer)


def _detached(t):
    if isinstance(t, torch.Tensor):
        return t.detach()
    return t


def _triples(gate, up, down):
    """[(gate, up, down)] per expert from lists or stacked tensors."""
    def split(w, name):
        if isinstance(w, torch.Tensor):
            if w.dim() != 3:
                raise ValueError("%s must be a list of 2-D tensors or a stacked 3-D tensor, got shape %s"
                                 % (name, list(w.shape)))
            return [w[e].detach() for e in range(w.shape[0])]
        if isinstance(w, (list, tuple)):
            return [_detached(t) for t in w]
        raise TypeError("%s must be a tensor or a list of tensors, got %s" % (name, type(w).__name__))

    g, u, d = split(gate, "gate"), split(up, "up"), split(down, "down")
    if not (len(g) == len(u) == len(d)) or not g:
        raise ValueError("gate, up and down must hold the same number (>= 1) of experts, got %d, %d, %d"
                         % (len(g), len(u), len(d)))
    return list(zip(g, u, d))


# ------------------------------------------------------------------ recognition


def _is_silu(act):
    """Whether act is SiLU (None, a missing activation, is not: nothing says
    what the module computes)."""
    if act is None:
        return False
    if act is F.silu or isinstance(act, nn.SiLU):
        return True
    return type(act).__name__.lower() in ("siluactivation", "silu", "swish")


def _plain_weight(mod):
    """mod's weight if mod acts like a bias-free nn.Linear with a float weight; else None."""
    w = getattr(mod, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point() or w.device.type != "cpu":
        return None
    if getattr(mod, "bias", None) is not None:
        return None
    return w


def _act_of(mod):
    for name in ("act_fn", "act", "activation_fn"):
        if hasattr(mod, name):
            return getattr(mod, name)
    return None


_NAMINGS = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


def _mlp_weights(mod):
    """(gate, up, down) weights of a SwiGLU MLP module, with its naming, or
    (None, reason)."""
    for names in _NAMINGS:
        if all(hasattr(mod, n) for n in names):
            ws = [_plain_weight(getattr(mod, n)) for n in names]
            if any(w is None for w in ws):
                return None, "%s are not bias-free float Linear layers on the CPU" % "/".join(names)
            if not _is_silu(_act_of(mod)):
                return None, "activation %s is not SiLU" % type(_act_of(mod)).__name__
            g, u, d = ws
            F_, D = g.shape
            if u.shape != (F_, D) or d.shape != (D, F_):
                return None, "%s shapes %s, %s, %s are not [F, D], [F, D], [D, F]" % (
                    "/".join(names), list(g.shape), list(u.shape), list(d.shape))
            return (g, u, d, names[0]), None
    return None, "no w1/w2/w3 or gate_proj/up_proj/down_proj"


@dataclasses.dataclass
class _Spec:
    family: str
    layout: str  # "experts" (one module per expert) or "fused"
    n_experts: int
    d_model: int
    d_ff: int
    top_k: Optional[int]
    experts: list  # [(gate, up, down)] or None for fused
    fused: tuple = None  # (gate_up_proj, down_proj)
    shared: tuple = None  # (gate, up, down) weights of a shared expert
    shared_gate: torch.Tensor = None  # [1, D] weight
    shared_in_colibri: bool = False
    shared_note: str = ""
    norm_topk_prob: bool = True
    gate_weight: torch.Tensor = None
    gate_bias_ok: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    e_score_correction_bias: torch.Tensor = None
    returns_logits: bool = True
    router_problem: str = ""  # why the block's router cannot be Colibri's built-in one
    known_block: bool = False  # a transformers 5 block whose whole forward _fused_block_forward reproduces
    # gpt-oss: the clamped SwiGLU and the experts' biases (gate [E, F], up
    # [E, F], down [E, D]); the router's bias.
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    biases: tuple = None
    router_bias: torch.Tensor = None
    dense_scores: bool = False  # transformers 4.57's GptOssExperts takes routing weights as [N, E]

    @property
    def weight_like(self):
        return self.fused[0] if self.fused is not None else self.experts[0][0]

    def group_key(self, cdtype):
        s = self.shared[0].shape[0] if (self.shared is not None and self.shared_in_colibri) else 0
        return (cdtype, self.n_experts, self.d_model, self.d_ff, s,
                self.shared_gate is not None and self.shared_in_colibri,
                self.activation, self.swiglu_alpha, self.swiglu_limit, self.biases is not None)

    def model_options(self):
        """Model.from_arrays's activation arguments for this block."""
        return {"activation": self.activation, "swiglu_alpha": self.swiglu_alpha, "swiglu_limit": self.swiglu_limit}

    def layer_dict(self, shared_in_colibri):
        if self.layout == "gpt_oss":
            gu, dp = self.fused[0].detach(), self.fused[1].detach()
            # [E, D, 2F] with gate and up columns interleaved; [E, F, D].
            d = {"experts": (gu[:, :, 0::2].transpose(1, 2), gu[:, :, 1::2].transpose(1, 2), dp.transpose(1, 2))}
        elif self.fused is not None:
            d = {"gate_up_proj": self.fused[0].detach(), "down_proj": self.fused[1].detach()}
        else:
            d = {"experts": [tuple(w.detach() for w in t) for t in self.experts]}
        if self.biases is not None:
            d["gate_bias"], d["up_bias"], d["down_bias"] = (b.detach() for b in self.biases)
        if shared_in_colibri and self.shared is not None and self.shared_in_colibri:
            d["shared"] = tuple(w.detach() for w in self.shared)
            if self.shared_gate is not None:
                d["shared_gate"] = self.shared_gate.detach()
        return d

    def without_weights(self):
        """A copy that keeps what the patched forward needs and no reference
        to any weight (Colibri has its own copy)."""
        return dataclasses.replace(self, experts=None, fused=None,
                                   shared=None if self.shared is None else ("present",), shared_gate=None,
                                   gate_weight=None, e_score_correction_bias=None, biases=None, router_bias=None)

    def router_for_colibri(self):
        """(RouterConfig, router weight, router bias) for Colibri's built-in
        router, matching the family's rule."""
        if self.router_problem:
            raise ValueError("the block's router has no built-in equivalent: %s" % self.router_problem)
        if self.gate_weight is None or not self.gate_bias_ok:
            raise ValueError("the block's router is not a bias-free [E, D] linear map")
        if self.top_k is None:
            raise ValueError("the block has no top_k")
        fam = self.family if self.family in L.ROUTER_CODES else "mixtral"
        rc = RouterConfig(family=fam, top_k=self.top_k, norm_topk_prob=bool(self.norm_topk_prob), n_group=self.n_group,
                          topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor)
        rb = self.e_score_correction_bias if self.e_score_correction_bias is not None else self.router_bias
        return rc, self.gate_weight.detach(), None if rb is None else rb.detach()


def _int_attr(obj, name):
    v = getattr(obj, name, None)
    if isinstance(v, bool) or v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _shared_spec(spec, mlp, gate_mod):
    """Fills spec.shared* from a shared-expert MLP and its optional gate."""
    if mlp is None:
        return
    r, why = _mlp_weights(mlp)
    if r is None:
        spec.shared = ("pytorch",)
        spec.shared_in_colibri = False
        spec.shared_note = why
        return
    g, u, d, _ = r
    spec.shared = (g, u, d)
    spec.shared_in_colibri = d.shape[0] == spec.d_model
    spec.shared_note = "" if spec.shared_in_colibri else "shared expert d_model %d != %d" % (d.shape[0], spec.d_model)
    if gate_mod is not None:
        gw = _plain_weight(gate_mod)
        if gw is None or tuple(gw.shape) != (1, spec.d_model):
            spec.shared_in_colibri = False
            spec.shared_note = "shared_expert_gate is not a bias-free Linear(d_model, 1)"
        else:
            spec.shared_gate = gw


def _experts_list(experts):
    if isinstance(experts, (nn.ModuleList, list, tuple, nn.Sequential)):
        return list(experts)
    return None


# What transformers' use_experts_implementation decorator records about a
# fused experts module, and the values that mean "concatenated [gate; up]
# rows, [E, out, in] weights, no bias, no norm after the expert": exactly the
# engine's SwiGLU.
_FUSED_FLAGS = (("has_gate", True), ("has_bias", False), ("is_transposed", False), ("is_concatenated", True),
                ("has_post_expert_norm", False))
# Attributes of gating variants the engine does not compute (gpt-oss's
# clamped SwiGLU keeps its clamp in .limit and its sigmoid scale in .alpha).
_GATING_VARIANT_ATTRS = ("limit", "alpha", "swiglu_limit", "clamp_limit")
_FUSED_BIASES = ("gate_up_proj_bias", "down_proj_bias", "up_proj_bias")


def _fused_experts_problem(experts):
    """None if a fused experts module computes exactly
    down . (silu(gate . x) * (up . x)) per expert, else why not."""
    for name, want in _FUSED_FLAGS:
        v = getattr(experts, name, want)
        if bool(v) != want:
            return "%s=%r: the engine computes concatenated [gate; up] rows in [E, out, in] layout, " \
                   "without bias or a norm after the expert" % (name, v)
    for name in _FUSED_BIASES:
        if isinstance(getattr(experts, name, None), torch.Tensor):
            return "biased experts (%s)" % name
    apply_gate = getattr(type(experts), "_apply_gate", None)
    if apply_gate is not None and (getattr(apply_gate, "__module__", None), getattr(apply_gate, "__name__", None)) \
            != ("transformers.integrations.moe", "_default_apply_gate"):
        return "a custom _apply_gate (%s): not silu(gate) * up" % getattr(apply_gate, "__qualname__", apply_gate)
    for name in _GATING_VARIANT_ATTRS:
        if getattr(experts, name, None) is not None:
            return "a gating variant (.%s = %r): not plain silu(gate) * up" % (name, getattr(experts, name))
    act = _act_of(experts)
    if not _is_silu(act):
        return "activation %s is not SiLU" % ("None" if act is None else type(act).__name__)
    return None


@dataclasses.dataclass
class _RouterRule:
    family: str  # Colibri's router family
    top_k: Optional[int]
    norm_topk_prob: bool
    weight: torch.Tensor
    bias_free: bool
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    e_score_correction_bias: torch.Tensor = None


def _deepseek_rule(gate, E):
    """The _RouterRule of a DeepSeek-style gate (softmax or sigmoid scores,
    groups, scaling, V3's correction bias), or why it is not known.

    Two codes exist: the models' own remote code (its gate has
    .scoring_func; renormalises only for k > 1) and transformers' classes
    (no .scoring_func; V2 never renormalises, only scales; V3 renormalises
    for any k; the group count is .num_group in both of V2's and in V3's 5.x
    router, .n_group in V3's 4.57 one)."""
    remote = hasattr(gate, "scoring_func")
    scoring = getattr(gate, "scoring_func", None)
    bias = getattr(gate, "e_score_correction_bias", None)
    method = getattr(gate, "topk_method", None)
    top_k = _int_attr(gate, "top_k")
    if top_k is None:
        return "DeepSeek-style gate without top_k"
    if scoring in (None, "sigmoid") and isinstance(bias, torch.Tensor) and method in (None, "noaux_tc"):
        fam = "deepseek_v3"
    elif scoring in (None, "softmax") and bias is None and method in ("greedy", "group_limited_greedy"):
        fam = "deepseek_v2"
    else:
        return "DeepSeek-style gate with scoring_func=%r, topk_method=%r, e_score_correction_bias %s: not a " \
               "known combination" % (scoring, method, "present" if bias is not None else "absent")
    n_group = _int_attr(gate, "n_group") or _int_attr(gate, "num_group") or 1
    topk_group = _int_attr(gate, "topk_group") or 1
    if fam == "deepseek_v2" and method == "greedy":
        n_group, topk_group = 1, 1
    if n_group > 1 and E % n_group:
        return "n_group %d does not divide %d experts" % (n_group, E)
    if not 1 <= topk_group <= n_group:
        return "topk_group %d is not in [1, n_group %d]" % (topk_group, n_group)
    norm = bool(getattr(gate, "norm_topk_prob", False))
    if remote:
        norm = norm and top_k > 1
    elif fam == "deepseek_v2":
        norm = False
    gw = getattr(gate, "weight", None)
    return _RouterRule(family=fam, top_k=top_k, norm_topk_prob=norm, weight=gw,
                       bias_free=getattr(gate, "bias", None) is None, n_group=n_group, topk_group=topk_group,
                       routed_scaling_factor=float(getattr(gate, "routed_scaling_factor", 1.0) or 1.0),
                       e_score_correction_bias=bias if fam == "deepseek_v3" else None)


def _is_deepseek_gate(gate):
    return any(hasattr(gate, a) for a in ("scoring_func", "topk_method", "n_group", "num_group",
                                          "e_score_correction_bias"))


def _softmax_family(block):
    if hasattr(block, "shared_expert"):
        return "qwen2_moe"
    if "olmoe" in type(block).__name__.lower():
        return "olmoe"
    return "qwen3_moe"


def _router_of(block, E, D):
    """block.gate if it holds an [E, D] router weight, else why not."""
    gate = getattr(block, "gate", None)
    if gate is None:
        return "no .gate router"
    gw = getattr(gate, "weight", None)
    if not isinstance(gw, torch.Tensor) or tuple(gw.shape) != (E, D):
        return ".gate.weight is not [n_experts=%d, d_model=%d]" % (E, D)
    return gate


def _fused_router_rule(block, E, D):
    """The routing rule of a block around fused experts (transformers 5's
    router modules: softmax top-k, or DeepSeek's), or why it is not known."""
    gate = _router_of(block, E, D)
    if isinstance(gate, str):
        return gate
    gw = gate.weight
    if _is_deepseek_gate(gate):
        return _deepseek_rule(gate, E)
    top_k = _int_attr(gate, "top_k") or _int_attr(block, "top_k") or _int_attr(block, "num_experts_per_tok")
    if top_k is None or not 1 <= top_k <= E:
        return "no usable top_k on the block or its gate"
    norm = getattr(gate, "norm_topk_prob", getattr(block, "norm_topk_prob", None))
    # Mixtral's router always renormalises and has no norm_topk_prob.
    fam = "mixtral" if norm is None else _softmax_family(block)
    return _RouterRule(family=fam, top_k=top_k, norm_topk_prob=True if norm is None else bool(norm), weight=gw,
                       bias_free=getattr(gate, "bias", None) is None)


def _spec_from_rule(rule, **fields):
    return _Spec(family=rule.family, top_k=rule.top_k, norm_topk_prob=rule.norm_topk_prob, gate_weight=rule.weight,
                 gate_bias_ok=rule.bias_free, n_group=rule.n_group, topk_group=rule.topk_group,
                 routed_scaling_factor=rule.routed_scaling_factor,
                 e_score_correction_bias=rule.e_score_correction_bias, **fields)


# transformers 5 blocks with a shared expert whose forward is exactly: the
# router module's (logits, weights, indices) on the flattened tokens, the
# experts, plus the shared expert (Qwen: scaled by sigmoid(shared_expert_gate
# . x)). accelerate() replaces their whole forward so that the shared expert
# runs in Colibri too; other fused blocks keep theirs and only their experts
# module's forward is replaced.
_KNOWN_FUSED_BLOCKS = frozenset(("Qwen2MoeSparseMoeBlock", "Qwen3NextSparseMoeBlock", "DeepseekV2Moe",
                                 "DeepseekV3MoE", "Glm4MoeMoE"))


def _fused_module_problem(experts):
    """None if a fused experts module holds float CPU weights gate_up_proj
    [E, 2F, D] and down_proj [E, D, F] and computes exactly the engine's
    SwiGLU, else why not (accelerate() and colibri.experts_backend)."""
    gu, dp = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(dp, torch.Tensor):
        return "no gate_up_proj / down_proj tensors"
    if gu.dim() != 3 or dp.dim() != 3 or gu.shape[1] % 2:
        return "gate_up_proj %s / down_proj %s, expected [E, 2F, D] / [E, D, F]" % (list(gu.shape), list(dp.shape))
    E, F2, D = gu.shape
    if tuple(dp.shape) != (E, D, F2 // 2):
        return "down_proj %s is not [E, D, F] = %s (gate_up_proj %s; a transposed layout?)" % (
            list(dp.shape), [E, D, F2 // 2], list(gu.shape))
    problem = _fused_experts_problem(experts)
    if problem:
        return problem
    if not gu.is_floating_point() or gu.device.type != "cpu" or not dp.is_floating_point():
        return "weights are not floating point on the CPU"
    return None


def _recognise_fused(block, experts, gu, dp):
    problem = _fused_module_problem(experts)
    if problem:
        return "fused experts: " + problem
    E, F2, D = gu.shape
    F_ = F2 // 2
    rule = _fused_router_rule(block, E, D)
    if isinstance(rule, str):
        # The router stays in PyTorch under accelerate(), so the experts can
        # still run here; only a built-in router is out of reach.
        spec = _Spec(family="unknown", layout="fused", n_experts=E, d_model=D, d_ff=F_, top_k=None, experts=None,
                     fused=(gu, dp), returns_logits=False, router_problem=rule)
    else:
        spec = _spec_from_rule(rule, layout="fused", n_experts=E, d_model=D, d_ff=F_, experts=None, fused=(gu, dp),
                               returns_logits=False)
    if hasattr(block, "shared_expert"):
        _shared_spec(spec, block.shared_expert, getattr(block, "shared_expert_gate", None))
    elif getattr(block, "shared_experts", None) is not None:
        _shared_spec(spec, block.shared_experts, None)
    cls = type(block)
    spec.known_block = (cls.__name__ in _KNOWN_FUSED_BLOCKS and cls.__module__.startswith("transformers.models.")
                        and not isinstance(rule, str))
    return spec


def _gpt_oss_experts_spec(experts):
    """The _Spec of transformers' GptOssExperts alone (the clamped SwiGLU
    with biases; no router), or why not."""
    names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    gu, gub, dp, dpb = (getattr(experts, n, None) for n in names)
    if not all(isinstance(t, torch.Tensor) for t in (gu, gub, dp, dpb)):
        return "GptOssExperts without %s" % "/".join(names)
    if gu.dim() != 3 or gu.shape[2] % 2:
        return "gpt-oss gate_up_proj %s is not [E, D, 2F]" % list(gu.shape)
    E, D, F2 = gu.shape
    F_ = F2 // 2
    if tuple(dp.shape) != (E, F_, D) or tuple(gub.shape) != (E, F2) or tuple(dpb.shape) != (E, D):
        return "gpt-oss shapes gate_up_proj %s, its bias %s, down_proj %s, its bias %s are not [E, D, 2F], " \
               "[E, 2F], [E, F, D], [E, D]" % (list(gu.shape), list(gub.shape), list(dp.shape), list(dpb.shape))
    if not gu.is_floating_point() or gu.device.type != "cpu":
        return "gpt-oss weights are not floating point on the CPU"
    alpha, limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
    if not isinstance(alpha, (int, float)) or not isinstance(limit, (int, float)) or not alpha > 0 or not limit > 0:
        return "gpt-oss experts without positive .alpha and .limit"
    return _Spec(family="gpt_oss", layout="gpt_oss", n_experts=E, d_model=D, d_ff=F_, top_k=None, experts=None,
                 fused=(gu, dp), returns_logits=False, norm_topk_prob=True,
                 activation="clamped_swiglu", swiglu_alpha=float(alpha), swiglu_limit=float(limit),
                 biases=(gub[:, 0::2], gub[:, 1::2], dpb),
                 # 4.57 reads the number of experts off the routing weights' last dimension ([N, E]
                 # scores); 5.x takes [N, k] (and has no .expert_dim).
                 dense_scores=hasattr(experts, "expert_dim"))


def _recognise_gpt_oss(block, experts):
    """The _Spec of a gpt-oss block (transformers' GptOssMLP: .router, and
    GptOssExperts computing the clamped SwiGLU with biases), or why not."""
    spec = _gpt_oss_experts_spec(experts)
    if isinstance(spec, str):
        return spec
    E, D = spec.n_experts, spec.d_model
    router = getattr(block, "router", None)
    rw, rb = getattr(router, "weight", None), getattr(router, "bias", None)
    top_k = _int_attr(router, "top_k")
    if not isinstance(rw, torch.Tensor) or tuple(rw.shape) != (E, D) or not isinstance(rb, torch.Tensor) \
            or tuple(rb.shape) != (E,) or top_k is None or not 1 <= top_k <= E:
        return "gpt-oss block without a router of weight [E, D], bias [E] and top_k"
    return dataclasses.replace(spec, top_k=top_k, gate_weight=rw, router_bias=rb)


def recognise(block):
    """The _Spec of a recognised MoE block, or a string saying why not."""
    experts = getattr(block, "experts", None)
    if experts is None:
        return "no .experts"
    if type(experts).__name__ == "GptOssExperts":
        return _recognise_gpt_oss(block, experts)
    # ---- the fused layout: experts.gate_up_proj [E, 2F, D], experts.down_proj [E, D, F]
    gu, dp = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if isinstance(gu, torch.Tensor) and isinstance(dp, torch.Tensor):
        return _recognise_fused(block, experts, gu, dp)
    if isinstance(getattr(experts, "down_proj", None), torch.Tensor) or isinstance(getattr(experts, "up_proj", None),
                                                                                  torch.Tensor):
        return "fused experts without a gate_up_proj [E, 2F, D] (ungated or split layout)"
    # ---- one module per expert
    lst = _experts_list(experts)
    if lst is None:
        return ".experts is neither a list of expert modules nor a fused gate_up_proj/down_proj module"
    if not lst or any(e is None for e in lst):
        return ".experts is empty or has missing experts (expert parallelism?)"
    triples = []
    naming = None
    for i, e in enumerate(lst):
        r, why = _mlp_weights(e)
        if r is None:
            return "experts[%d]: %s" % (i, why)
        g, u, d, nm = r
        if naming is None:
            naming, shape = nm, (g.shape, d.shape)
        elif nm != naming or (g.shape, d.shape) != shape:
            return "experts[%d] differs in naming or shape from experts[0]" % i
        triples.append((g, u, d))
    E = len(triples)
    F_, D = triples[0][0].shape
    gate = _router_of(block, E, D)
    if isinstance(gate, str):
        return gate
    gw = gate.weight

    # DeepSeek: the routing rule lives on the gate module.
    if _is_deepseek_gate(gate):
        if naming != "gate_proj":
            return "DeepSeek-style gate but experts named %s" % naming
        rule = _deepseek_rule(gate, E)
        if isinstance(rule, str):
            return rule
        spec = _spec_from_rule(rule, layout="experts", n_experts=E, d_model=D, d_ff=F_, experts=triples,
                               returns_logits=False)
        _shared_spec(spec, getattr(block, "shared_experts", None), None)
        return spec

    if _plain_weight(gate) is None and not isinstance(gate, nn.Linear):
        return ".gate is not a Linear router"
    top_k = _int_attr(block, "top_k")
    if top_k is None or not 1 <= top_k <= E:
        return "no usable .top_k on the block"
    bias_free = getattr(gate, "bias", None) is None
    if naming == "w1":
        if hasattr(block, "shared_expert"):
            return "w1/w2/w3 experts with a shared expert: not a known family"
        return _spec_from_rule(_RouterRule("mixtral", top_k, True, gw, bias_free), layout="experts", n_experts=E,
                               d_model=D, d_ff=F_, experts=triples)
    if not hasattr(block, "norm_topk_prob"):
        return "gate_proj/up_proj/down_proj experts but no .norm_topk_prob (unknown routing rule)"
    spec = _spec_from_rule(_RouterRule(_softmax_family(block), top_k, bool(block.norm_topk_prob), gw, bias_free),
                           layout="experts", n_experts=E, d_model=D, d_ff=F_, experts=triples)
    if hasattr(block, "shared_expert"):
        _shared_spec(spec, block.shared_expert, getattr(block, "shared_expert_gate", None))
    return spec


# ------------------------------------------------------------------- accelerate


@dataclasses.dataclass
class AcceleratedBlock:
    path: str
    family: str
    layout: str  # "experts" or "fused" (the experts module's forward is replaced)
    n_experts: int
    top_k: Optional[int]
    d_model: int
    d_ff: int
    dtype: str  # Colibri's weight dtype
    shared: Optional[str]  # None, "colibri" or "pytorch"
    colibri_layer: int  # this block's layer in its Colibri model


@dataclasses.dataclass
class AccelerateReport:
    """What accelerate() did: `accelerated` blocks, and `skipped`: (path,
    reason) for MoE-looking modules (with an .experts) left alone.
    `models` are the Colibri models built (one per group of same-shaped
    blocks)."""

    accelerated: List[AcceleratedBlock]
    skipped: List[Tuple[str, str]]
    models: list
    released_bytes: int = 0  # PyTorch weight bytes released (keep_pytorch_weights=False)
    source_bytes: int = 0  # bytes of the PyTorch expert weights taken over, in their dtype
    colibri_bytes: int = 0  # bytes of Colibri's packed copies (block formats: the quantised blocks)

    def __str__(self):
        lines = ["colibri.torch.accelerate: %d block(s) accelerated, %d left alone"
                 % (len(self.accelerated), len(self.skipped))]
        if self.source_bytes:
            lines[0] += ", experts %.1f MiB in PyTorch -> %.1f MiB in Colibri" % (
                self.source_bytes / 2.0**20, self.colibri_bytes / 2.0**20)
        if self.released_bytes:
            lines[0] += ", %.1f MiB of PyTorch weights released" % (self.released_bytes / 2.0**20)
        for b in self.accelerated:
            lines.append("  %s: %s (%s), %d experts, top_k %s, d_model %d, d_ff %d, %s%s" % (
                b.path or "<root>", b.family, b.layout, b.n_experts, b.top_k, b.d_model, b.d_ff, b.dtype,
                ", shared expert in %s" % b.shared if b.shared else ""))
        for path, why in self.skipped:
            lines.append("  left alone %s: %s" % (path or "<root>", why))
        return "\n".join(lines)

    @property
    def paths(self):
        return [b.path for b in self.accelerated]


class _State:
    """What a patched module keeps, as the plain attribute _colibri_state (not
    a submodule, so state_dict() is unchanged). Its forward is a method bound
    to the module, so copy.deepcopy(model) gives a copy whose blocks use their
    own gates (and share the read-only Colibri model)."""

    def __init__(self, experts, spec, shared_in_colibri, original_forward):
        self.experts = experts
        self.spec = spec
        self.shared_in_colibri = shared_in_colibri
        self.original_forward = original_forward  # an earlier instance-level forward, or None
        self.calls = 0
        self.released = 0  # bytes of PyTorch weights accelerate() released (0 = kept)


def _original(module, state):
    if state.released:
        raise RuntimeError(
            "colibri.torch: this block needs its PyTorch forward (training mode, autograd through it, a non-CPU "
            "input or unusual arguments), but accelerate() released its PyTorch expert weights to save memory; "
            "use accelerate(model, keep_pytorch_weights=True) to keep that fallback")
    if state.original_forward is not None:
        return state.original_forward
    return type(module).forward.__get__(module)


def _needs_pytorch(module, x, args, kwargs):
    return (module.training or args or kwargs or not isinstance(x, torch.Tensor) or x.device.type != "cpu"
            or (torch.is_grad_enabled() and x.requires_grad))


def _block_forward(self, hidden_states, *args, **kwargs):
    """Replaces a recognised block's forward (bound to the block)."""
    state = self.__dict__["_colibri_state"]
    if _needs_pytorch(self, hidden_states, args, kwargs):
        return _original(self, state)(hidden_states, *args, **kwargs)
    spec = state.spec
    D = spec.d_model
    state.calls += 1
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, D)
    if spec.family in ("deepseek_v2", "deepseek_v3"):
        routed = self.gate(hidden_states)  # DeepSeek's gate module picks the experts
        if isinstance(routed, torch.Tensor):  # a gate that returns logits only
            if hasattr(self, "route_tokens_to_experts"):
                idx, w = self.route_tokens_to_experts(routed)
            else:
                idx, w = _route_deepseek(spec, self.gate, routed.reshape(-1, spec.n_experts))
        else:
            idx, w = routed[0], routed[1]
        router_logits = None
    else:
        router_logits = self.gate(x)
        probs = F.softmax(router_logits, dim=1, dtype=torch.float)
        w, idx = torch.topk(probs, spec.top_k, dim=-1)
        if spec.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        w = w.to(x.dtype)  # as the block does before weighting the experts
    y = state.experts(x, idx.reshape(x.shape[0], -1), w.reshape(x.shape[0], -1))
    if spec.shared is not None and not state.shared_in_colibri:
        if spec.family == "qwen2_moe":
            sh = self.shared_expert(x)
            gate_mod = getattr(self, "shared_expert_gate", None)
            if gate_mod is not None:
                sh = torch.sigmoid(gate_mod(x)) * sh
            y = y + sh
        else:
            y = y + self.shared_experts(hidden_states).reshape(-1, D)
    y = y.reshape(shape)
    if spec.returns_logits:
        return y, router_logits
    return y


def _colibri_ids(top_k_index, n_tokens, E):
    """int32 ids [N, k]; transformers marks "no expert" (expert parallelism)
    with ids >= E, Colibri with -1."""
    ids = top_k_index.reshape(n_tokens, -1)
    return torch.where(ids < E, ids, torch.full_like(ids, -1)).to(torch.int32)


def _fused_block_forward(self, hidden_states, *args, **kwargs):
    """Replaces the forward of a known transformers 5 block with a shared
    expert (_KNOWN_FUSED_BLOCKS): its router in PyTorch, routed and shared
    experts in one Colibri call."""
    state = self.__dict__["_colibri_state"]
    if _needs_pytorch(self, hidden_states, args, kwargs):
        return _original(self, state)(hidden_states, *args, **kwargs)
    state.calls += 1
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, state.spec.d_model)
    _, weights, indices = self.gate(x)
    ids = _colibri_ids(indices, x.shape[0], state.spec.n_experts)
    return state.experts(x, ids, weights.reshape(ids.shape)).reshape(shape)


def _fused_forward(self, hidden_states, top_k_index=None, top_k_weights=None, *args, **kwargs):
    """Replaces a fused experts module's forward (bound to that module)."""
    state = self.__dict__["_colibri_state"]
    if top_k_index is None or top_k_weights is None or _needs_pytorch(self, hidden_states, args, kwargs):
        return _original(self, state)(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    state.calls += 1
    ids = _colibri_ids(top_k_index, hidden_states.shape[0], state.spec.n_experts)
    return state.experts(hidden_states, ids, top_k_weights.reshape(ids.shape))


def _gpt_oss_forward(self, hidden_states, router_indices=None, routing_weights=None, *args, **kwargs):
    """Replaces GptOssExperts' forward (bound to it): the block's router
    stays in PyTorch, the experts with their biases run in Colibri."""
    state = self.__dict__["_colibri_state"]
    if router_indices is None or routing_weights is None or _needs_pytorch(self, hidden_states, args, kwargs):
        return _original(self, state)(hidden_states, router_indices, routing_weights, *args, **kwargs)
    state.calls += 1
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, state.spec.d_model)
    ids = _colibri_ids(router_indices, x.shape[0], state.spec.n_experts)
    w = routing_weights.reshape(x.shape[0], -1)
    if state.spec.dense_scores:
        w = w.gather(1, router_indices.reshape(x.shape[0], -1).long())
    return state.experts(x, ids, w.reshape(ids.shape)).reshape(shape)


def _route_deepseek(spec, gate, logits):
    """DeepSeek-V2/V3 top-k from router logits [N, E], by the gate's
    attributes (used only when the gate returns bare logits)."""
    logits = logits.float()
    N, E = logits.shape
    v3 = spec.family == "deepseek_v3"
    scores = logits.sigmoid() if v3 else logits.softmax(dim=-1)
    choice = scores + gate.e_score_correction_bias.float().unsqueeze(0) if v3 else scores
    if spec.n_group > 1:
        grouped = choice.view(N, spec.n_group, -1)
        gs = grouped.topk(2, dim=-1)[0].sum(dim=-1) if v3 else grouped.max(dim=-1).values
        keep = torch.zeros_like(gs).scatter_(1, torch.topk(gs, spec.topk_group, dim=-1)[1], 1.0)
        mask = keep.unsqueeze(-1).expand(N, spec.n_group, E // spec.n_group).reshape(N, E).bool()
        choice = choice.masked_fill(~mask, float("-inf") if v3 else 0.0)
    idx = torch.topk(choice, spec.top_k, dim=-1)[1]
    w = scores.gather(1, idx)
    if spec.top_k > 1 and spec.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        if v3:
            w = w * spec.routed_scaling_factor
    else:
        w = w * spec.routed_scaling_factor
    return idx, w


def _expert_weight_params(module, spec, shared_in_colibri):
    """The parameters holding the weights Colibri took over from a block."""
    if spec.layout == "gpt_oss":
        ex = module.experts
        params = [ex.gate_up_proj, ex.gate_up_proj_bias, ex.down_proj, ex.down_proj_bias]
    elif spec.layout == "fused":
        ex = module.experts
        params = [ex.gate_up_proj, ex.down_proj]
    else:
        params = []
        for e in module.experts:
            names = _NAMINGS[0] if hasattr(e, "w1") else _NAMINGS[1]
            params += [getattr(e, n).weight for n in names]
    if shared_in_colibri:
        mlp = getattr(module, "shared_expert", None) or getattr(module, "shared_experts", None)
        names = _NAMINGS[0] if hasattr(mlp, "w1") else _NAMINGS[1]
        params += [getattr(mlp, n).weight for n in names]
    return params


def _release_weights(module, spec, shared_in_colibri, seen):
    """Empties the PyTorch copies of the weights Colibri holds; returns the
    bytes released. A tensor another module shares is emptied once."""
    n = 0
    for p in _expert_weight_params(module, spec, shared_in_colibri):
        if id(p) in seen or p.numel() == 0:
            continue
        seen.add(id(p))
        n += p.numel() * p.element_size()
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return n


def _return_freed_memory():
    """Hands the released weights' pages back to the OS. glibc keeps freed
    blocks in its heap while smaller allocations made after them (e.g. by a
    forward pass with transformers' grouped_mm) sit above them: measured, a
    Qwen3-MoE model's RSS stayed 2.2 GiB high after accelerate(dtype="f16")
    until malloc_trim(0). Elsewhere (no glibc) nothing to do."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def _install(report, cmodel, layer, path, module, spec, in_colibri, cdtype, keep_pytorch_weights, released_params):
    """Points the block at `layer` of `cmodel` (its forward or its experts
    module's) and records it in the report."""
    experts = ColibriExperts._view(cmodel, layer)
    if spec.layout == "gpt_oss":
        target, forward = module.experts, _gpt_oss_forward
    elif spec.layout != "fused":
        target, forward = module, _block_forward
    elif in_colibri:
        target, forward = module, _fused_block_forward
    else:
        target, forward = module.experts, _fused_forward
    state = _State(experts, spec.without_weights(), in_colibri, target.__dict__.get("forward"))
    target.__dict__["_colibri_state"] = state
    target.__dict__["forward"] = types.MethodType(forward, target)
    if not keep_pytorch_weights:
        state.released = _release_weights(module, spec, in_colibri, released_params)
        report.released_bytes += state.released
    report.accelerated.append(AcceleratedBlock(
        path=path, family=spec.family, layout=spec.layout, n_experts=spec.n_experts, top_k=spec.top_k,
        d_model=spec.d_model, d_ff=spec.d_ff, dtype=cdtype,
        shared=None if spec.shared is None else ("colibri" if in_colibri else "pytorch"),
        colibri_layer=layer))


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def _accelerate_from_gguf(report, found, gguf, threads, shared, bf16_compute, lock, huge_pages, exact_prefill,
                          keep_pytorch_weights, released_params, max_resident=None, progress=None, share=None):
    """accelerate(gguf=...): every recognised block runs the GGUF's layer of
    its decoder-layer index, in the file's stored formats."""
    cmodel = Model(gguf, threads=threads, lock=lock, huge_pages=huge_pages, bf16_compute=bf16_compute,
                   exact_prefill=exact_prefill, max_resident=max_resident, progress=progress,
                   local_experts=share[0] if share is not None else None,
                   skip_shared_expert=share is not None and share[1])
    info, first = cmodel.info, cmodel.first_block
    dtype = info.dtype if info.down_dtype == info.dtype else "%s/%s" % (info.dtype, info.down_dtype)
    members = []
    for path, module, spec in found:
        m = _LAYER_INDEX.search(path)
        if m is None:
            raise ValueError("accelerate(gguf=...): block %s is not under a layers.N module, so its GGUF block "
                             "is unknown" % path)
        block = int(m.group(1))
        layer = block - first
        where = "block %s (GGUF block %d) against %s" % (path, block, gguf)
        if not 0 <= layer < info.n_layers:
            raise ValueError("accelerate(gguf=...): %s: the file's MoE layers are blocks %d-%d"
                             % (where, first, first + info.n_layers - 1))
        mine = (spec.n_experts, spec.d_model, spec.d_ff)
        theirs = (info.n_experts, info.d_model, info.d_ff)
        if mine != theirs:
            raise ValueError("accelerate(gguf=...): %s: the block has (experts, d_model, d_ff) = %s, the file %s"
                             % (where, mine, theirs))
        mine = (spec.activation, spec.biases is not None)
        theirs = (info.activation, info.expert_bias)
        if mine != theirs:
            raise ValueError("accelerate(gguf=...): %s: the block's experts compute (activation, biases) = %s, the "
                             "file's %s" % (where, mine, theirs))
        file_shared = info.shared_d_ff > 0
        if file_shared and (spec.shared is None or spec.shared[0].shape[0] != info.shared_d_ff):
            raise ValueError("accelerate(gguf=...): %s: the file has a shared expert of d_ff %d, the block %s"
                             % (where, info.shared_d_ff,
                                "none" if spec.shared is None else "one of d_ff %d" % spec.shared[0].shape[0]))
        # Colibri adds the file's shared expert itself; a block whose own
        # forward would add it too (fused layout, forward unknown) cannot take it.
        if file_shared and (not shared or (spec.layout == "fused" and not spec.known_block)):
            raise ValueError("accelerate(gguf=...): %s: the file's layers include the shared expert, which this "
                             "block would also run in PyTorch" % where)
        members.append((path, module, spec, file_shared, layer))
    report.source_bytes += cmodel.stats.bytes_mapped
    report.colibri_bytes += cmodel.stats.bytes_mapped
    report.models.append(cmodel)
    for path, module, spec, in_colibri, layer in members:
        _install(report, cmodel, layer, path, module, spec, in_colibri, dtype, keep_pytorch_weights, released_params)


def accelerate(model, dtype=None, threads=0, *, shared=True, bf16_compute=False, lock=True, huge_pages=True,
               verbose=False, exact_prefill=False, keep_pytorch_weights=False, gguf=None, max_resident=None,
               expert_source=None, checkpoint=None, progress=None, _expert_share=None):
    """Runs the experts of every recognised sparse-MoE block of `model` in
    Colibri; returns an AccelerateReport.

    Each block keeps its router (its .gate) in PyTorch; only the expert
    computation (and, when representable, the shared expert) moves to
    Colibri, so the model's outputs stay the same within rounding. Blocks
    with one module per expert get their forward replaced (an instance
    attribute; it returns what the original returns: (hidden, router_logits)
    for Mixtral/Qwen/OLMoE, hidden for DeepSeek); fused-layout blocks get
    their experts module's forward replaced. The module tree and
    state_dict() are unchanged; restore(model) undoes it.

    dtype: Colibri's weight dtype ('f32', 'f16', 'bf16' or a torch dtype;
    None = each block's own), or a block format ('q8_0', 'q4_0', 'q4_k',
    'q5_k', 'q6_k', 'mxfp4', 'q4_k_m') into which the expert weights are quantised
    on load (report.source_bytes and .colibri_bytes say the sizes before
    and after). Same-shaped blocks share one Colibri model
    (one thread pool) with one layer per block. threads: Colibri threads (0 =
    one per core). shared=False keeps shared experts in PyTorch.
    bf16_compute / exact_prefill: the precision options of colibri.Model.

    gguf: a GGUF file (or the first file of a split set) holding the same
    model, e.g. the one transformers' own GGUF loader dequantised `model`
    from: each block's experts then come from the file in their stored
    formats (Q4_K, Q6_K, ...) instead of from the PyTorch weights; block
    `model.layers.N` takes GGUF block N. Excludes dtype. Blocks whose shapes
    differ from the file's, or whose block has no experts in it, raise
    ValueError naming both. A shared expert in the file runs in Colibri.

    max_resident (with gguf=): bytes, or a string such as "25%" of the
    experts, that Colibri may hold of the expert weights; the rest stay in
    the file and are read on demand (colibri.Model's max_resident=,
    docs/CACHE.md), so a model larger than memory runs. Without gguf= the
    experts come from PyTorch's memory and a budget is refused.

    progress (with gguf=): True for a tqdm bar while the file's experts are
    opened, or a callable given the fraction done that returns False to
    cancel (colibri.Model's progress=).

    Memory: Colibri keeps its own (packed) copy of the expert weights, so by
    default the PyTorch copies of the weights it took over (routed experts,
    and shared experts run in Colibri) are released: each such parameter
    becomes an empty tensor, and the model's memory stays about what it was
    before. Routers, attention and everything else keep their weights.
    keep_pytorch_weights=True keeps them (twice the expert memory), which a
    block needs for its PyTorch fallback: in training mode, when autograd
    needs a gradient through it, or for non-CPU inputs; without them that
    fallback raises a RuntimeError saying so. report.released_bytes says how
    much was released.

    checkpoint: a Hugging Face checkpoint directory holding the same model
    (16/32-bit, or block-scaled FP8 as DeepSeek-V3 and Qwen3 FP8 ship it,
    which transformers loads on CPU only dequantised): each block's routed
    experts, and an FP8 shared expert, come from the checkpoint as stored,
    one expert at a time (FP8 as fp8_e4m3 rows with their scales), instead
    of from the PyTorch weights; dtype= still quantises them as read.
    Excludes gguf= and expert_source=.

    expert_source: a callable (block path, its _Spec) -> the block's routed experts as
    Model.from_arrays takes them, [(gate [F, D], up [F, D], down [D, F])],
    used instead of the module's own expert weights (which may then be
    stand-ins of their shape). from_pretrained passes colibri._arrays.Lazy
    weights read from a checkpoint, so each is read and quantised on its own.
    It may instead return a dict of layer keys ("experts", and "shared" for
    a shared expert's weights, e.g. colibri.fp8.Fp8Weight triples).
    """
    if not isinstance(model, nn.Module):
        raise TypeError("accelerate() takes a torch.nn.Module, got %s" % type(model).__name__)
    found, skipped = [], []
    for path, module in model.named_modules():
        if getattr(module, "_colibri_state", None) is not None or \
                getattr(getattr(module, "experts", None), "_colibri_state", None) is not None:
            skipped.append((path, "already accelerated"))
            continue
        if not hasattr(module, "experts"):
            continue
        spec = recognise(module)
        if isinstance(spec, str):
            skipped.append((path, spec))
            continue
        found.append((path, module, spec))

    if checkpoint is not None:
        from .loader import checkpoint_expert_source, checkpoint_stored_dtype, open_checkpoint

        if gguf is not None or expert_source is not None:
            raise ValueError("accelerate(): checkpoint excludes gguf and expert_source (the experts come from one "
                             "place)")
        ck = open_checkpoint(checkpoint)
        expert_source = checkpoint_expert_source(ck, {p: m for p, m, _ in found})
        if dtype is None and found:
            dtype = checkpoint_stored_dtype(ck, found[0][0], found[0][1])  # the checkpoint's type, not the model's

    groups = {}
    for path, module, spec in found:
        cdtype = _colibri_dtype(dtype, spec.weight_like)
        # A fused block keeps its own forward (only its experts module's is
        # replaced), which adds the shared expert itself, unless its whole
        # forward is known.
        in_colibri = (shared and spec.shared is not None and spec.shared_in_colibri
                      and (spec.layout != "fused" or spec.known_block))
        key = spec.group_key(cdtype)
        if not in_colibri:
            key = key[:4] + (0, False) + key[6:]
        groups.setdefault(key, []).append((path, module, spec, in_colibri))

    report = AccelerateReport([], skipped, [])
    released_params = set()
    if gguf is not None:
        if dtype is not None:
            raise ValueError("accelerate(): dtype and gguf exclude each other (the GGUF's experts run in the types "
                             "the file stores)")
        _accelerate_from_gguf(report, found, gguf, threads, shared, bf16_compute, lock, huge_pages, exact_prefill,
                              keep_pytorch_weights, released_params, max_resident, progress, _expert_share)
        groups = {}
    elif max_resident is not None:
        raise ValueError("accelerate(): max_resident needs gguf= (experts read on demand come from a file; without "
                         "one they are in PyTorch's memory already)")
    elif progress not in (None, False):
        raise ValueError("accelerate(): progress needs gguf= (it reports the file's open)")
    for key, members in groups.items():
        cdtype = key[0]
        layers = [spec.layer_dict(shared_in_colibri=in_colibri) for _, _, spec, in_colibri in members]
        if expert_source is not None:
            for layer, (path, _, spec, _) in zip(layers, members):
                for k in ("experts", "gate_up_proj", "down_proj"):
                    layer.pop(k, None)
                source = expert_source(path, spec)
                # a dict also gives the shared expert's weights (an FP8 checkpoint's, with their scales)
                layer.update(source if isinstance(source, dict) else {"experts": source})
        report.source_bytes += sum(_tensor_bytes(layer) for layer in layers)
        cmodel = Model.from_arrays(layers, dtype=cdtype, threads=threads, lock=lock, huge_pages=huge_pages,
                                   bf16_compute=bf16_compute, exact_prefill=exact_prefill,
                                   **members[0][2].model_options())
        del layers
        report.colibri_bytes += cmodel.stats.bytes_mapped
        report.models.append(cmodel)
        for i, (path, module, spec, in_colibri) in enumerate(members):
            _install(report, cmodel, i, path, module, spec, in_colibri, cdtype, keep_pytorch_weights,
                     released_params)
    order = {p: n for n, (p, _, _) in enumerate(found)}
    report.accelerated.sort(key=lambda b: order[b.path])
    if report.released_bytes:
        _return_freed_memory()
    if verbose:
        print(report)
    return report


def from_pretrained(path, *, threads=0, exact_prefill=False, max_resident=None, lock=True, huge_pages=True,
                    bf16_compute=False, torch_threads="auto", dtype=None, dense_dtype=None, attention="colibri",
                    direct_decode=True, progress=None, expert_parallel=None, expert_parallel_timeout=60.0,
                    expert_placement=None):
    """A transformers model whose large weights Colibri computes, from one
    call, built without materialising those weights (docs/PYTORCH.md):

    path: a GGUF file (or the first file of a split set; qwen3moe,
    qwen2moe, olmoe, llama/mixtral, gpt-oss, deepseek2, glm4moe), every
    weight computed in the type the
    file stores: attention projections and the LM head as
    colibri.nn.Linear, the token embedding dequantising the rows it looks
    up, the MoE blocks (routers, experts, shared experts) in one Colibri
    model opened from the file (max_resident= as in accelerate()); or a
    Hugging Face checkpoint directory (config.json + safetensors, f32 / f16
    / bf16; Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, gpt-oss, DeepSeek-V2/V3,
    GLM-4-MoE), read one tensor and one
    block of experts at a time, kept as stored or quantised as read: dtype
    for the experts ("q4_k_m", "q8_0", ...), dense_dtype for the
    projections and head (default: dtype's gate/up type).

    Returns the architecture's transformers model in eval mode; forward and
    generate work as usual. Options as accelerate()'s. Bad files raise
    ValueError naming the file and the tensor or key.

    torch_threads: PyTorch's intra-op thread count, set (process-wide,
    torch.set_num_threads) once the model is built: "auto" gives PyTorch
    the cores Colibri's `threads` leave, at least 1, so the two pools do
    not spin on each other's cores; None leaves PyTorch as it is.

    attention: "colibri" (default) runs attention over the cache in one C
    call per layer (colibri.attention; the model's own sdpa or eager
    implementation where the C kernel does not apply: autograd, dropout,
    attention weights asked for, torch.compile) and the family's rotary
    embedding in one C call per tensor (colibri.rope, identical to the
    bit); "model" leaves the model's own.

    direct_decode: with attention="colibri", a step of one token of one
    sequence on a filled cache (generate's decode steps) walks the blocks
    with direct C calls instead of transformers' module calls: the same
    calls, the same bits, about 0.1-0.15 ms less a block (colibri.decode;
    Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, GLM-4-MoE, gpt-oss). Other calls
    run the model's own forward; DeepSeek's blocks keep their absorbed
    attention forward inside the direct step.

    progress: for a GGUF file, True shows a tqdm bar while its experts are
    opened (most of the file), or a callable gets the fraction done and
    returns False to cancel (colibri.Model's progress=).

    expert_parallel: True (torch.distributed's default group) or a group,
    for a GGUF file: each rank opens a contiguous share of about E / N of
    every layer's experts (the shared expert on rank 0), attention, routers
    and the dense parts run on every rank, and each MoE block's output is
    all-reduced (SUM) over the group, so every rank holds the whole model's
    result (transformers 5; gloo on CPU). Every rank must make the same
    calls with the same inputs, as under torchrun. Ranks compare the file
    (a digest of its header and size) and the options that change the
    numbers (exact_prefill, bf16_compute, attention, Colibri's version)
    before opening, and each raises ValueError naming the first difference.

    expert_parallel_timeout: seconds a collective of expert_parallel=True
    waits for a peer before raising (its own gloo group over the default
    group's ranks; the default group would wait 30 minutes). A peer that
    died fails the others' next all-reduce at once (connection closed); one
    that stopped answering, after this long. A group passed as
    expert_parallel keeps its own timeout.

    expert_placement: which rank holds which experts, per layer, instead of
    contiguous blocks: a colibri.placement.ExpertPlacement, or a
    colibri.routing.RoutingTrace (or the path of a saved .ctrace) that
    colibri.placement.balanced spreads over the group, balancing each
    layer's routed slots with the contiguous placement's expert count per
    rank."""
    from .loader import from_pretrained as load

    return load(path, threads=threads, exact_prefill=exact_prefill, max_resident=max_resident, lock=lock,
                huge_pages=huge_pages, bf16_compute=bf16_compute, torch_threads=torch_threads, dtype=dtype,
                dense_dtype=dense_dtype, attention=attention, direct_decode=direct_decode, progress=progress,
                expert_parallel=expert_parallel, expert_parallel_timeout=expert_parallel_timeout,
                expert_placement=expert_placement)


def restore(model):
    """Undoes accelerate(model): the original forwards come back and the
    Colibri models are released once nothing refers to them. Returns the
    number of modules restored.

    It cannot give back weights accelerate() released (the default): then it
    changes nothing and raises a RuntimeError naming the blocks; reload the
    model instead, or accelerate with keep_pytorch_weights=True."""
    released = [path for path, module in model.named_modules()
                if getattr(module.__dict__.get("_colibri_state"), "released", 0)]
    if released:
        raise RuntimeError("colibri.torch.restore: accelerate() released the PyTorch expert weights of %d block(s) "
                           "(%s%s); they cannot be given back: reload the model, or accelerate it with "
                           "keep_pytorch_weights=True to be able to restore it"
                           % (len(released), ", ".join(released[:3]), ", ..." if len(released) > 3 else ""))
    n = 0
    for _, module in model.named_modules():
        state = module.__dict__.get("_colibri_state")
        if state is not None:
            module.__dict__.pop("forward", None)
            if state.original_forward is not None:
                module.__dict__["forward"] = state.original_forward
            del module.__dict__["_colibri_state"]
            n += 1
    return n
