"""Checking NumPy arrays and PyTorch tensors before their memory is handed to
the C library.

The library trusts the pointers it gets, so everything a wrong buffer could
break (dtype, shape, device, contiguity, alignment, overlap) is checked here
first and reported as TypeError (wrong kind or dtype) or ValueError (wrong
shape, device, layout or overlap), naming the argument and what was expected.
torch is never imported here: a tensor is recognised through sys.modules, so
NumPy-only users never pay for importing torch.
"""

import sys

import numpy as np

NUMPY = "numpy"
TORCH = "torch"


def _torch():
    return sys.modules.get("torch")


def kind_of(obj, name):
    """'numpy' or 'torch'; TypeError for anything else."""
    if isinstance(obj, np.ndarray):
        return NUMPY
    t = _torch()
    if t is not None and isinstance(obj, t.Tensor):
        return TORCH
    raise TypeError(
        "%s must be a numpy.ndarray or a torch.Tensor, got %s" % (name, type(obj).__name__)
    )


def dtype_name(obj):
    if isinstance(obj, np.ndarray):
        return "numpy.%s" % obj.dtype
    return str(obj.dtype)


_NP = {"float32": np.dtype(np.float32), "int32": np.dtype(np.int32), "int64": np.dtype(np.int64),
       "float16": np.dtype(np.float16), "uint16": np.dtype(np.uint16), "int16": np.dtype(np.int16)}


def _torch_dtypes(t):
    return {"float32": t.float32, "int32": t.int32, "int64": t.int64, "float16": t.float16,
            "bfloat16": t.bfloat16, "int16": t.int16}


def has_dtype(obj, names):
    """Whether obj's dtype is one of `names` ('float32', 'int64', ...); numpy
    dtypes must also be native byte order."""
    if isinstance(obj, np.ndarray):
        return any(n in _NP and obj.dtype == _NP[n] and obj.dtype.isnative for n in names)
    td = _torch_dtypes(_torch())
    return any(n in td and obj.dtype == td[n] for n in names)


class Lazy:
    """A weight read when the library copies it (Model.from_arrays): `read()`
    returns the array of `shape`. A checkpoint's experts are read and
    quantised one at a time this way, so a block never exists whole in
    floats (colibri.loader)."""

    def __init__(self, shape, read, nbytes):
        self.shape, self.read, self.nbytes = tuple(int(s) for s in shape), read, int(nbytes)


def shape_of(obj):
    return tuple(int(s) for s in obj.shape)


def check_cpu(obj, name):
    if isinstance(obj, np.ndarray):
        return
    dev = obj.device
    if dev.type != "cpu":
        raise ValueError("%s must be a CPU tensor, got a tensor on %s (move it with .cpu())" % (name, dev))
    t = _torch()
    if obj.layout != t.strided:
        raise ValueError("%s must be a dense (strided) tensor, got layout %s" % (name, obj.layout))
    if obj.is_quantized:
        raise TypeError("%s must not be a quantized tensor" % name)


def is_contiguous(obj):
    if isinstance(obj, np.ndarray):
        return bool(obj.flags["C_CONTIGUOUS"])
    return bool(obj.is_contiguous())


def data_ptr(obj):
    if isinstance(obj, np.ndarray):
        return int(obj.__array_interface__["data"][0])
    return int(obj.data_ptr())


def nbytes(obj):
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    return int(obj.numel()) * int(obj.element_size())


def itemsize(obj):
    if isinstance(obj, np.ndarray):
        return int(obj.itemsize)
    return int(obj.element_size())


def check_buffer(obj, name, dtypes, shape=None, ndim=None, writeable=False):
    """Checks kind, device, dtype, shape and layout of one argument and
    returns its kind. `shape` may hold None for free dimensions."""
    kind = kind_of(obj, name)
    check_cpu(obj, name)
    if not has_dtype(obj, dtypes):
        raise TypeError("%s must have dtype %s, got %s" % (name, " or ".join(dtypes), dtype_name(obj)))
    s = shape_of(obj)
    want_ndim = len(shape) if shape is not None else ndim
    if want_ndim is not None and len(s) != want_ndim:
        raise ValueError(
            "%s must be %d-D %s, got shape %s" % (name, want_ndim, _fmt_shape(shape, want_ndim), list(s))
        )
    if shape is not None:
        for got, want in zip(s, shape):
            if want is not None and got != want:
                raise ValueError("%s must have shape %s, got %s" % (name, _fmt_shape(shape, want_ndim), list(s)))
    if not is_contiguous(obj):
        raise ValueError(
            "%s must be C-contiguous (row-major, dense); got strides %s: pass %s"
            % (name, list(obj.strides) if isinstance(obj, np.ndarray) else list(obj.stride()),
               "numpy.ascontiguousarray(%s)" % name if kind == NUMPY else "%s.contiguous()" % name)
        )
    n = nbytes(obj)
    if n > 0:
        ptr = data_ptr(obj)
        if ptr == 0:
            raise ValueError("%s has no data (a tensor on the meta device?)" % name)
        if ptr % itemsize(obj) != 0:
            raise ValueError("%s is not aligned to its element size" % name)
    if writeable:
        if kind == NUMPY and not obj.flags["WRITEABLE"]:
            raise ValueError("%s must be writeable" % name)
    return kind


