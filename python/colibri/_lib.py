"""ctypes binding of libcolibri's C ABI (include/colibri.h).

Everything that touches ctypes lives here: finding and loading the shared
library, the struct layouts, the prototypes, and turning a failed status into
ColibriError. The rest of the package works with Python objects only.

The struct layouts below mirror include/colibri.h field for field. Structs
only ever grow at the end; the ones the library fills (info, stats) get a
zeroed reserved tail here, so an older library leaves the fields it does not
know at zero and a newer one cannot write past the end of ours.
"""

import ctypes
import ctypes.util
import glob
import os
import threading

__all__ = ["ColibriError", "lib", "library_path", "has", "check"]

# --------------------------------------------------------------- constants

OK = 0
ERR_INVALID_ARGUMENT = 1
ERR_IO = 2
ERR_FORMAT = 3
ERR_CHECKSUM = 4
ERR_OUT_OF_MEMORY = 5
ERR_UNSUPPORTED = 6
ERR_INTERNAL = 7
ERR_CANCELLED = 8

STATUS_NAMES = {
    0: "COLIBRI_OK",
    1: "COLIBRI_ERR_INVALID_ARGUMENT",
    2: "COLIBRI_ERR_IO",
    3: "COLIBRI_ERR_FORMAT",
    4: "COLIBRI_ERR_CHECKSUM",
    5: "COLIBRI_ERR_OUT_OF_MEMORY",
    6: "COLIBRI_ERR_UNSUPPORTED",
    7: "COLIBRI_ERR_INTERNAL",
    8: "COLIBRI_ERR_CANCELLED",
}

DTYPE_F32, DTYPE_F16, DTYPE_BF16 = 0, 1, 2
DTYPE_Q8_0, DTYPE_Q4_0, DTYPE_Q4_K, DTYPE_Q5_K, DTYPE_Q6_K, DTYPE_MXFP4 = 3, 4, 5, 6, 7, 8
DTYPE_Q4_1, DTYPE_Q5_0, DTYPE_Q5_1, DTYPE_IQ4_NL, DTYPE_IQ4_XS, DTYPE_Q2_K, DTYPE_Q3_K = 9, 10, 11, 12, 13, 14, 15
DTYPE_IQ2_XXS, DTYPE_IQ3_XXS, DTYPE_IQ1_S, DTYPE_IQ1_M = 16, 17, 18, 19
DTYPE_IQ2_XS, DTYPE_IQ2_S, DTYPE_IQ3_S = 20, 21, 22
DTYPE_FP8_E4M3 = 23
DTYPE_TQ1_0, DTYPE_TQ2_0 = 24, 25
DTYPE_NAMES = {DTYPE_F32: "f32", DTYPE_F16: "f16", DTYPE_BF16: "bf16", DTYPE_Q8_0: "q8_0",
               DTYPE_Q4_0: "q4_0", DTYPE_Q4_K: "q4_k", DTYPE_Q5_K: "q5_k", DTYPE_Q6_K: "q6_k",
               DTYPE_MXFP4: "mxfp4", DTYPE_Q4_1: "q4_1", DTYPE_Q5_0: "q5_0", DTYPE_Q5_1: "q5_1",
               DTYPE_IQ4_NL: "iq4_nl", DTYPE_IQ4_XS: "iq4_xs", DTYPE_Q2_K: "q2_k", DTYPE_Q3_K: "q3_k",
               DTYPE_IQ2_XXS: "iq2_xxs", DTYPE_IQ3_XXS: "iq3_xxs", DTYPE_IQ1_S: "iq1_s", DTYPE_IQ1_M: "iq1_m",
               DTYPE_IQ2_XS: "iq2_xs", DTYPE_IQ2_S: "iq2_s", DTYPE_IQ3_S: "iq3_s",
               DTYPE_FP8_E4M3: "fp8_e4m3", DTYPE_TQ1_0: "tq1_0", DTYPE_TQ2_0: "tq2_0"}
