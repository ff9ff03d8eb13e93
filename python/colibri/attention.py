"""Attention over a KV cache in one C call (colibri_attention), and the
transformers attention implementation that runs it.

A decode step's attention in PyTorch is a handful of operators (the
grouped heads expanded or packed, the scores, the softmax, the weighted
sum), each paying PyTorch's dispatch; at one query token the arithmetic is
a few microseconds and the dispatch is most of the time, and over long
caches or with a mask PyTorch's CPU kernels fall far behind the memory
(bench/attention.py). `attention()` does it in one call. `install(model)`
registers it under transformers' AttentionInterface as "colibri-sdpa" or
"colibri-eager" (the model's own implementation behind it): float32 calls
run the C kernel (up to MAX_QUERY_TOKENS query tokens when that is set);
everything else (training, dropout, softcapping, attention weights
requested, torch.compile) runs the model's own implementation with the
mask it builds for it, so the masks the model makes are always the ones
its implementation expects.
"""

import sys
from typing import Optional

import torch

from . import _lib as L
from ._arrays import leading_strides

# Query tokens up to which a call runs the C kernel (None: any number);
# longer ones run the model's own implementation. bench/attention.py
# measured the C kernel ahead of PyTorch's sdpa and eager at every size
# it tried on a Zen 4 (one query token to 2048-token prefills), so there
# is no limit by default.
MAX_QUERY_TOKENS = None

_PREFIX = "colibri-"



def attention(query, key, value, *, scale, mask=None, window=0, sinks=None, threads=0, key2=None):
    """softmax(query key^T * scale + mask) value over grouped heads.

    query [B, H, T, Dq]; key [B, Hkv, S, Dq] and value [B, Hkv, S, Dv]
    with H a multiple of Hkv (head h reads kv head h // (H // Hkv)): float32
    CPU tensors, any strides with the last dimension contiguous. The
    queries are the last T of the S positions. mask: None (causal: query t
    sees positions up to S - T + t, and with `window` > 0 only the last
    `window` of them), a bool [B or 1, 1, T, S] (True: visible) or a float
    one added to the scores. sinks: [H] logits that join each softmax's
    denominator (gpt-oss). key2: a key stored in two parts (DeepSeek's
    cached latent and rope parts): [B, Hkv, S, D2], the last D2 of the
    query's Dq + D2 against it. Returns [B, T, H, Dv], contiguous; a query
    that sees no position gets zeros.
    """
    named = [("query", query), ("key", key), ("value", value)] + ([("key2", key2)] if key2 is not None else [])
    for name, t in named:
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 4 or (
                t.shape[-1] > 1 and t.stride(-1) != 1):
            raise ValueError("colibri attention: %s must be a 4-d float32 CPU tensor with a contiguous last "
                             "dimension, got %s %s %s" % (name, tuple(t.shape), t.dtype, t.device))
    B, H, T, Dq = query.shape
    _, Hkv, S, Dv = value.shape
    D2 = key2.shape[-1] if key2 is not None else 0
    Dq -= D2
    if tuple(key.shape) != (B, Hkv, S, Dq) or value.shape[0] != B or (
            key2 is not None and tuple(key2.shape) != (B, Hkv, S, D2)):
        raise ValueError("colibri attention: query %s, key %s%s and value %s do not fit together"
                         % (tuple(query.shape), tuple(key.shape),
                            " + %s" % (tuple(key2.shape),) if key2 is not None else "", tuple(value.shape)))
    out = torch.empty((B, T, H, Dv), dtype=torch.float32)
    d = L.AttentionDesc()
    d.batch, d.heads, d.kv_heads, d.q_len, d.kv_len, d.qk_dim, d.v_dim = B, H, Hkv, T, S, Dq, Dv
    d.window = int(window or 0)
    d.n_threads = int(threads)
    d.scale = float(scale)
    d.q = query.data_ptr()
    d.q_stride[:] = leading_strides(query, 3)
    d.k = key.data_ptr()
    d.k_stride[:] = leading_strides(key, 3)
    d.v = value.data_ptr()
    d.v_stride[:] = leading_strides(value, 3)
    if key2 is not None:
        d.k2 = key2.data_ptr()
        d.k2_stride[:] = leading_strides(key2, 3)
        d.qk2_dim = D2
    if mask is not None:
        if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] not in (1, B) or tuple(mask.shape[2:]) != (T, S) \
                or mask.device.type != "cpu" or mask.dtype not in (torch.bool, torch.float32):
            raise ValueError("colibri attention: mask must be a bool or float32 [%d or 1, 1, %d, %d] CPU tensor, "
                             "got %s %s" % (B, T, S, tuple(mask.shape), mask.dtype))
        if mask.dtype == torch.bool:
            d.mask = mask.data_ptr()
        else:
            d.additive_mask = mask.data_ptr()
        d.mask_stride[:] = (mask.stride(0) if mask.shape[0] != 1 else 0, mask.stride(2), mask.stride(3))
    if sinks is not None:
        sinks = sinks.detach().to(torch.float32).contiguous()
        if sinks.numel() != H:
            raise ValueError("colibri attention: %d sinks for %d heads" % (sinks.numel(), H))
        d.sinks = sinks.data_ptr()
    d.out = out.data_ptr()
    status = L.fn("colibri_attention")(d)
    if status:
        L.check(status, "colibri_attention")
    return out


