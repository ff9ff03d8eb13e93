"""colibri.Model: one opened Colibri model (a directory, or buffers)."""

import ctypes
import dataclasses
import os
import threading
import warnings
from typing import Optional

import numpy as np

from . import _arrays as A
from . import _lib as L
from ._lib import ColibriError
from .fp8 import Fp8Weight

__all__ = ["Model", "ModelInfo", "ModelStats", "RouterConfig", "save_model"]

ACTIVATIONS = {0: "swiglu", 1: "clamped_swiglu"}  # colibri_activation_t
ACTIVATION_CODES = {v: k for k, v in ACTIVATIONS.items()}


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """colibri_model_info(). dtype is 'f32', 'f16', 'bf16' or a block format
    ('q8_0', 'q4_0', 'q4_k', 'q5_k', 'q6_k', 'mxfp4'), down_dtype that of the down
    matrices (the same unless mixed, e.g. 'q6_k' with 'q4_k'); router_family
    is None without a built-in router, else e.g. 'mixtral' or 'gpt_oss';
    activation 'swiglu' or 'clamped_swiglu' (gpt-oss, with swiglu_alpha and
    swiglu_limit), expert_bias whether the experts have biases."""

    n_layers: int
    n_experts: int
    d_model: int
    d_ff: int
    dtype: str
    n_threads: int
    format_version: int
    router_family: Optional[str]
    router_top_k: int
    shared_d_ff: int
    down_dtype: str = ""
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False


@dataclasses.dataclass(frozen=True)
class ModelStats:
    """colibri_stats(): packed bytes, how many are locked / on huge pages,
    load and checksum time, successful infer calls and expert swaps so far."""

    bytes_mapped: int
    bytes_locked: int
    bytes_huge_pages: int
    huge_page_kind: str
    bytes_files: int
    load_seconds: float
    verify_seconds: float
    infer_calls: int
    expert_swaps: int = 0
    # Under a memory budget (max_resident=; all 0 without one): the pool,
    # hits and misses of calls, reads, and prefetch / router speculation.
    cache_slots: int = 0
    resident_bytes: int = 0
    resident_experts: int = 0
    experts_bytes: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_evictions: int = 0
    expert_reads: int = 0
    expert_read_failures: int = 0
    bytes_read: int = 0
    direct_reads: int = 0
    read_seconds: float = 0.0
    checksum_seconds: float = 0.0
    wait_seconds: float = 0.0
    prefetch_reads: int = 0
    prefetch_used: int = 0
    predicted: int = 0
    predicted_used: int = 0
    uring_reads: int = 0

    @property
    def hit_rate(self):
        """Hits over the calls' lookups (0 before any)."""
        n = self.cache_hits + self.cache_misses
        return self.cache_hits / n if n else 0.0


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """A built-in router (colibri_router_desc_t). family: 'mixtral',
    'qwen2_moe', 'qwen3_moe', 'olmoe', 'deepseek_v2', 'deepseek_v3' or 'gpt_oss'; the
    rules are in include/colibri.h."""

    family: str
    top_k: int
    norm_topk_prob: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    @classmethod
    def coerce(cls, obj):
        if obj is None or isinstance(obj, cls):
            return obj
        if isinstance(obj, dict):
            return cls(**obj)
        raise TypeError("router must be a colibri.RouterConfig or a dict, got %s" % type(obj).__name__)

    def to_c(self):
        r = L.RouterDesc()
        if L.has("colibri_router_desc_default"):
            L.lib().colibri_router_desc_default(ctypes.byref(r))
        else:
            r.n_group, r.topk_group, r.routed_scaling_factor = 1, 1, 1.0
        r.family = L.router_family_code(self.family)
        r.top_k = int(self.top_k)
        r.norm_topk_prob = 1 if self.norm_topk_prob else 0
        r.n_group = int(self.n_group)
        r.topk_group = int(self.topk_group)
        r.routed_scaling_factor = float(self.routed_scaling_factor)
        return r


_EVICTION = {"freq": 0, "lru": 1}
_IO_ENGINE = {"pread": 0, "io_uring": 1}


def _apply_budget(o, max_resident, eviction, io_threads, direct_io, speculate, io_engine="pread"):
    """max_resident: None, bytes (int), or a percentage string such as '25%'."""
    if max_resident is not None:
        if isinstance(max_resident, str) and max_resident.strip().endswith("%"):
            pct = float(max_resident.strip()[:-1])
            if not 0.0 <= pct <= 100.0:
                raise ValueError("max_resident %r: the percentage must be in [0, 100]" % (max_resident,))
            o.max_resident_percent = pct
        elif isinstance(max_resident, (int, np.integer)) and not isinstance(max_resident, bool):
            if int(max_resident) < 0:
                raise ValueError("max_resident must be >= 0 bytes, got %r" % (max_resident,))
            o.max_resident_bytes = int(max_resident)
        else:
            raise TypeError("max_resident must be bytes (int) or a percentage string such as '25%%', got %r"
                            % (max_resident,))
    if eviction not in _EVICTION:
        raise ValueError("eviction must be 'freq' or 'lru', got %r" % (eviction,))
    o.eviction_policy = _EVICTION[eviction]
    o.io_threads = _check_int(io_threads, "io_threads", 0, 64)
    o.direct_io = 1 if direct_io else 0
    o.speculate = 1 if speculate else 0
    if io_engine not in _IO_ENGINE:
        raise ValueError("io_engine must be 'pread' or 'io_uring', got %r" % (io_engine,))
    o.io_engine = _IO_ENGINE[io_engine]