QUANTIZED_DTYPES = frozenset({DTYPE_Q8_0, DTYPE_Q4_0, DTYPE_Q4_K, DTYPE_Q5_K, DTYPE_Q6_K, DTYPE_MXFP4, DTYPE_Q4_1,
                              DTYPE_Q5_0, DTYPE_Q5_1, DTYPE_IQ4_NL, DTYPE_IQ4_XS, DTYPE_Q2_K, DTYPE_Q3_K,
                              DTYPE_IQ2_XXS, DTYPE_IQ3_XXS, DTYPE_IQ1_S, DTYPE_IQ1_M, DTYPE_IQ2_XS, DTYPE_IQ2_S,
                              DTYPE_IQ3_S, DTYPE_FP8_E4M3, DTYPE_TQ1_0, DTYPE_TQ2_0})
DTYPE_CODES = {v: k for k, v in DTYPE_NAMES.items()}

HUGE_PAGE_NAMES = {0: "none", 1: "transparent", 2: "hugetlbfs"}

ROUTER_FAMILIES = {
    0: None,
    1: "mixtral",
    2: "qwen2_moe",
    3: "qwen3_moe",
    4: "olmoe",
    5: "deepseek_v2",
    6: "deepseek_v3",
    7: "gpt_oss",
}
ROUTER_CODES = {v: k for k, v in ROUTER_FAMILIES.items() if v is not None}

ROUTE_WEIGHTS_F32 = 1
ROUTE_WEIGHTS_F16 = 2

# ------------------------------------------------------------------ structs

# _TAIL: every struct passed by pointer ends in a zeroed reserved block. The
# library's *_default() functions and output functions write sizeof(their
# struct); if a newer library has appended fields, they land in the tail
# (holding the library's defaults) instead of past the end of our memory.
# Structs embedded in others (RouterDesc, ExpertWeights, LayerWeights) cannot
# have one: growing those is an ABI break for C callers too.

c_int32 = ctypes.c_int32
c_float = ctypes.c_float
c_void_p = ctypes.c_void_p


# colibri_progress_fn: int32_t (*)(float progress, void* user_data).
PROGRESS_FN = ctypes.CFUNCTYPE(c_int32, c_float, c_void_p)


class OpenOptions(ctypes.Structure):
    _fields_ = [
        ("n_threads", c_int32),
        ("lock_memory", c_int32),
        ("huge_pages", c_int32),
        ("verify_checksums", c_int32),
        ("pin_threads", c_int32),
        ("reserve_tokens", c_int32),
        ("bf16_compute", c_int32),
        ("exact_prefill", c_int32),
        ("max_resident_bytes", ctypes.c_uint64),
        ("max_resident_percent", c_float),
        ("io_threads", c_int32),
        ("eviction_policy", c_int32),
        ("direct_io", c_int32),
        ("speculate", c_int32),
        ("io_engine", c_int32),
        ("tune_kernels", c_int32),
        ("progress", c_void_p),  # a PROGRESS_FN kept alive by the caller
        ("progress_user_data", c_void_p),
        ("local_experts", c_void_p),  # uint8 flags kept alive by the caller
        ("local_experts_len", ctypes.c_int64),
        ("skip_shared_expert", c_int32),
        ("_reserved", ctypes.c_uint8 * 256),  # see _TAIL
    ]


class RouterDesc(ctypes.Structure):
    _fields_ = [
        ("family", ctypes.c_int),  # enum
        ("top_k", c_int32),
        ("norm_topk_prob", c_int32),
        ("n_group", c_int32),
        ("topk_group", c_int32),
        ("routed_scaling_factor", c_float),
    ]


class ExpertWeights(ctypes.Structure):
    _fields_ = [
        ("gate", c_void_p),
        ("up", c_void_p),
        ("down", c_void_p),
        ("gate_bias", c_void_p),  # const float*, with expert_bias
        ("up_bias", c_void_p),
        ("down_bias", c_void_p),
    ]


