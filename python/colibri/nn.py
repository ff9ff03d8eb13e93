"""PyTorch modules over Colibri's dense kernels: a linear layer and an
embedding table whose weights stay in the format a file stores them in
(GGUF's block formats, MXFP4, f16/bf16/f32).

    lin = colibri.nn.Linear(rows, "q8_0", out_features, in_features, bias=None, threads=2)
    y = lin(x)                       # float tensor [..., in_features] -> [..., out_features]

`rows` are the weight's bytes as stored (uint8 [out_features, row_bytes], a
GGUF tensor's data), or a float tensor [out_features, in_features] with
`quantize=` naming the format to store it in. colibri.torch.from_pretrained
builds its attention projections, dense MLPs and LM head from these.

Both modules are inference-only: their weights are not PyTorch parameters
(they live in Colibri's packed memory), autograd does not flow through
them, and they run on CPU tensors. Under torch.compile they are the custom
operators colibri::linear and colibri::embedding (with fake
implementations), so a compiled model keeps them in one graph.
"""

from __future__ import annotations

import ctypes
import weakref

import numpy as np
import torch
from torch import nn

from . import _lib as L
from .quant import dequantize, dtype_code, quantize, row_bytes

__all__ = ["Linear", "Embedding", "RMSNorm"]

# Live layers by handle, for the custom operators (which take the handle as
# an int) and their fake implementations (which need the output width).
_LINEARS: "weakref.WeakValueDictionary[int, Linear]" = weakref.WeakValueDictionary()
_EMBEDDINGS: "weakref.WeakValueDictionary[int, Embedding]" = weakref.WeakValueDictionary()
# MoE models (colibri.Model) by id(), for colibri::moe.
_MOE_MODELS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def moe_key(model):
    """The int colibri::moe takes for a colibri.Model (kept while the model lives)."""
    _MOE_MODELS[id(model)] = model
    return id(model)


def run_moe(model, layer, x):
    """One MoE layer with the model's built-in router (and shared expert) on
    a float32 CPU tensor [N, d_model], contiguous: one C call."""
    out = torch.empty_like(x)
    if x.shape[0]:
        model._infer_pointers(layer, x.shape[0], 0, x.data_ptr(), None, None, out.data_ptr())
    return out


def _stored_rows(rows, dtype, out_features, in_features, quantize_to, name):
    """(uint8 numpy [out, row_bytes], its dtype) from bytes or floats."""
    if isinstance(rows, torch.Tensor):
        if rows.dtype == torch.uint8:
            rows = rows.detach().cpu().numpy()
        else:
            floats = rows.detach().to(torch.float32).cpu().numpy()
            if floats.ndim == 3:  # groups of matrices, one after another
                floats = floats.reshape(-1, floats.shape[-1])
            if quantize_to is None:
                raise ValueError("%s: a float weight needs quantize= (the format to store it in, e.g. 'q8_0' or "
                                 "'bf16')" % name)
            if floats.shape != (out_features, in_features):
                raise ValueError("%s: weight of shape %s, expected (%d, %d)"
                                 % (name, tuple(floats.shape), out_features, in_features))
            return quantize(floats, quantize_to), quantize_to
    b = np.asarray(rows)
    if b.dtype != np.uint8:
        b = np.ascontiguousarray(b).view(np.uint8)
    need = row_bytes(dtype, in_features)
    b = np.ascontiguousarray(b).reshape(-1)
    if b.size != need * out_features:
        raise ValueError("%s: %d bytes of %s weights, a (%d, %d) matrix of it takes %d"
                         % (name, b.size, dtype, out_features, in_features, need * out_features))
    return b.reshape(out_features, need), dtype