def _open_options(threads, lock, huge_pages, verify, bf16_compute, pin_threads, reserve_tokens, exact_prefill=False):
    o = L.OpenOptions()
    L.lib().colibri_open_options_default(ctypes.byref(o))
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
        raise ValueError("threads must be an int >= 0 (0 = one per core), got %r" % (threads,))
    o.n_threads = threads
    o.lock_memory = 1 if lock else 0
    o.huge_pages = 1 if huge_pages else 0
    o.verify_checksums = 1 if verify else 0
    o.bf16_compute = 1 if bf16_compute else 0
    o.exact_prefill = 1 if exact_prefill else 0
    if pin_threads is not None:
        o.pin_threads = 1 if pin_threads else 0
    if reserve_tokens is not None:
        if int(reserve_tokens) < 0:
            raise ValueError("reserve_tokens must be >= 0, got %r" % (reserve_tokens,))
        o.reserve_tokens = int(reserve_tokens)
    return o


def _check_int(value, name, lo, hi):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError("%s must be an int, got %s" % (name, type(value).__name__))
    value = int(value)
    if not lo <= value <= hi:
        raise ValueError("%s must be in [%d, %d], got %d" % (name, lo, hi, value))
    return value


_CACHE_STAT_FIELDS = ("cache_slots", "resident_bytes", "resident_experts", "experts_bytes", "cache_hits",
                      "cache_misses", "cache_evictions", "expert_reads", "expert_read_failures", "bytes_read",
                      "direct_reads", "read_seconds", "checksum_seconds", "wait_seconds", "prefetch_reads",
                      "prefetch_used", "predicted", "predicted_used", "uring_reads")


def _apply_local_experts(opts, local_experts, skip_shared_expert):
    """colibri_open_options_t's expert share: `local_experts` a mask (bools
    or 0/1) of [n_experts] or [n_layers, n_experts]; returns the array the
    options point into (keep it until the open returns)."""
    opts.skip_shared_expert = 1 if skip_shared_expert else 0
    if local_experts is None:
        return None
    mask = np.asarray(local_experts)
    if mask.dtype != np.bool_ and not (np.issubdtype(mask.dtype, np.integer) and np.isin(mask, (0, 1)).all()):
        raise ValueError("local_experts must be a mask of bools or 0/1 ([n_experts] or [n_layers, n_experts]), "
                         "got dtype %s" % mask.dtype)
    if mask.ndim not in (1, 2) or mask.size == 0:
        raise ValueError("local_experts must be [n_experts] or [n_layers, n_experts], got shape %s" % (mask.shape,))
    mask = np.ascontiguousarray(mask.astype(np.uint8).reshape(-1))
    opts.local_experts = mask.ctypes.data
    opts.local_experts_len = mask.size
    return mask


class _OpenProgress:
    """Model's `progress=`: None or False for none; True for a tqdm bar on
    stderr; or a callable taking the fraction done (0 to 1) that returns
    False to cancel the open. An exception raised in the callable (a
    KeyboardInterrupt while the file is read included) cancels the open and
    is raised again once the library has freed what it made."""

    def __init__(self, progress, path, opts):
        self.error, self.bar, self.fn = None, None, None
        if progress is None or progress is False:
            return
        if progress is True:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                warnings.warn("progress=True draws its bar with tqdm, which is not installed (pip install tqdm)")
                return
            self.bar = tqdm(total=100, desc="opening %s" % os.path.basename(path), unit="%",
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}", leave=False)
            fn = self._advance
        elif callable(progress):
            fn = progress
        else:
            raise TypeError("progress must be None, a bool or a callable, got %r" % (progress,))

        def hook(fraction, _user):
            try:
                return 0 if fn(fraction) is False else 1
            except BaseException as e:  # noqa: B036 - KeyboardInterrupt cancels the open too
                self.error = e
                return 0

        self.fn = L.PROGRESS_FN(hook)  # kept alive by self for the call
        opts.progress = ctypes.cast(self.fn, ctypes.c_void_p)

    def _advance(self, fraction):
        self.bar.update(fraction * 100 - self.bar.n)

    def check(self, status):
        if status == L.ERR_CANCELLED and self.error is not None:
            raise self.error
        L.check(status, "colibri_open")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
        return False