class LayerWeights(ctypes.Structure):
    _fields_ = [
        ("experts", ctypes.POINTER(ExpertWeights)),
        ("router", c_void_p),  # const float*
        ("router_bias", c_void_p),  # const float*
        ("shared", ExpertWeights),
        ("shared_gate", c_void_p),  # const float*
    ]


# int32_t (*)(void* user, int32_t layer, int32_t expert, colibri_expert_weights_t* out)
FETCH_EXPERT = ctypes.CFUNCTYPE(c_int32, c_void_p, c_int32, c_int32, ctypes.POINTER(ExpertWeights))


class ModelDesc(ctypes.Structure):
    _fields_ = [
        ("n_layers", c_int32),
        ("n_experts", c_int32),
        ("d_model", c_int32),
        ("d_ff", c_int32),
        ("dtype", ctypes.c_int),  # enum
        ("shared_d_ff", c_int32),
        ("router", RouterDesc),
        ("layers", ctypes.POINTER(LayerWeights)),
        ("down_dtype", ctypes.c_int),  # enum
        ("activation", ctypes.c_int),  # enum
        ("swiglu_alpha", c_float),
        ("swiglu_limit", c_float),
        ("expert_bias", c_int32),
        ("fetch_expert", FETCH_EXPERT),
        ("fetch_user", c_void_p),
        ("_reserved", ctypes.c_uint8 * 256),  # see _TAIL
    ]


class InferArgs(ctypes.Structure):
    _fields_ = [
        ("layer", c_int32),
        ("n_tokens", c_int32),
        ("input", c_void_p),
        ("output", c_void_p),
        ("top_k", c_int32),
        ("expert_ids", c_void_p),
        ("expert_weights", c_void_p),
        ("routing_blob", c_void_p),
        ("routing_blob_size", ctypes.c_size_t),
        ("n_threads", c_int32),
        ("_reserved", ctypes.c_uint8 * 256),  # see _TAIL
    ]


class ModelInfo(ctypes.Structure):
    _fields_ = [
        ("n_layers", c_int32),
        ("n_experts", c_int32),
        ("d_model", c_int32),
        ("d_ff", c_int32),
        ("dtype", ctypes.c_int),
        ("n_threads", c_int32),
        ("format_version", c_int32),
        ("router_family", ctypes.c_int),
        ("router_top_k", c_int32),
        ("shared_d_ff", c_int32),
        ("down_dtype", ctypes.c_int),
        ("activation", ctypes.c_int),
        ("swiglu_alpha", c_float),
        ("swiglu_limit", c_float),
        ("expert_bias", c_int32),
        ("_reserved", ctypes.c_uint8 * 256),  # see _TAIL
    ]


class Stats(ctypes.Structure):
    _fields_ = [
        ("bytes_mapped", ctypes.c_uint64),
        ("bytes_locked", ctypes.c_uint64),
        ("bytes_huge_pages", ctypes.c_uint64),
        ("huge_page_kind", ctypes.c_int),
        ("bytes_files", ctypes.c_uint64),
        ("load_seconds", ctypes.c_double),
        ("verify_seconds", ctypes.c_double),
        ("infer_calls", ctypes.c_uint64),
        ("expert_swaps", ctypes.c_uint64),
        ("cache_slots", c_int32),
        ("resident_bytes", ctypes.c_uint64),
        ("resident_experts", ctypes.c_uint64),
        ("experts_bytes", ctypes.c_uint64),
        ("cache_hits", ctypes.c_uint64),
        ("cache_misses", ctypes.c_uint64),
        ("cache_evictions", ctypes.c_uint64),
        ("expert_reads", ctypes.c_uint64),
        ("expert_read_failures", ctypes.c_uint64),
        ("bytes_read", ctypes.c_uint64),
        ("direct_reads", ctypes.c_uint64),
        ("read_seconds", ctypes.c_double),
        ("checksum_seconds", ctypes.c_double),
        ("wait_seconds", ctypes.c_double),
        ("prefetch_reads", ctypes.c_uint64),
        ("prefetch_used", ctypes.c_uint64),
        ("predicted", ctypes.c_uint64),
        ("predicted_used", ctypes.c_uint64),
        ("uring_reads", ctypes.c_uint64),
        ("_reserved", ctypes.c_uint8 * 256),  # see _TAIL
    ]