@torch.library.custom_op("colibri::attention", mutates_args=())
def _attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor],
                  sinks: Optional[torch.Tensor], scale: float, window: int, threads: int) -> torch.Tensor:
    # A compiled graph may hand over other layouts than eager code would.
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    return attention(query, key, value, scale=scale, mask=mask, window=window, sinks=sinks, threads=threads)


@_attention_op.register_fake
def _(query, key, value, mask, sinks, scale, window, threads):
    return query.new_empty((query.shape[0], query.shape[2], query.shape[1], value.shape[-1]))


def fits(query, key, mask, kv_len):
    """Whether attention() takes these (float32 CPU, outside autograd and
    torch.compile, a mask it reads): for model code that calls it directly."""
    if torch.compiler.is_compiling() or query.dtype != torch.float32 or key.dtype != torch.float32:
        return False
    if query.device.type != "cpu" or (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad)):
        return False
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-1] < kv_len
                             or mask.dtype not in (torch.bool, torch.float32)):
        return False
    return True


def _model_implementation(module, name):
    if name == "eager":
        # Each modeling file has its own eager function (gpt-oss's adds the sinks).
        return getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    return ALL_ATTENTION_FUNCTIONS[name]


def _runs_in_c(module, query, key, value, mask, dropout, kwargs):
    if MAX_QUERY_TOKENS is not None and query.shape[2] > MAX_QUERY_TOKENS:
        return False
    if query.dtype != torch.float32 or key.dtype != torch.float32 or value.dtype != torch.float32:
        return False
    if query.device.type != "cpu":
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return False
    if (dropout and module.training) or kwargs.get("softcap") is not None or kwargs.get("output_attentions"):
        return False
    if kwargs.get("position_bias") is not None or kwargs.get("is_causal") is False:
        return False
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.dtype not in (torch.bool, torch.float32)):
        return False
    return True


def _interface(original):
    def colibri_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                          **kwargs):
        if _runs_in_c(module, query, key, value, attention_mask, dropout, kwargs):
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            # Without a mask the call is causal; a window then only matters
            # past its length, and transformers sends a mask whenever it does.
            window = (sliding_window or 0) if attention_mask is None else 0
            threads = module.__dict__.get("_colibri_threads", 0)
            if torch.compiler.is_compiling():
                # The same C kernel as a custom operator, so compiled and
                # eager models compute the same bits.
                out = torch.ops.colibri.attention(query, key, value, attention_mask, kwargs.get("s_aux"), float(scale),
                                                  int(window), int(threads))
            else:
                query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
                out = attention(query, key, value, scale=scale, mask=attention_mask, window=window,
                                sinks=kwargs.get("s_aux"), threads=threads)
            return out, None
        return _model_implementation(module, original)(module, query, key, value, attention_mask, dropout=dropout,
                                                       scaling=scaling, sliding_window=sliding_window, **kwargs)
    colibri_attention.__name__ = _PREFIX + original
    return colibri_attention


def install(model, threads=0):
    """Runs `model`'s attention through colibri_attention.

    Registers "colibri-<implementation>" with transformers'
    AttentionInterface (the model's attention function) and
    AttentionMaskInterface (the same masks as its own implementation) and
    switches the model to it. Models on "sdpa" or "eager" that call the
    interface only; returns the implementation's name, or None when the
    model runs another one (flash, flex, ...) or its own attention classes
    and is left as it was."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    config = model.config
    original = getattr(config, "_attn_implementation", None) or "eager"
    if original.startswith(_PREFIX):
        return original
    # Models of transformers 4.x that pick an attention class per
    # implementation at construction (OLMoE, Qwen2-MoE) never ask the interface.
    if original not in ("sdpa", "eager") or not getattr(model, "_supports_attention_backend", False):
        return None
    name = _PREFIX + original
    AttentionInterface.register(name, _interface(original))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "o_proj"):
            module.__dict__["_colibri_threads"] = int(threads)
    for sub in [config] + [getattr(config, k) for k in ("text_config",) if hasattr(config, k)]:
        sub._attn_implementation = name
    return name
