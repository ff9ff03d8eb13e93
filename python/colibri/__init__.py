"""Colibri: a CPU runtime for Mixture-of-Experts layers, from Python.

A ctypes binding of libcolibri's C ABI (include/colibri.h): no compiled
extension. NumPy arrays and PyTorch CPU tensors are passed to the library
without copies.

    import colibri
    with colibri.Model("path/to/model") as m:
        y = m.infer(x, ids, weights)          # x float32 [T, d_model]

Submodules: colibri.routing (.route / routing.bin export, compile, load),
colibri.torch (ColibriExperts, accelerate(model); imports torch lazily).
See docs/PYTORCH.md.
"""

from ._lib import ColibriError, library_path
from ._lib import cpu_isa as _cpu_isa
from ._lib import version as _version
from .model import Model, ModelInfo, ModelStats, RouterConfig, save_model
from . import routing
from .quant import dequantize, quantize

__all__ = ["Model", "ModelInfo", "ModelStats", "RouterConfig", "ColibriError", "library_path",
           "library_version", "cpu_isa", "routing", "has_open_memory", "save_model", "quantize", "dequantize"]

__version__ = "0.2.0"


def library_version():
    """The loaded libcolibri's version string (colibri_version())."""
    return _version()


def cpu_isa():
    """The instruction-set level the loaded library computes at on this CPU:
    "scalar", "avx2", "avx512" or "amx" (colibri_cpu_isa(); the environment
    variable COLIBRI_ISA may lower it)."""
    return _cpu_isa()


def has_open_memory():
    """Whether the loaded library builds models from memory (v2 ABI:
    colibri_open_memory, built-in routers, shared experts), which
    colibri.torch needs."""
    from . import _lib

    return _lib.has("colibri_open_memory")


def __getattr__(name):
    # `colibri.torch` is imported on first use only, so importing colibri
    # never imports torch.
    if name == "torch":
        import importlib

        return importlib.import_module(".torch", __name__)
    raise AttributeError("module 'colibri' has no attribute %r" % name)