class RouteCompileOptions(ctypes.Structure):
    _fields_ = [
        ("n_experts", c_int32),
        ("compact", c_int32),
        ("q4_weights", c_int32),
        ("weight_encoding", ctypes.c_int),
        ("_reserved", ctypes.c_uint8 * 256),  # see _TAIL
    ]


class RopeDesc(ctypes.Structure):
    _fields_ = [
        ("batch", c_int32),
        ("heads", c_int32),
        ("tokens", c_int32),
        ("head_dim", c_int32),
        ("rotary_dim", c_int32),
        ("half_table", c_int32),
        ("x", c_void_p),
        ("x_stride", ctypes.c_int64 * 3),
        ("out", c_void_p),
        ("out_stride", ctypes.c_int64 * 3),
        ("cos", c_void_p),
        ("sin", c_void_p),
        ("table_stride", ctypes.c_int64 * 2),
        ("_reserved", ctypes.c_uint8 * 256),  # see _TAIL
    ]


class AttentionDesc(ctypes.Structure):
    _fields_ = [
        ("batch", c_int32),
        ("heads", c_int32),
        ("kv_heads", c_int32),
        ("q_len", c_int32),
        ("kv_len", c_int32),
        ("qk_dim", c_int32),
        ("v_dim", c_int32),
        ("window", c_int32),
        ("n_threads", c_int32),
        ("scale", c_float),
        ("q", c_void_p),
        ("q_stride", ctypes.c_int64 * 3),
        ("k", c_void_p),
        ("k_stride", ctypes.c_int64 * 3),
        ("v", c_void_p),
        ("v_stride", ctypes.c_int64 * 3),
        ("mask", c_void_p),
        ("additive_mask", c_void_p),
        ("mask_stride", ctypes.c_int64 * 3),
        ("sinks", c_void_p),
        ("out", c_void_p),
        ("k2", c_void_p),
        ("k2_stride", ctypes.c_int64 * 3),
        ("qk2_dim", c_int32),
        ("_reserved", ctypes.c_uint8 * 256),  # see _TAIL
    ]


class LinearDesc(ctypes.Structure):
    _fields_ = [
        ("dtype", ctypes.c_int),
        ("out_features", c_int32),
        ("in_features", c_int32),
        ("weight", c_void_p),
        ("weight_size", ctypes.c_size_t),
        ("bias", c_void_p),
        ("n_threads", c_int32),
        ("exact", c_int32),
        ("huge_pages", c_int32),
        ("lock_memory", c_int32),
        ("name", ctypes.c_char_p),
        ("groups", c_int32),
        ("fixed_kernels", c_int32),
        ("_reserved", ctypes.c_uint8 * 256),  # see _TAIL
    ]


class SwapSource(ctypes.Structure):
    _fields_ = [
        ("path", ctypes.c_char_p),
        ("data", c_void_p),
        ("size", ctypes.c_size_t),
        ("dtype", ctypes.c_int),
        ("has_checksum", c_int32),
        ("checksum", ctypes.c_uint64),
        ("_reserved", ctypes.c_uint8 * 256),  # see _TAIL
    ]


# --------------------------------------------------------------- the error