class Model:
    """A Colibri model.

    ``Model(path, threads=0, lock=True, huge_pages=True, verify=True,
    bf16_compute=False, *, exact_prefill=False, max_resident=None, eviction="freq",
    io_threads=0, direct_io=True, speculate=True, io_engine="pread", tune_kernels=True, progress=None)`` opens a
    model directory (colibri.json + expert
    files, docs/FORMAT.md) or a GGUF file's MoE layers (the first file of a
    split set for a split one); ``max_resident`` (bytes, or a string such as
    ``"25%"`` of the experts) keeps only that much of the expert weights in
    memory and reads the rest on demand (docs/CACHE.md); ``tune_kernels``
    times the instruction-set levels' kernels on the model's experts at open
    and keeps the fastest, remembered per CPU (colibri_open_options_t's
    tune_kernels; ``kernels`` says what was chosen); ``progress`` True shows a
    tqdm bar of the open, or a callable gets the fraction done (0 to 1) and
    returns False to cancel it (ColibriError COLIBRI_ERR_CANCELLED; nothing
    stays open); ``local_experts`` (a bool mask, [n_experts] or [n_layers,
    n_experts]) opens only those experts, for expert parallelism: routing
    still picks among all, the others add nothing, so processes holding
    disjoint shares sum to the whole layer (``skip_shared_expert`` leaves the
    shared expert to another process); ``Model.from_arrays(...)`` builds one from
    in-memory weights (colibri_open_memory). ``close()`` (or ``with``)
    releases it; methods of a closed model raise ValueError.

    Calls may come from several threads at once (the library serialises them
    on the model's thread pool); the GIL is released while the library runs.
    """

    def __init__(self, path, threads=0, lock=True, huge_pages=True, verify=True, bf16_compute=False,
                 *, pin_threads=None, reserve_tokens=None, exact_prefill=False, max_resident=None,
                 eviction="freq", io_threads=0, direct_io=True, speculate=True, io_engine="pread",
                 tune_kernels=True, progress=None, local_experts=None, skip_shared_expert=False):
        self._handle = None
        self._cond = threading.Condition()
        self._in_flight = 0
        self._fast = threading.local()  # _infer_pointers' argument struct, one per calling thread
        if path is None:  # from_arrays fills the handle in
            return
        opts = _open_options(threads, lock, huge_pages, verify, bf16_compute, pin_threads, reserve_tokens,
                             exact_prefill)
        _apply_budget(opts, max_resident, eviction, io_threads, direct_io, speculate, io_engine)
        opts.tune_kernels = 1 if tune_kernels else 0
        local = _apply_local_experts(opts, local_experts, skip_shared_expert)  # noqa: F841 - kept for the call
        p = os.fsencode(os.fspath(path))
        h = ctypes.c_void_p()
        with _OpenProgress(progress, os.fspath(path), opts) as watch:
            watch.check(L.lib().colibri_open(p, ctypes.byref(opts), ctypes.byref(h)))
        self._set_handle(h, os.fspath(path))

    def _set_handle(self, h, source):
        self.warning = L.last_warning()  # e.g. "mlock refused: ..." ("" if none)
        self._handle = h.value
        self.source = source
        info = L.ModelInfo()
        L.check(L.lib().colibri_model_info(ctypes.c_void_p(self._handle), ctypes.byref(info)), "colibri_model_info")
        self._info = ModelInfo(
            n_layers=info.n_layers,
            n_experts=info.n_experts,
            d_model=info.d_model,
            d_ff=info.d_ff,
            dtype=L.DTYPE_NAMES.get(info.dtype, str(info.dtype)),
            n_threads=info.n_threads,
            format_version=info.format_version,
            router_family=L.router_family_name(info.router_family),
            router_top_k=info.router_top_k,
            shared_d_ff=info.shared_d_ff,
            down_dtype=L.DTYPE_NAMES.get(info.down_dtype, str(info.down_dtype)),
            activation=ACTIVATIONS.get(info.activation, str(info.activation)),
            swiglu_alpha=info.swiglu_alpha,
            swiglu_limit=info.swiglu_limit,
            expert_bias=bool(info.expert_bias),
        )

    # ------------------------------------------------------------ from memory

    @classmethod
    def from_arrays(cls, layers, dtype="f32", router=None, threads=0, lock=True, huge_pages=True,
                    bf16_compute=False, *, pin_threads=None, reserve_tokens=None, exact_prefill=False,
                    activation="swiglu", swiglu_alpha=1.702, swiglu_limit=7.0, tune_kernels=True):
        """Builds a model from weights in memory (colibri_open_memory).

        layers: a list, one dict per layer, with
          - ``experts``: a list of (gate [F, D], up [F, D], down [D, F]) per
            expert (nn.Linear.weight layout; each may be a
            colibri._arrays.Lazy, read when it is copied), or a stacked triple
            (gate [E, F, D], up [E, F, D], down [E, D, F]); or instead
          - ``gate_up_proj`` [E, 2F, D] (gate rows first) and ``down_proj``
            [E, D, F] (the fused layout);
          - ``router`` [E, D] (required with a built-in router),
            ``router_bias`` [E] (DeepSeek-V3's e_score_correction_bias);
          - ``shared``: (gate [S, D], up [S, D], down [D, S]) for a shared
            expert, ``shared_gate`` [D] (or [1, D]) for Qwen2-MoE's sigmoid
            gate on it;
          - ``gate_bias`` [E, F], ``up_bias`` [E, F], ``down_bias`` [E, D]:
            expert biases (gpt-oss), in every layer or in none.
        activation: 'swiglu' or 'clamped_swiglu' (gpt-oss: gate clamped to
        at most swiglu_limit, up to [-limit, limit], then
        (up + 1) * gate * sigmoid(swiglu_alpha * gate)).
        Arrays are NumPy arrays or CPU torch tensors; ones already of `dtype`
        and contiguous are passed without a copy, others are converted
        (bf16 in NumPy: uint16 bit patterns). The library copies everything
        at open, so nothing is referenced afterwards.
        dtype: 'f32', 'f16' or 'bf16', or a block format ('q8_0', 'q4_0',
        'q4_k', 'q5_k', 'q6_k', 'mxfp4', or 'q4_k_m': q4_k with q6_k down) into which
        the expert weights (given as floats) are quantised here with the
        library's reference quantisers (colibri.quantize); the router and
        gates stay f32. router: RouterConfig or dict.
        """
        from . import quant as Q

        try:
            dtype, down_dtype = Q.split_dtype(dtype)
        except ValueError:
            raise ValueError("dtype must be one of %s or 'q4_k_m', got %r" % (", ".join(Q.DTYPES), dtype)) from None

        def weight(obj, name, shape, t=None):
            t = t or dtype
            if isinstance(obj, A.Lazy):
                if tuple(obj.shape) != tuple(shape):
                    raise ValueError("%s must have shape %s, got %s" % (name, list(shape), list(obj.shape)))
                obj = obj.read()
            if isinstance(obj, Fp8Weight):  # a checkpoint's block-scaled FP8: as stored, or dequantised first
                if tuple(obj.shape) != tuple(shape):
                    raise ValueError("%s must have shape %s, got %s" % (name, list(shape), list(obj.shape)))
                if t == "fp8_e4m3":
                    return obj.packed()
                obj = obj.dequantize()
            if t not in Q.QUANTIZED:
                return A.as_weight(obj, t, name, shape)
            return Q.quantize(A.as_numpy_f32(A.as_weight(obj, "f32", name, shape)), t)

        router = RouterConfig.coerce(router)
        if not isinstance(layers, (list, tuple)) or not layers:
            raise ValueError("layers must be a non-empty list of dicts, one per layer")
        if activation not in ACTIVATION_CODES:
            raise ValueError("activation must be one of %s, got %r" % (sorted(ACTIVATION_CODES), activation))
        keep = []  # every buffer whose pointer the descriptor holds
        E = D = F = S = None
        biased = None
        streamed, streamed_layers = None, []

        def fill(c_expert, where, e, g, u, d, biases, hold):
            g = weight(g, "%s expert %d gate" % (where, e), (F, D))
            u = weight(u, "%s expert %d up" % (where, e), (F, D))
            d = weight(d, "%s expert %d down" % (where, e), (D, F), down_dtype)
            hold.extend((g, u, d))
            c_expert.gate, c_expert.up, c_expert.down = (A.data_ptr(g), A.data_ptr(u), A.data_ptr(d))
            if biases is not None:
                c_expert.gate_bias, c_expert.up_bias, c_expert.down_bias = (
                    A.data_ptr(b) + 4 * e * n for b, n in zip(biases, (F, F, D)))
        c_layers = (L.LayerWeights * len(layers))()
        expert_arrays = []
        for li, layer in enumerate(layers):
            if not isinstance(layer, dict):
                raise TypeError("layers[%d] must be a dict, got %s" % (li, type(layer).__name__))
            unknown = set(layer) - {"experts", "gate_up_proj", "down_proj", "router", "router_bias", "shared",
                                    "shared_gate", "gate_bias", "up_bias", "down_bias"}
            if unknown:
                raise ValueError("layers[%d]: unknown keys %s" % (li, sorted(unknown)))
            where = "layers[%d]" % li
            triples = _expert_triples(layer, where)
            e_n = len(triples)
            g0 = triples[0][0]
            f_n, d_n = A.shape_of(g0)[-2:] if len(A.shape_of(g0)) >= 2 else (None, None)
            if f_n is None:
                raise ValueError("%s: expert gate weights must be 2-D [d_ff, d_model], got shape %s"
                                 % (where, list(A.shape_of(g0))))
            if E is None:
                E, D, F = e_n, d_n, f_n
            elif (e_n, d_n, f_n) != (E, D, F):
                raise ValueError("%s: %d experts of [d_ff=%d, d_model=%d], but layer 0 has %d of [%d, %d]"
                                 % (where, e_n, f_n, d_n, E, F, D))
            c_experts = (L.ExpertWeights * E)()
            given = [layer.get(k) is not None for k in ("gate_bias", "up_bias", "down_bias")]
            if any(given) and not all(given):
                raise ValueError("%s: gate_bias, up_bias and down_bias go together" % where)
            if biased is None:
                biased = all(given)
            elif biased != all(given):
                raise ValueError("%s: expert biases must be given in every layer or in none" % where)
            if biased:
                biases = [A.as_weight(layer[k], "f32", "%s %s" % (where, k), (E, n))
                          for k, n in (("gate_bias", F), ("up_bias", F), ("down_bias", D))]
                keep.extend(biases)
            lazy = any(isinstance(w, A.Lazy) for t in triples for w in t)
            if streamed is None:
                streamed = lazy
            elif streamed != lazy:
                raise ValueError("%s: Lazy expert weights in some layers only" % where)
            if lazy:  # read, converted and copied one expert at a time (fetch below)
                streamed_layers.append((where, triples, biases if biased else None))
            else:
                for e, (g, u, d) in enumerate(triples):
                    fill(c_experts[e], where, e, g, u, d, biases if biased else None, keep)
                expert_arrays.append(c_experts)
                c_layers[li].experts = ctypes.cast(c_experts, ctypes.POINTER(L.ExpertWeights))
            if layer.get("router") is not None:
                r = A.as_weight(layer["router"], "f32", where + " router", (E, D))
                keep.append(r)
                c_layers[li].router = A.data_ptr(r)
            elif router is not None:
                raise ValueError("%s: a model with a built-in router needs 'router' [%d, %d] weights" % (where, E, D))
            if layer.get("router_bias") is not None:
                b = A.as_f32_vector(layer["router_bias"], where + " router_bias", E)
                keep.append(b)
                c_layers[li].router_bias = A.data_ptr(b)
            shared = layer.get("shared")
            if shared is not None:
                if not isinstance(shared, (list, tuple)) or len(shared) != 3:
                    raise ValueError("%s: shared must be (gate, up, down)" % where)
                sg = A.shape_of(shared[0])
                if len(sg) != 2:
                    raise ValueError("%s: shared gate must be 2-D [shared_d_ff, d_model], got %s" % (where, list(sg)))
                if S is None:
                    S = sg[0]
                elif S != sg[0]:
                    raise ValueError("%s: shared_d_ff %d differs from layer 0's %d" % (where, sg[0], S))
                g = weight(shared[0], where + " shared gate", (S, D))
                u = weight(shared[1], where + " shared up", (S, D))
                d = weight(shared[2], where + " shared down", (D, S), down_dtype)
                keep.extend((g, u, d))
                c_layers[li].shared.gate = A.data_ptr(g)
                c_layers[li].shared.up = A.data_ptr(u)
                c_layers[li].shared.down = A.data_ptr(d)
                if layer.get("shared_gate") is not None:
                    sgv = A.as_f32_vector(layer["shared_gate"], where + " shared_gate", D)
                    keep.append(sgv)
                    c_layers[li].shared_gate = A.data_ptr(sgv)
            elif layer.get("shared_gate") is not None:
                raise ValueError("%s: shared_gate given without a shared expert" % where)
        if S is not None:
            missing = [i for i, layer in enumerate(layers) if layer.get("shared") is None]
            if missing:
                raise ValueError("layers %s have no shared expert, but layer(s) before have one" % missing)

        desc = L.ModelDesc()
        open_memory = L.fn("colibri_open_memory")
        L.fn("colibri_model_desc_default")(ctypes.byref(desc))
        desc.n_layers = len(layers)
        desc.n_experts = E
        desc.d_model = D
        desc.d_ff = F
        desc.dtype = L.DTYPE_CODES[dtype]
        desc.down_dtype = L.DTYPE_CODES[down_dtype]
        desc.shared_d_ff = S or 0
        desc.activation = ACTIVATION_CODES[activation]
        desc.swiglu_alpha = float(swiglu_alpha)
        desc.swiglu_limit = float(swiglu_limit)
        desc.expert_bias = 1 if biased else 0
        if router is not None:
            desc.router = router.to_c()
        desc.layers = ctypes.cast(c_layers, ctypes.POINTER(L.LayerWeights))
        errors, current = [], []
        if streamed:
            def fetch(_user, li, e, out):
                # The library copies this expert before asking for the next:
                # only one is ever held here.
                try:
                    current.clear()
                    where, triples, biases = streamed_layers[li]
                    fill(out[0], where, e, *triples[e], biases, current)
                    return 0
                except BaseException as ex:  # raised below, after the open fails
                    errors.append(ex)
                    return 1
            desc.fetch_expert = L.FETCH_EXPERT(fetch)
        opts = _open_options(threads, lock, huge_pages, True, bf16_compute, pin_threads, reserve_tokens,
                             exact_prefill)
        opts.tune_kernels = 1 if tune_kernels else 0
        h = ctypes.c_void_p()
        status = open_memory(ctypes.byref(desc), ctypes.byref(opts), ctypes.byref(h))
        if errors:
            raise errors[0]
        L.check(status, "colibri_open_memory")
        del keep, expert_arrays, current  # the library copied the weights
        self = cls(None)
        self._set_handle(h, "<memory>")
        return self

    # ------------------------------------------------------------- lifetime

    def _acquire(self):
        with self._cond:
            if self._handle is None:
                raise ValueError("the Colibri model is closed")
            self._in_flight += 1
            return ctypes.c_void_p(self._handle)

    def _release(self):
        with self._cond:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._cond.notify_all()

    def close(self):
        """Frees the model (waits for calls in progress on other threads).
        Idempotent."""
        with self._cond:
            if self._handle is None:
                return
            h, self._handle = self._handle, None
            while self._in_flight:
                self._cond.wait()
        L.lib().colibri_free(ctypes.c_void_p(h))

    @property
    def closed(self):
        return self._handle is None

    def __enter__(self):
        return self

    # The weights a model holds are read-only, so a copy of an object holding
    # one (a ColibriExperts, an accelerated model) shares it; a model cannot be
    # pickled (it is a handle into this process).
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        raise TypeError("a colibri.Model cannot be pickled (save the PyTorch state_dict, or the model directory)")

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if getattr(self, "_handle", None) is not None and L._lib is not None:
                self.close()
        except Exception:
            pass

    def __repr__(self):
        if self._handle is None:
            return "<colibri.Model closed>"
        i = self._info
        extra = ""
        if i.router_family:
            extra += ", router=%s top_k=%d" % (i.router_family, i.router_top_k)
        if i.shared_d_ff:
            extra += ", shared_d_ff=%d" % i.shared_d_ff
        return "<colibri.Model %s: %d layer(s), %d experts, d_model=%d, d_ff=%d, %s%s>" % (
            self.source, i.n_layers, i.n_experts, i.d_model, i.d_ff, i.dtype, extra)

    # ----------------------------------------------------------- inspection

    @property
    def info(self):
        """ModelInfo (layers, experts, sizes, dtype, threads, router, shared expert)."""
        if self._handle is None:
            raise ValueError("the Colibri model is closed")
        return self._info

    @property
    def stats(self):
        h = self._acquire()
        try:
            s = L.Stats()
            L.check(L.lib().colibri_stats(h, ctypes.byref(s)), "colibri_stats")
        finally:
            self._release()
        return ModelStats(
            bytes_mapped=s.bytes_mapped,
            bytes_locked=s.bytes_locked,
            bytes_huge_pages=s.bytes_huge_pages,
            huge_page_kind=L.HUGE_PAGE_NAMES.get(s.huge_page_kind, str(s.huge_page_kind)),
            bytes_files=s.bytes_files,
            load_seconds=s.load_seconds,
            verify_seconds=s.verify_seconds,
            infer_calls=s.infer_calls,
            expert_swaps=s.expert_swaps,
            **{f: getattr(s, f) for f in _CACHE_STAT_FIELDS},
        )

    def prefetch(self, layer, experts):
        """Starts reads of `experts` (ids of layer `layer`) into the cache of
        a model opened with max_resident=, for a caller that knows a coming
        call's routing (colibri_prefetch); returns the reads started (0
        without a budget). Never waits."""
        info = self.info
        layer = _check_int(layer, "layer", 0, info.n_layers - 1)
        ids = np.ascontiguousarray(np.asarray(experts, dtype=np.int64).reshape(-1))
        if ids.size and (ids.min() < -1 or ids.max() >= info.n_experts):
            raise ValueError("experts must be in [0, %d) (-1 = none)" % info.n_experts)
        ids = ids.astype(np.int32)
        started = ctypes.c_int32(0)
        h = self._acquire()
        try:
            L.check(L.fn("colibri_prefetch")(h, layer, ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                             int(ids.size), ctypes.byref(started)), "colibri_prefetch")
        finally:
            self._release()
        return started.value

    @property
    def kernels(self):
        """Which kernels the model runs, e.g. 'decode avx512, prefill ...'."""
        h = self._acquire()
        try:
            s = L.lib().colibri_model_kernels(h)
        finally:
            self._release()
        return s.decode("utf-8", "replace") if s else ""

    @property
    def origin(self):
        """Where the weights came from: 'colibri model directory', or for a
        GGUF file its architecture, the blocks the layers are and the tensor
        types, e.g. 'gguf qwen3moe, layers 0-1 = blocks 1-2 of 3, gate/up
        Q4_K, down Q6_K, dense blocks skipped: 0'."""
        h = self._acquire()
        try:
            s = L.lib().colibri_model_source(h)
        finally:
            self._release()
        return s.decode("utf-8", "replace") if s else ""

    @property
    def first_block(self):
        """The source block of layer 0: for a GGUF file its first block with
        experts (layer l is GGUF block first_block + l), else 0."""
        h = self._acquire()
        try:
            return int(L.lib().colibri_model_first_block(h))
        finally:
            self._release()

    def layer_dtypes(self, layer):
        """(gate/up dtype, down dtype) of `layer`: info gives layer 0's; block
        formats read from a GGUF that varies them (Q4_K_M's down Q6_K or
        Q4_K) differ between layers."""
        h = self._acquire()
        try:
            d, down = ctypes.c_int(), ctypes.c_int()
            L.check(L.lib().colibri_layer_dtypes(h, int(layer), ctypes.byref(d), ctypes.byref(down)),
                    "colibri_layer_dtypes")
        finally:
            self._release()
        return L.DTYPE_NAMES.get(d.value, str(d.value)), L.DTYPE_NAMES.get(down.value, str(down.value))

    # ------------------------------------------------------------ inference

    def _check_x(self, x, layer):
        info = self.info
        layer = _check_int(layer, "layer", 0, info.n_layers - 1)
        kind = A.check_buffer(x, "x", ("float32",), shape=(None, info.d_model))
        T = A.shape_of(x)[0]
        if T >= 2**31:
            raise ValueError("x has %d rows; at most 2^31 - 1 tokens per call" % T)
        return kind, T, layer

    def _check_out(self, out, kind, T, inputs):
        D = self.info.d_model
        if out is None:
            return A.empty_like_kind(kind, (T, D))
        okind = A.kind_of(out, "out")
        if okind != kind:
            raise TypeError("out must be a %s like x, got a %s" % (
                "numpy.ndarray" if kind == A.NUMPY else "torch.Tensor",
                "numpy.ndarray" if okind == A.NUMPY else "torch.Tensor"))
        A.check_buffer(out, "out", ("float32",), shape=(T, D), writeable=True)
        for name, arr in inputs:
            if arr is not None and A.overlaps(out, arr):
                raise ValueError("out must not overlap %s (the library reads %s while writing out)" % (name, name))
        return out

    def infer(self, x, ids=None, weights=None, layer=0, out=None, threads=0, *, routing=None):
        """Runs one MoE layer: out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t])
        (+ the shared expert, if the model has one).

        x: float32 [T, d_model], a NumPy array or a CPU torch tensor,
        C-contiguous; read in place (no copy).
        ids: [T, k] int32 (used in place) or int64 (converted to int32: the
        only copy this call makes); -1 = no expert in that slot.
        weights: float32 [T, k], applied as given.
        ids=None and weights=None: the model's built-in router chooses
        (routing= a routing.bin blob instead: see colibri.routing).
        out: optional preallocated float32 [T, d_model], same kind as x, not
        overlapping any input; written in place and returned.
        Returns out (a new array/tensor of x's kind when not given).
        threads: 0 = the model's thread count, else at most that many.
        """
        kind, T, layer = self._check_x(x, layer)
        threads = _check_int(threads, "threads", 0, 2**31 - 1)
        args = L.InferArgs()
        args.layer = layer
        args.n_tokens = T
        args.n_threads = threads
        blob = None
        if routing is not None:
            if ids is not None or weights is not None:
                raise ValueError("give either routing= (a routing.bin blob) or ids/weights, not both")
            blob = _as_bytes(routing, "routing")
        elif (ids is None) != (weights is None):
            raise ValueError("ids and weights go together: give both, or neither to use the built-in router")
        if ids is not None:
            k = self._check_routing(ids, weights, T)
            ids = A.ids_as_int32(ids)
            args.top_k = k
            args.expert_ids = A.data_ptr(ids) if T else None
            args.expert_weights = A.data_ptr(weights) if T else None
        out = self._check_out(out, kind, T, [("x", x), ("ids", ids), ("weights", weights)])
        args.input = A.data_ptr(x) if T else None
        args.output = A.data_ptr(out) if T else None
        if blob is not None:
            buf = _bytes_pointer(blob)  # no copy; `blob` stays referenced below
            args.routing_blob = buf
            args.routing_blob_size = len(blob)
        h = self._acquire()
        try:
            status = L.lib().colibri_infer(h, ctypes.byref(args))
            if status:
                raise ColibriError(status, L.last_error(), "colibri_infer")
        finally:
            self._release()
        return out

    def _infer_pointers(self, layer, n_tokens, top_k, x, ids, weights, out):
        """colibri_infer on raw addresses, for callers that have checked
        every buffer already (colibri.torch's experts modules, whose checks
        are attribute tests on torch tensors): layer in range, x and out
        float32 [n_tokens, d_model], ids int32 and weights float32
        [n_tokens, top_k], all contiguous, out not overlapping the others.
        The library still checks ids' range, pointers and the overlap of x
        and out. About a tenth of infer()'s fixed cost."""
        fast = self._fast
        args = getattr(fast, "args", None)
        if args is None:
            args = fast.args = L.InferArgs()  # zeroed: colibri_infer_default's values
            fast.ref = ctypes.byref(args)
            fast.infer = L.lib().colibri_infer
        args.layer = layer
        args.n_tokens = n_tokens
        args.top_k = top_k
        args.input = x
        args.output = out
        args.expert_ids = ids
        args.expert_weights = weights
        with self._cond:
            if self._handle is None:
                raise ValueError("the Colibri model is closed")
            self._in_flight += 1
            h = self._handle
        try:
            status = fast.infer(h, fast.ref)
        finally:
            with self._cond:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._cond.notify_all()
        if status:
            raise ColibriError(status, L.last_error(), "colibri_infer")

    def swap_expert(self, layer, expert, weights=None, *, path=None, checksum=None):
        """Replaces one expert's weights while other threads keep calling
        infer (colibri_swap_expert: every call sees the whole old or the
        whole new expert; on error the old one keeps serving).

        weights: (gate [d_ff, d_model], up [d_ff, d_model], down [d_model,
        d_ff]) arrays or CPU tensors, converted to the model's dtype, or the
        raw bytes of an expert file; or path= an expert file (docs/FORMAT.md).
        checksum: optional XXH64 (int) the bytes must match."""
        info = self.info
        layer = _check_int(layer, "layer", 0, info.n_layers - 1)
        expert = _check_int(expert, "expert", 0, info.n_experts - 1)
        if (weights is None) == (path is None):
            raise ValueError("give either weights or path=")
        swap = L.fn("colibri_swap_expert")
        src = L.SwapSource()
        L.fn("colibri_swap_source_default")(ctypes.byref(src))
        data = None
        if path is not None:
            src.path = os.fsencode(os.fspath(path))
        else:
            data = _expert_bytes(weights, info.dtype, info.d_ff, info.d_model)
            src.data = _bytes_pointer(data)
            src.size = len(data)
            src.dtype = L.DTYPE_CODES[info.dtype]
        if checksum is not None:
            src.has_checksum = 1
            src.checksum = int(checksum)
        h = self._acquire()
        try:
            status = swap(h, layer, expert, ctypes.byref(src))
            if status:
                raise ColibriError(status, L.last_error(), "colibri_swap_expert")
        finally:
            self._release()
        del data

    def _check_routing(self, ids, weights, T):
        A.check_buffer(ids, "ids", ("int32", "int64"), ndim=2)
        s = A.shape_of(ids)
        if s[0] != T:
            raise ValueError("ids must have shape [T, k] with T = %d (x's rows), got %s" % (T, list(s)))
        k = s[1]
        if not 1 <= k <= self.info.n_experts:
            raise ValueError("ids must have shape [T, k] with 1 <= k <= %d (the model's experts), got %s"
                             % (self.info.n_experts, list(s)))
        A.check_buffer(weights, "weights", ("float32",), shape=(T, k))
        return k

    def route(self, x, layer=0, threads=0):
        """Runs only the built-in router on x (float32 [T, d_model]) of
        `layer`; returns (ids int32 [T, k], weights float32 [T, k]) of x's
        kind. ValueError if the model has no router."""
        kind, T, layer = self._check_x(x, layer)
        info = self.info
        if not info.router_family or info.router_top_k <= 0:
            raise ValueError("this model has no built-in router (router_family is None)")
        k = info.router_top_k
        ids = A.empty_like_kind(kind, (T, k), "int32")
        w = A.empty_like_kind(kind, (T, k), "float32")
        route = L.fn("colibri_route")
        h = self._acquire()
        try:
            status = route(h, layer, T, A.data_ptr(x) if T else None, A.data_ptr(ids) if T else None,
                           A.data_ptr(w) if T else None)
            if status:
                raise ColibriError(status, L.last_error(), "colibri_route")
        finally:
            self._release()
        return ids, w


