"""Weight types and the library's quantisers (colibri_quantize /
colibri_dequantize): rows of float32 to the bytes a model file holds, and
back. The block formats store GGUF's blocks; q8_0 and q4_0 equal what the
gguf package's quantiser writes, and every format dequantises bit for bit
as gguf.quants does (python/tests/test_quant_formats.py)."""

import ctypes

import numpy as np

from . import _lib

DTYPES = tuple(_lib.DTYPE_NAMES.values())
QUANTIZED = tuple(_lib.DTYPE_NAMES[c] for c in sorted(_lib.QUANTIZED_DTYPES))
# The mixes: gate/up type, down type (llama.cpp's Q4_K_M gives expert down
# matrices q6_k in some layers and q4_k in others; a Colibri model holds one
# down type, so q4_k_m takes q6_k everywhere).
MIXES = {"q4_k_m": ("q4_k", "q6_k")}


def dtype_code(dtype):
    """The colibri_dtype_t of a name ("q4_k"); ValueError naming the known ones."""
    try:
        return _lib.DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}") from None


def split_dtype(dtype):
    """(gate/up type, down type) of a dtype or mix name."""
    if dtype in MIXES:
        return MIXES[dtype]
    dtype_code(dtype)
    return dtype, dtype


def row_bytes(dtype, n):
    """Bytes of one row of n weights of `dtype` (block formats: whole blocks)."""
    return int(_lib.fn("colibri_dtype_row_bytes")(dtype_code(dtype), int(n)))


def block_elements(dtype):
    """Weights per block of `dtype` (1 for the float types)."""
    return next(b for b in (1, 32, 128, 256) if row_bytes(dtype, b + 1) > row_bytes(dtype, b))


def quantize(x, dtype):
    """float32 [rows, n] (or [n]) -> uint8 [rows, row_bytes(dtype, n)]."""
    a = np.ascontiguousarray(x, dtype=np.float32)
    squeeze = a.ndim == 1
    if squeeze:
        a = a[None, :]
    if a.ndim != 2:
        raise ValueError(f"quantize: expected a 1-D or 2-D array, got shape {a.shape}")
    rows, n = a.shape
    out = np.empty((rows, row_bytes(dtype, n)), dtype=np.uint8)
    _lib.check(_lib.fn("colibri_quantize")(dtype_code(dtype), a.ctypes.data_as(ctypes.c_void_p), rows, n,
                                           out.ctypes.data_as(ctypes.c_void_p), out.nbytes), "colibri_quantize")
    return out[0] if squeeze else out


def dequantize(data, dtype, n):
    """uint8 [rows, row_bytes(dtype, n)] (or one row) -> float32 [rows, n]."""
    b = np.ascontiguousarray(data, dtype=np.uint8)
    squeeze = b.ndim == 1
    if squeeze:
        b = b[None, :]
    rows = b.shape[0]
    out = np.empty((rows, int(n)), dtype=np.float32)
    _lib.check(_lib.fn("colibri_dequantize")(dtype_code(dtype), b.ctypes.data_as(ctypes.c_void_p), b.nbytes, rows,
                                             int(n), out.ctypes.data_as(ctypes.c_void_p)), "colibri_dequantize")
    return out[0] if squeeze else out