class ColibriError(RuntimeError):
    """A Colibri entry point returned a non-zero status.

    Attributes: ``status`` (int, a colibri_status_t), ``status_name`` (e.g.
    ``"COLIBRI_ERR_FORMAT"``) and ``message`` (colibri_last_error() of the
    failed call: it names the file, field or line at fault).
    """

    def __init__(self, status, message, function=None):
        self.status = int(status)
        self.status_name = STATUS_NAMES.get(self.status, "COLIBRI_ERR_%d" % self.status)
        self.message = message
        self.function = function
        text = message or "(no message)"
        super().__init__("%s: %s" % (self.status_name, text))


# ---------------------------------------------------------- finding the lib

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
# python/colibri/ -> the repository root, when running from the source tree.
_SOURCE_ROOT = os.path.dirname(os.path.dirname(_PKG_DIR))
_LIB_NAMES = ("libcolibri.so", "libcolibri.so.0", "libcolibri.dylib")


def _is_sanitized(path):
    """True if the library links a sanitizer runtime (ASan/TSan): such a
    library cannot be loaded into an ordinary python3, and trying aborts the
    whole process rather than raising, so build trees holding one are
    skipped."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return False
    return b"libasan.so" in data or b"libtsan.so" in data or b"__asan_init" in data


def candidate_paths():
    """Where the library is looked for, in order (see docs/PYTORCH.md):

    1. $COLIBRI_LIBRARY (a file, or a folder holding libcolibri.so);
    2. libcolibri.so bundled in the package folder (``pip install .`` from
       the repository root builds it with CMake and puts it there);
    3. the build trees ``<source root>/build*/`` when the package runs from
       the source tree, newest library first, sanitizer builds skipped;
    4. ctypes.util.find_library("colibri") (an installed library).
    """
    out = []
    env = os.environ.get("COLIBRI_LIBRARY")
    if env:
        if os.path.isdir(env):
            out.extend(os.path.join(env, n) for n in _LIB_NAMES)
        else:
            out.append(env)
        return [("COLIBRI_LIBRARY", p) for p in out]
    for n in _LIB_NAMES:
        out.append(("package", os.path.join(_PKG_DIR, n)))
    builds = []
    for d in glob.glob(os.path.join(_SOURCE_ROOT, "build*")):
        for n in _LIB_NAMES:
            p = os.path.join(d, n)
            if os.path.isfile(p):
                try:
                    builds.append((os.path.getmtime(os.path.realpath(p)), p))
                except OSError:
                    pass
                break
    for _, p in sorted(builds, reverse=True):
        if not _is_sanitized(p):
            out.append(("build tree", p))
    found = ctypes.util.find_library("colibri")
    if found:
        out.append(("system", found))
    return out


_lib = None
_lib_path = None
_lib_lock = threading.Lock()


def _load():
    global _lib, _lib_path
    with _lib_lock:
        if _lib is not None:
            return _lib
        tried = []
        cands = candidate_paths()
        for origin, path in cands:
            if origin != "system" and not os.path.exists(path):
                tried.append("%s (%s): not found" % (path, origin))
                continue
            try:
                handle = ctypes.CDLL(path)
            except OSError as e:
                tried.append("%s (%s): %s" % (path, origin, e))
                continue
            _declare(handle)
            _lib, _lib_path = handle, (path if origin == "system" else os.path.abspath(path))
            return _lib
        raise OSError(
            "colibri: cannot find libcolibri. Set COLIBRI_LIBRARY to the library's path, "
            "build it (cmake -S . -B build && cmake --build build --target colibri), or install "
            "the package with its library (pip install . from the repository root). Tried: "
            + ("; ".join(tried) or "nothing")
        )


def lib():
    """The loaded ctypes.CDLL (loading it on first use)."""
    return _lib if _lib is not None else _load()


def library_path():
    """Path of the libcolibri that was loaded."""
    lib()
    return _lib_path


def has(name):
    """Whether the loaded library exports `name` (v2 entry points may be
    missing from an older library)."""
    return hasattr(lib(), name)


# -------------------------------------------------------------- prototypes

_P = ctypes.POINTER
_PROTOTYPES = {
    "colibri_last_error": (ctypes.c_char_p, []),
    "colibri_last_warning": (ctypes.c_char_p, []),
    "colibri_status_name": (ctypes.c_char_p, [ctypes.c_int]),
    "colibri_dtype_name": (ctypes.c_char_p, [ctypes.c_int]),
    "colibri_version": (ctypes.c_char_p, []),
    "colibri_cpu_isa": (ctypes.c_char_p, []),
    "colibri_dtype_row_bytes": (ctypes.c_size_t, [ctypes.c_int, ctypes.c_size_t]),
    "colibri_quantize": (
        ctypes.c_int,
        [ctypes.c_int, c_void_p, ctypes.c_size_t, ctypes.c_size_t, c_void_p, ctypes.c_size_t],
    ),
    "colibri_dequantize": (
        ctypes.c_int,
        [ctypes.c_int, c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, c_void_p],
    ),
    "colibri_open_options_default": (None, [_P(OpenOptions)]),
    "colibri_open": (ctypes.c_int, [ctypes.c_char_p, _P(OpenOptions), _P(c_void_p)]),
    "colibri_free": (None, [c_void_p]),
    "colibri_router_desc_default": (None, [_P(RouterDesc)]),
    "colibri_router_family_name": (ctypes.c_char_p, [ctypes.c_int]),
    "colibri_model_desc_default": (None, [_P(ModelDesc)]),
    "colibri_open_memory": (ctypes.c_int, [_P(ModelDesc), _P(OpenOptions), _P(c_void_p)]),
    "colibri_infer_default": (None, [_P(InferArgs)]),
    "colibri_infer": (ctypes.c_int, [c_void_p, _P(InferArgs)]),
    "colibri_route": (
        ctypes.c_int,
        [c_void_p, c_int32, c_int32, c_void_p, c_void_p, c_void_p],
    ),
    "colibri_swap_source_default": (None, [_P(SwapSource)]),
    "colibri_swap_expert": (ctypes.c_int, [c_void_p, c_int32, c_int32, _P(SwapSource)]),
    "colibri_model_info": (ctypes.c_int, [c_void_p, _P(ModelInfo)]),
    "colibri_stats": (ctypes.c_int, [c_void_p, _P(Stats)]),
    "colibri_prefetch": (ctypes.c_int, [c_void_p, c_int32, _P(c_int32), c_int32, _P(c_int32)]),
    "colibri_model_kernels": (ctypes.c_char_p, [c_void_p]),
    "colibri_model_source": (ctypes.c_char_p, [c_void_p]),
    "colibri_model_first_block": (ctypes.c_int32, [c_void_p]),
    "colibri_layer_dtypes": (ctypes.c_int, [c_void_p, ctypes.c_int32, _P(ctypes.c_int), _P(ctypes.c_int)]),
    "colibri_verify_dir": (ctypes.c_int, [ctypes.c_char_p]),
    "colibri_route_compile_options_default": (None, [_P(RouteCompileOptions)]),
    "colibri_route_compile": (
        ctypes.c_int,
        [c_void_p, ctypes.c_size_t, ctypes.c_char_p, _P(RouteCompileOptions), _P(c_void_p),
         _P(ctypes.c_size_t)],
    ),
    "colibri_route_compile_file": (
        ctypes.c_int,
        [ctypes.c_char_p, ctypes.c_char_p, _P(RouteCompileOptions)],
    ),
    "colibri_buffer_free": (None, [c_void_p]),
    "colibri_doctor": (ctypes.c_int, [ctypes.c_char_p, c_int32, _P(c_void_p), _P(ctypes.c_size_t)]),
    "colibri_routing_decode": (
        ctypes.c_int,
        [c_void_p, ctypes.c_size_t, c_int32, ctypes.c_char_p, _P(c_void_p)],
    ),
    "colibri_routing_load": (
        ctypes.c_int,
        [ctypes.c_char_p, c_int32, c_int32, _P(c_void_p)],
    ),
    "colibri_routing_n_tokens": (c_int32, [c_void_p]),
    "colibri_routing_n_experts": (c_int32, [c_void_p]),
    "colibri_routing_top_k": (c_int32, [c_void_p]),
    "colibri_routing_is_compact": (c_int32, [c_void_p]),
    "colibri_routing_weight_encoding": (ctypes.c_int, [c_void_p]),
    "colibri_routing_expert_ids": (c_void_p, [c_void_p]),
    "colibri_routing_expert_weights": (c_void_p, [c_void_p]),
    "colibri_routing_free": (None, [c_void_p]),
    "colibri_linear_desc_default": (None, [_P(LinearDesc)]),
    "colibri_linear_create": (ctypes.c_int, [_P(LinearDesc), _P(c_void_p)]),
    "colibri_linear_forward": (ctypes.c_int, [c_void_p, c_int32, c_void_p, c_void_p]),
    "colibri_linear_kernels": (ctypes.c_char_p, [c_void_p]),
    "colibri_linear_bytes": (ctypes.c_uint64, [c_void_p]),
    "colibri_linear_free": (None, [c_void_p]),
    "colibri_rms_norm": (ctypes.c_int, [c_void_p, c_void_p, c_int32, c_int32, ctypes.c_float, c_void_p]),
    "colibri_attention_desc_default": (None, [_P(AttentionDesc)]),
    "colibri_attention": (ctypes.c_int, [_P(AttentionDesc)]),
    "colibri_rope": (ctypes.c_int, [_P(RopeDesc)]),
}


def _declare(handle):
    for name, (restype, argtypes) in _PROTOTYPES.items():
        try:
            fn = getattr(handle, name)
        except AttributeError:
            continue  # an older library: callers check has(name)
        fn.restype = restype
        fn.argtypes = argtypes


def fn(name):
    """The C function `name`; ColibriError(UNSUPPORTED) if this library
    predates it."""
    L = lib()
    try:
        return getattr(L, name)
    except AttributeError:
        raise ColibriError(
            ERR_UNSUPPORTED,
            "%s is not exported by %s (a library older than this Python package; rebuild it)"
            % (name, _lib_path),
            name,
        ) from None


def last_error():
    s = lib().colibri_last_error()
    return s.decode("utf-8", "replace") if s else ""


def last_warning():
    s = lib().colibri_last_warning()
    return s.decode("utf-8", "replace") if s else ""


def check(status, function):
    """Raises ColibriError for a non-zero status, with the thread's message."""
    if status != OK:
        raise ColibriError(status, last_error(), function)