class Linear(nn.Module):
    """y = x W^T + b with W in a stored format (colibri_linear_* in the C ABI).

    dtype: the format of `rows` ('q8_0', 'q4_k', 'mxfp4', 'bf16', ...).
    threads: Colibri threads (0 = one per core); layers and MoE models
    asking for the same count share one pool. exact: fp32 activations
    against the dequantised weights (else int8 activations for block
    formats; docs/PRECISION.md). Inputs of any float dtype are computed in
    float32 and returned in the input's dtype."""

    def __init__(self, rows, dtype, out_features, in_features, bias=None, *, threads=0, exact=False,
                 huge_pages=True, lock=False, name="linear", quantize=None, groups=1):
        super().__init__()
        groups = int(groups)
        if groups < 1:
            raise ValueError("%s: groups must be at least 1, got %d" % (name, groups))
        stored, dtype = _stored_rows(rows, dtype, groups * int(out_features), int(in_features), quantize, name)
        # With groups, `rows` holds that many matrices of out_features x
        # in_features, and the module maps [..., groups * in_features] to
        # [..., groups * out_features], each group's slice by its own matrix.
        self.groups = groups
        self.in_features = groups * int(in_features)
        self.out_features = groups * int(out_features)
        self.dtype_name = dtype
        self.name = name
        b = None
        if bias is not None:
            b = np.ascontiguousarray(torch.as_tensor(bias).detach().to(torch.float32).cpu().numpy()).reshape(-1)
            if b.size != self.out_features:
                raise ValueError("%s: bias of %d values for %d outputs" % (name, b.size, self.out_features))
        desc = L.LinearDesc()
        L.fn("colibri_linear_desc_default")(ctypes.byref(desc))
        desc.dtype = dtype_code(dtype)
        desc.out_features = self.out_features // groups
        desc.in_features = self.in_features // groups
        desc.groups = groups
        desc.weight = stored.ctypes.data
        desc.weight_size = stored.nbytes
        desc.bias = b.ctypes.data if b is not None else None
        desc.n_threads = int(threads)
        desc.exact = 1 if exact else 0
        desc.huge_pages = 1 if huge_pages else 0
        desc.lock_memory = 1 if lock else 0
        name_bytes = name.encode()
        desc.name = name_bytes
        handle = ctypes.c_void_p()
        L.check(L.fn("colibri_linear_create")(ctypes.byref(desc), ctypes.byref(handle)), "colibri_linear_create")
        self._handle = handle.value
        self._finalizer = weakref.finalize(self, L.fn("colibri_linear_free"), self._handle)
        self._forward_fn = L.fn("colibri_linear_forward")
        self.kernels = L.fn("colibri_linear_kernels")(self._handle).decode()
        self.nbytes = int(L.fn("colibri_linear_bytes")(self._handle))
        _LINEARS[self._handle] = self

    def extra_repr(self):
        return "in_features=%d, out_features=%d, dtype=%s, name=%s%s" % (
            self.in_features, self.out_features, self.dtype_name, self.name,
            ", groups=%d" % self.groups if self.groups > 1 else "")

    def run(self, x):
        """The C call on a float32 CPU tensor [..., in_features]."""
        lead = x.shape[:-1]
        if x.dtype != torch.float32:
            x = x.to(torch.float32)
        if not x.is_contiguous():
            x = x.contiguous()
        n = x.numel() // self.in_features if self.in_features else 0
        if x.shape[-1] != self.in_features:
            raise ValueError("%s: input of width %d, the layer takes %d" % (self.name, x.shape[-1], self.in_features))
        y = torch.empty(lead + (self.out_features,), dtype=torch.float32)
        status = self._forward_fn(self._handle, n, x.data_ptr(), y.data_ptr())
        if status:
            L.check(status, "colibri_linear_forward")
        return y

    def forward(self, x):
        if x.device.type != "cpu":
            raise RuntimeError("%s: Colibri computes on the CPU; got a %s tensor" % (self.name, x.device))
        if torch.compiler.is_compiling():
            y = torch.ops.colibri.linear(x, self._handle)
        else:
            y = self.run(x)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def close(self):
        self._finalizer()