def _fmt_shape(shape, ndim):
    if shape is None:
        return "[%s]" % ", ".join("?" * ndim)
    return "[%s]" % ", ".join("?" if d is None else str(d) for d in shape)


def overlaps(a, b):
    na, nb = nbytes(a), nbytes(b)
    if na == 0 or nb == 0:
        return False
    pa, pb = data_ptr(a), data_ptr(b)
    return pa < pb + nb and pb < pa + na


def ids_as_int32(ids, name="ids"):
    """int32 ids pass through untouched; int64 ids (torch.topk's) are
    converted to a new int32 array after checking that every value fits,
    so a large id is reported rather than wrapped to a valid one."""
    if has_dtype(ids, ("int32",)):
        return ids
    if isinstance(ids, np.ndarray):
        if ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < -(2**31) or hi >= 2**31:
                raise ValueError("%s holds values outside int32 (min %d, max %d)" % (name, lo, hi))
        return np.ascontiguousarray(ids, dtype=np.int32)
    t = _torch()
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < -(2**31) or hi >= 2**31:
            raise ValueError("%s holds values outside int32 (min %d, max %d)" % (name, lo, hi))
    return ids.to(t.int32).contiguous()


def empty_like_kind(kind, shape, dtype="float32"):
    if kind == NUMPY:
        return np.empty(shape, dtype=np.dtype(dtype))
    t = _torch()
    return t.empty(shape, dtype=_torch_dtypes(t)[dtype])


# ------------------------------------------------------------ weight buffers

_WEIGHT_DTYPES = {"f32": ("float32",), "f16": ("float16",), "bf16": ("bfloat16", "uint16", "int16")}


def f32_to_bf16_bits(a):
    """float32 numpy array -> bf16 bit patterns (uint16), round to nearest
    even, as PyTorch's .to(torch.bfloat16) does for finite values."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = u + (((u >> 16) & 1) + np.uint32(0x7FFF))
    return (rounded >> 16).astype(np.uint16)


def as_weight(obj, dtype, name, shape):
    """Returns a C-contiguous CPU buffer of `dtype` ('f32', 'f16', 'bf16')
    and `shape` holding obj's values: obj itself when it already is one
    (no copy), else a converted copy. bf16 NumPy buffers are uint16 (or
    int16) bit patterns, as NumPy has no bfloat16."""
    kind = kind_of(obj, name)
    check_cpu(obj, name)
    s = shape_of(obj)
    if s != tuple(shape):
        raise ValueError("%s must have shape %s, got %s" % (name, list(shape), list(s)))
    if kind == TORCH:
        t = _torch()
        target = {"f32": t.float32, "f16": t.float16, "bf16": t.bfloat16}[dtype]
        out = obj.detach()
        if not out.is_floating_point():
            raise TypeError("%s must be a floating-point tensor, got %s" % (name, obj.dtype))
        if out.dtype != target:
            out = out.to(target)
        return out.contiguous()
    if has_dtype(obj, _WEIGHT_DTYPES[dtype]):
        return np.ascontiguousarray(obj)
    if obj.dtype.kind != "f":
        raise TypeError(
            "%s must be a floating-point array%s, got numpy.%s"
            % (name, " (or uint16 bf16 bit patterns)" if dtype == "bf16" else "", obj.dtype)
        )
    if dtype == "f32":
        return np.ascontiguousarray(obj, dtype=np.float32)
    if dtype == "f16":
        return np.ascontiguousarray(obj, dtype=np.float16)
    return f32_to_bf16_bits(obj)


def as_numpy_f32(buf):
    """A float32 buffer from as_weight(..., 'f32', ...) as a NumPy array
    (a torch tensor's memory shared, not copied)."""
    if isinstance(buf, np.ndarray):
        return buf
    return buf.numpy()


def as_f32_vector(obj, name, n):
    """A float32 C-contiguous buffer of n values (a [n] or [1, n] input)."""
    kind = kind_of(obj, name)
    check_cpu(obj, name)
    if kind == TORCH:
        obj = obj.detach()
    s = shape_of(obj)
    total = 1
    for d in s:
        total *= d
    if total != n or len([d for d in s if d != 1]) > 1:
        raise ValueError("%s must hold %d values ([%d] or [1, %d]), got shape %s" % (name, n, n, n, list(s)))
    return as_weight(obj.reshape(n), "f32", name, (n,))


def leading_strides(t, n):
    """The element strides of a tensor's first n dimensions, 0 for those of
    size 1 (any stride reads the one element; 0 says so to the C side)."""
    st = t.stride()
    sh = t.shape
    return [0 if sh[i] == 1 else st[i] for i in range(n)]