def _expert_bytes(weights, dtype, F, D):
    """One expert file's bytes (gate, up, down in `dtype`) from a (gate, up,
    down) triple of arrays/tensors, or bytes given as they are."""
    if isinstance(weights, (bytes, bytearray, memoryview)):
        return bytes(weights)
    if not isinstance(weights, (tuple, list)) or len(weights) != 3:
        raise TypeError("weights must be (gate [d_ff, d_model], up [d_ff, d_model], down [d_model, d_ff]) "
                        "or the bytes of an expert file")
    parts = []
    for arr, name, shape in zip(weights, ("gate", "up", "down"), ((F, D), (F, D), (D, F))):
        buf = A.as_weight(arr, dtype, "weights " + name, shape)
        if A.kind_of(buf, name) == A.TORCH:
            t = __import__("torch")
            buf = buf.view(t.int16).numpy() if dtype != "f32" else buf.numpy()
        parts.append(np.ascontiguousarray(buf).tobytes())
    return b"".join(parts)


def _bytes_pointer(blob):
    """A c_void_p to the bytes of `blob` (bytes or bytearray), without a copy."""
    if isinstance(blob, bytearray):
        if not blob:
            return ctypes.c_void_p(None)
        return ctypes.cast((ctypes.c_char * len(blob)).from_buffer(blob), ctypes.c_void_p)
    return ctypes.cast(ctypes.c_char_p(blob), ctypes.c_void_p)