class Embedding(nn.Module):
    """Rows of a table stored in a block format, dequantised on lookup
    (colibri_dequantize): the table costs its stored bytes, not 4 per
    weight. `rows`: uint8 [num_embeddings, row_bytes] as stored."""

    def __init__(self, rows, dtype, num_embeddings, embedding_dim, name="embedding"):
        super().__init__()
        stored, dtype = _stored_rows(rows, dtype, int(num_embeddings), int(embedding_dim), None, name)
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self.dtype_name = dtype
        self.name = name
        self._rows = torch.from_numpy(stored)
        self._key = id(self)
        _EMBEDDINGS[self._key] = self

    def extra_repr(self):
        return "%d, %d, dtype=%s" % (self.num_embeddings, self.embedding_dim, self.dtype_name)

    def run(self, ids):
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError("%s: token id out of range [0, %d)" % (self.name, self.num_embeddings))
        picked = self._rows.index_select(0, flat.to(torch.long)).numpy()
        out = dequantize(picked, self.dtype_name, self.embedding_dim)
        return torch.from_numpy(out).reshape(tuple(ids.shape) + (self.embedding_dim,))

    def forward(self, ids):
        if torch.compiler.is_compiling():
            return torch.ops.colibri.embedding(ids, self._key)
        return self.run(ids)


def _rms_norm(fn, x, weight, eps):
    """colibri_rms_norm (`fn`) over the last dimension of a float32 CPU tensor."""
    if not x.is_contiguous():
        x = x.contiguous()
    dim = weight.shape[0]
    y = torch.empty_like(x)
    status = fn(x.data_ptr(), weight.data_ptr(), x.numel() // dim, dim, eps, y.data_ptr())
    if status:
        L.check(status, "colibri_rms_norm")
    return y


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps) over the last dimension in one
    C call (colibri_rms_norm), what the MoE families' RMSNorm modules compute
    in float32 with six PyTorch operators. `weight` stays a parameter, so
    state_dict() is the original module's. Non-float32 or non-CPU inputs
    fall back to the same formula in PyTorch."""

    def __init__(self, weight, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.as_tensor(weight).detach().to(torch.float32).contiguous(),
                                   requires_grad=False)
        self.variance_epsilon = float(eps)
        self._fn = L.fn("colibri_rms_norm")

    @classmethod
    def replacing(cls, module):
        return cls(module.weight, module.variance_epsilon)

    def extra_repr(self):
        return "%s, eps=%s" % (tuple(self.weight.shape), self.variance_epsilon)

    def run(self, x):
        return _rms_norm(self._fn, x, self.weight, self.variance_epsilon)

    def forward(self, x):
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != self.weight.shape[0] or (
                x.requires_grad and torch.is_grad_enabled()):
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (self.weight * h).to(x.dtype)
        if torch.compiler.is_compiling():
            return torch.ops.colibri.rms_norm(x, self.weight, self.variance_epsilon)
        return self.run(x)


@torch.library.custom_op("colibri::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(L.fn("colibri_rms_norm"), x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("colibri::linear", mutates_args=())
def _linear_op(x: torch.Tensor, handle: int) -> torch.Tensor:
    return _LINEARS[handle].run(x)


@_linear_op.register_fake
def _(x, handle):
    return x.new_empty(tuple(x.shape[:-1]) + (_LINEARS[handle].out_features,), dtype=torch.float32)


@torch.library.custom_op("colibri::moe", mutates_args=())
def _moe_op(x: torch.Tensor, key: int, layer: int) -> torch.Tensor:
    return run_moe(_MOE_MODELS[key], layer, x.contiguous())


@_moe_op.register_fake
def _(x, key, layer):
    return torch.empty_like(x)


@torch.library.custom_op("colibri::embedding", mutates_args=())
def _embedding_op(ids: torch.Tensor, key: int) -> torch.Tensor:
    return _EMBEDDINGS[key].run(ids)


@_embedding_op.register_fake
def _(ids, key):
    return torch.empty(tuple(ids.shape) + (_EMBEDDINGS[key].embedding_dim,), dtype=torch.float32,
                       device=ids.device)
