"""Rotary position embedding in one C call (colibri_rope), for the
transformers MoE families' `apply_rotary_pos_emb`.

A decode step applies the rotary embedding to the query and key heads of
every layer with six to ten PyTorch operators each (multiplications, the
halves sliced, negated and concatenated, a sum), about 85 microseconds a
layer on a 2-core Zen 4, for a few thousand multiplications. colibri_rope
computes the same products and sums, rounded one at a time as PyTorch
rounds them, so its output is PyTorch's to the bit.

`install(model)` replaces the `apply_rotary_pos_emb` of the model's
modeling module (the attention forward looks it up there at each call)
with a function that runs colibri_rope on float32 CPU tensors outside
autograd (a custom operator under torch.compile), and the original
otherwise. Because the
results are identical, other models of that family in the process see no
difference; install checks that on random data before it replaces
anything, and leaves a family whose function computes something else
(a future transformers) alone.
"""

import sys

import torch

from . import _lib as L
from ._arrays import leading_strides

# The rotation each family's apply_rotary_pos_emb applies: "full"
# (rotate_half over the whole head, cos/sin as wide as the head), "partial"
# (GLM-4-MoE: the first cos.shape[-1] dimensions rotated, the rest passed
# through) and "half" (gpt-oss: cos/sin half the head wide, shared by both
# halves).
_STYLES = {
    "qwen3_moe": "full",
    "qwen2_moe": "full",
    "mixtral": "full",
    "olmoe": "full",
    "glm4_moe": "partial",
    "gpt_oss": "half",
}



def rope(x, cos, sin, style="full"):
    """x [B, H, T, D] rotated by cos/sin [B or 1, T, C] (float32 CPU, last
    dimensions contiguous); a new tensor laid out as the family's PyTorch
    operators lay theirs out (x's layout from the elementwise "full"
    formula, contiguous from the others' concatenation). style as
    _STYLES: "full" (C == D), "partial" (C <= D, the rest of each head
    copied), "half" (C == D / 2)."""
    B, H, T, D = x.shape
    C = cos.shape[-1]
    rotary, half = {"full": (D, False), "partial": (C, False), "half": (D, True)}[style]
    out = torch.empty_like(x) if style == "full" else torch.empty((B, H, T, D), dtype=torch.float32)
    d = L.RopeDesc()
    d.batch, d.heads, d.tokens, d.head_dim, d.rotary_dim, d.half_table = B, H, T, D, rotary, int(half)
    d.x = x.data_ptr()
    d.x_stride[:] = leading_strides(x, 3)
    d.out = out.data_ptr()
    d.out_stride[:] = leading_strides(out, 3)
    d.cos = cos.data_ptr()
    d.sin = sin.data_ptr()
    d.table_stride[:] = leading_strides(cos, 2)
    status = L.fn("colibri_rope")(d)
    if status:
        L.check(status, "colibri_rope")
    return out


def _rope_any_layout(x, cos, sin, style):
    x, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, cos, sin))
    if cos.stride() != sin.stride():  # the C call reads both tables with one set of strides
        cos, sin = cos.contiguous(), sin.contiguous()
    return rope(x, cos, sin, style)


@torch.library.custom_op("colibri::rope", mutates_args=())
def _rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    return _rope_any_layout(x, cos, sin, style)


@_rope_op.register_fake
def _(x, cos, sin, style):
    return torch.empty_like(x) if style == "full" else x.new_empty(x.shape)


def _fits(style, x, cos, sin):
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 4:
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    if cos.dim() != 3 or cos.shape != sin.shape:
        return False
    if cos.dtype != torch.float32 or cos.device.type != "cpu" or cos.shape[0] not in (1, x.shape[0]):
        return False
    if cos.shape[1] != x.shape[2]:
        return False
    C, D = cos.shape[-1], x.shape[-1]
    if style == "full":
        return C == D and D % 2 == 0
    if style == "partial":
        return 2 <= C <= D and C % 2 == 0
    return 2 * C == D


def _replacement(original, style):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        # The attention forwards call it with the four tensors alone.
        if not args and not kwargs and _fits(style, q, cos, sin) and _fits(style, k, cos, sin):
            if torch.compiler.is_compiling():
                # The same C call as a custom operator: compiled and eager
                # models compute the same bits.
                return torch.ops.colibri.rope(q, cos, sin, style), torch.ops.colibri.rope(k, cos, sin, style)
            return _rope_any_layout(q, cos, sin, style), _rope_any_layout(k, cos, sin, style)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.__wrapped__ = original
    apply_rotary_pos_emb._colibri_style = style
    return apply_rotary_pos_emb


def _same_bits(original, replacement, style):
    g = torch.Generator().manual_seed(0)
    D = 64
    C = {"full": D, "partial": D // 2, "half": D // 2}[style]
    # [B, T, H, D] as the projections leave it, viewed [B, H, T, D].
    q = torch.randn(2, 5, 3, D, generator=g).transpose(1, 2)
    k = torch.randn(2, 5, 2, D, generator=g).transpose(1, 2)
    angles = torch.randn(2, 5, C, generator=g) * 3
    cos, sin = angles.cos(), angles.sin()
    with torch.no_grad():
        want = original(q, k, cos, sin)
        got = replacement(q, k, cos, sin)
    return all(torch.equal(a, b) for a, b in zip(want, got))


def install(model):
    """Routes the model family's apply_rotary_pos_emb through colibri_rope
    (module docstring). Returns the style installed, or None when the
    family is not one Colibri knows or its function computes something
    else."""
    attn = next((m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")), None)
    if attn is None:
        return None
    module = sys.modules[type(attn).__module__]
    family = module.__name__.rsplit(".", 1)[-1].replace("modeling_", "")
    style = _STYLES.get(family)
    current = getattr(module, "apply_rotary_pos_emb", None)
    if style is None or current is None:
        return None
    if getattr(current, "_colibri_style", None) == style:
        return style
    replacement = _replacement(current, style)
    try:
        same = _same_bits(current, replacement, style)
    except Exception:  # a function that takes other arguments or shapes: not the one we reproduce
        same = False
    if not same:
        return None
    module.apply_rotary_pos_emb = replacement
    return style