def _as_bytes(blob, name):
    if isinstance(blob, (bytes, bytearray)):
        return blob
    if isinstance(blob, memoryview):
        return blob.tobytes()
    if isinstance(blob, np.ndarray) and blob.dtype == np.uint8:
        return blob.tobytes()
    raise TypeError("%s must be bytes (routing.bin contents), got %s" % (name, type(blob).__name__))


def _expert_triples(layer, where):
    """[(gate, up, down)] per expert from a layer dict (per-expert list,
    stacked triple or fused gate_up_proj/down_proj)."""
    if "gate_up_proj" in layer or "down_proj" in layer:
        if "experts" in layer:
            raise ValueError("%s: give 'experts' or 'gate_up_proj'/'down_proj', not both" % where)
        gu, dn = layer.get("gate_up_proj"), layer.get("down_proj")
        if gu is None or dn is None:
            raise ValueError("%s: the fused layout needs both gate_up_proj and down_proj" % where)
        A.kind_of(gu, where + " gate_up_proj")
        A.kind_of(dn, where + " down_proj")
        sg, sd = A.shape_of(gu), A.shape_of(dn)
        if len(sg) != 3 or sg[1] % 2:
            raise ValueError("%s: gate_up_proj must be [E, 2*d_ff, d_model], got %s" % (where, list(sg)))
        E, F2, D = sg
        F = F2 // 2
        if sd != (E, D, F):
            raise ValueError("%s: down_proj must be [E, d_model, d_ff] = %s (from gate_up_proj %s), got %s"
                             % (where, [E, D, F], list(sg), list(sd)))
        return [(gu[e, :F], gu[e, F:], dn[e]) for e in range(E)]
    experts = layer.get("experts")
    if experts is None:
        raise ValueError("%s: needs 'experts' (or 'gate_up_proj' and 'down_proj')" % where)
    if isinstance(experts, (list, tuple)) and len(experts) == 3 and not isinstance(experts[0], (list, tuple)) \
            and len(A.shape_of(experts[0])) == 3:
        g, u, d = experts
        n = A.shape_of(g)[0]
        if A.shape_of(u)[0] != n or len(A.shape_of(d)) != 3 or A.shape_of(d)[0] != n:
            raise ValueError("%s: stacked experts must be gate [E, F, D], up [E, F, D], down [E, D, F]" % where)
        return [(g[e], u[e], d[e]) for e in range(n)]
    if not isinstance(experts, (list, tuple)) or not experts:
        raise ValueError("%s: experts must be a non-empty list of (gate, up, down)" % where)
    out = []
    for e, t in enumerate(experts):
        if not isinstance(t, (list, tuple)) or len(t) != 3:
            raise ValueError("%s: experts[%d] must be (gate, up, down)" % (where, e))
        out.append(tuple(t))
    return out