def version():
    s = lib().colibri_version()
    return s.decode() if s else ""


def cpu_isa():
    """The instruction-set level Colibri computes at here (COLIBRI_ISA may lower it)."""
    s = lib().colibri_cpu_isa()
    return s.decode() if s else ""


def router_family_name(code):
    if code in ROUTER_FAMILIES:
        return ROUTER_FAMILIES[code]
    return "family_%d" % code


def router_family_code(family):
    """Accepts a name ('mixtral', 'deepseek_v3', 'DeepSeek-V3'), None/'none'
    or an int; returns the colibri_router_family_t value."""
    if family is None:
        return 0
    if isinstance(family, int):
        if family not in ROUTER_FAMILIES:
            raise ValueError("router family %d is not one of %s" % (family, sorted(ROUTER_FAMILIES)))
        return family
    key = str(family).strip().lower().replace("-", "_")
    if key in ("none", ""):
        return 0
    aliases = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "deepseekv2": "deepseek_v2",
               "deepseekv3": "deepseek_v3", "gptoss": "gpt_oss"}
    key = aliases.get(key.replace("_", ""), key)
    if key not in ROUTER_CODES:
        raise ValueError("unknown router family %r; expected one of %s" % (family, sorted(ROUTER_CODES)))
    return ROUTER_CODES[key]