def save_model(path, layers, dtype="f16"):
    """Writes a model directory in format v1 (docs/FORMAT.md): colibri.json
    plus one raw file per expert (gate, up, down as nn.Linear stores them),
    which colibri.Model(path) and the CLI (`colibri infer --model`) open.

    layers: as Model.from_arrays, experts only (format v1 has no router and
    no shared expert: use Model.from_arrays / colibri.torch for those). The
    manifest is written last, so a failed write leaves no manifest. No
    checksums are written (the format makes them optional)."""
    import json

    if dtype not in L.DTYPE_CODES:
        raise ValueError("dtype must be 'f32', 'f16' or 'bf16', got %r" % (dtype,))
    if not isinstance(layers, (list, tuple)) or not layers:
        raise ValueError("layers must be a non-empty list of dicts, one per layer")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    E = D = F = None
    for li, layer in enumerate(layers):
        if not isinstance(layer, dict):
            raise TypeError("layers[%d] must be a dict, got %s" % (li, type(layer).__name__))
        extra = set(layer) - {"experts", "gate_up_proj", "down_proj"}
        if extra:
            raise ValueError("layers[%d]: %s cannot be stored in format v1 (experts only)" % (li, sorted(extra)))
        triples = _expert_triples(layer, "layers[%d]" % li)
        g0 = A.shape_of(triples[0][0])
        if len(g0) != 2:
            raise ValueError("layers[%d]: expert gate weights must be 2-D [d_ff, d_model]" % li)
        if E is None:
            E, (F, D) = len(triples), g0
        elif (len(triples), g0) != (E, (F, D)):
            raise ValueError("layers[%d]: shape differs from layer 0" % li)
        folder = os.path.join(path, "layer_%02d" % li) if len(layers) > 1 else path
        os.makedirs(folder, exist_ok=True)
        for e, (g, u, d) in enumerate(triples):
            where = "layers[%d] expert %d" % (li, e)
            with open(os.path.join(folder, "expert_%02d.bin" % e), "wb") as f:
                for arr, name, shape in ((g, "gate", (F, D)), (u, "up", (F, D)), (d, "down", (D, F))):
                    buf = A.as_weight(arr, dtype, "%s %s" % (where, name), shape)
                    if A.kind_of(buf, name) == A.TORCH:
                        buf = buf.view(__import__("torch").int16).numpy() if dtype != "f32" else buf.numpy()
                    f.write(np.ascontiguousarray(buf).astype(buf.dtype.newbyteorder("<"), copy=False).tobytes())
    manifest = {"format": "colibri-moe", "version": 1, "n_layers": len(layers), "n_experts": E, "d_model": D,
                "d_ff": F, "dtype": dtype, "activation": "swiglu"}
    with open(os.path.join(path, "colibri.json"), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    return path
