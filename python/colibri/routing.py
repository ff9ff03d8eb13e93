"""Routing to and from Colibri's formats (docs/FORMAT.md).

- export_routing(logits or (ids, weights), path): writes `.route` text, the
  format the CLI (`colibri infer --routing`, `colibri route compile`) reads.
- compile_routing(text or (ids, weights) or logits, n_experts): routing.bin
  bytes in memory (colibri_route_compile), for Model.infer(routing=...) or to
  write to a file.
- load_routing(path or bytes): (ids, weights) back from either form
  (colibri_routing_load / colibri_routing_decode).

Routing traces (`.ctrace`, docs/FORMAT.md), the input of the expert-cache
studies (experts on disk, a resident cache, prefetch):

- RoutingTrace: the experts every MoE layer call used, in call order;
  save(path) / RoutingTrace.load(path).
- record_trace(model): a context manager recording a transformers model's
  routing (hooks on every MoE block's router).
- synthetic_trace(...): a generated trace with skewed popularity, layer to
  layer correlation and temporal locality.
- simulate_cache(trace, capacity, policy): hits and misses of one expert
  cache shared by all layers (policies "lru", "freq", "belady");
  trace_working_set(trace).

Everything is vectorised with NumPy; torch tensors are accepted wherever an
array is (read through .detach().cpu().numpy()).
"""

import contextlib
import ctypes
import math
import os
import struct
import sys
import tempfile
from collections import OrderedDict

import numpy as np

from . import _lib as L

__all__ = ["export_routing", "compile_routing", "compile_routing_file", "load_routing", "topk_routing",
           "routing_text", "RoutingTrace", "record_trace", "synthetic_trace", "simulate_cache", "trace_working_set"]

_MAX_TOKENS = 1 << 28
_MAX_EXPERTS = 65536


def _write_atomic(path, data, prefix):
    """data to `path` through a temporary file in the same folder and a
    rename, so a failure leaves no partial file."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _to_numpy(obj, name):
    if isinstance(obj, np.ndarray):
        return obj
    t = sys.modules.get("torch")
    if t is not None and isinstance(obj, t.Tensor):
        obj = obj.detach().cpu()
        if obj.dtype == t.bfloat16 or obj.dtype == t.float16:
            obj = obj.float()
        return obj.numpy()
    if isinstance(obj, (list, tuple)):
        return np.asarray(obj)
    raise TypeError("%s must be a numpy.ndarray or a torch.Tensor, got %s" % (name, type(obj).__name__))


def topk_routing(logits, k, renormalize=True, scoring="softmax"):
    """Top-k routing from router logits [T, E]: scores = softmax over the
    experts (in float64; or scoring='sigmoid'), the k best per token (ties go
    to the lower expert index, as in Colibri's built-in router), weights
    renormalised to sum 1 when `renormalize`. Returns (ids int32 [T, k],
    weights float32 [T, k]), ids in descending score order."""
    x = _to_numpy(logits, "logits")
    if x.ndim != 2:
        raise ValueError("router logits must be 2-D [T, n_experts], got shape %s" % list(x.shape))
    if x.dtype.kind != "f":
        raise TypeError("router logits must be floating point, got %s" % x.dtype)
    T, E = x.shape
    if k is None:
        raise ValueError("k (experts per token) is required with router logits")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= int(k) <= E:
        raise ValueError("k must be an int in [1, %d] (the logits' experts), got %r" % (E, k))
    k = int(k)
    x = x.astype(np.float64)
    if not np.isfinite(x).all():
        raise ValueError("router logits hold non-finite values")
    if scoring == "softmax":
        p = np.exp(x - x.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
    elif scoring == "sigmoid":
        p = 1.0 / (1.0 + np.exp(-x))
    else:
        raise ValueError("scoring must be 'softmax' or 'sigmoid', got %r" % (scoring,))
    # Stable sort of -p: equal scores keep index order, so ties go to the lower id.
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, axis=1)
    if renormalize:
        w = w / w.sum(axis=1, keepdims=True)
    return ids.astype(np.int32), w.astype(np.float32)


def _topk_pair(obj, k, n_experts):
    """Validates an (ids, weights) pair; returns int64 ids and float32 weights."""
    if len(obj) != 2:
        raise ValueError("expected (ids, weights), got a sequence of %d items" % len(obj))
    ids = _to_numpy(obj[0], "ids")
    w = _to_numpy(obj[1], "weights")
    if ids.ndim != 2:
        raise ValueError("ids must be 2-D [T, k], got shape %s" % list(ids.shape))
    if ids.dtype.kind not in "iu":
        raise TypeError("ids must be integers, got %s" % ids.dtype)
    if w.shape != ids.shape:
        raise ValueError("weights must have ids' shape %s, got %s" % (list(ids.shape), list(w.shape)))
    if w.dtype.kind != "f":
        raise TypeError("weights must be floating point, got %s" % w.dtype)
    T, kk = ids.shape
    if k is not None and k != kk:
        raise ValueError("k=%r but ids have %d columns" % (k, kk))
    if T == 0 or kk == 0:
        raise ValueError("a routing needs at least one token and k >= 1, got ids of shape %s" % list(ids.shape))
    ids = ids.astype(np.int64)
    if ids.min() < 0:
        t, j = np.argwhere(ids < 0)[0]
        raise ValueError("token %d: expert id %d in slot %d; .route files hold only real experts (no -1)"
                         % (t, ids[t, j], j))
    if n_experts is not None and ids.max() >= n_experts:
        t, j = np.argwhere(ids >= n_experts)[0]
        raise ValueError("token %d: expert id %d out of range [0, %d)" % (t, ids[t, j], n_experts))
    if kk > 1:
        s = np.sort(ids, axis=1)
        dup = (s[:, 1:] == s[:, :-1]).any(axis=1)
        if dup.any():
            t = int(np.argmax(dup))
            raise ValueError("token %d: expert ids %s repeat an expert" % (t, ids[t].tolist()))
    w = w.astype(np.float32)
    if not np.isfinite(w).all():
        t = int(np.argwhere(~np.isfinite(w))[0][0])
        raise ValueError("token %d: weights %s are not all finite" % (t, w[t].tolist()))
    return ids, w


def _as_topk(obj, k, renormalize, n_experts, scoring="softmax"):
    # A tuple is an (ids, weights) pair; so is a 2-list of arrays. Anything
    # else (an array, a tensor, a nested list) is router logits.
    if isinstance(obj, tuple) or (isinstance(obj, list) and len(obj) == 2 and not isinstance(obj[0], list)
                                  and hasattr(obj[0], "shape")):
        return _topk_pair(obj, k, n_experts)
    ids, w = topk_routing(obj, k, renormalize, scoring)
    return _topk_pair((ids, w), k, n_experts)


def routing_text(ids, weights, header=True, rows_per_chunk=65536):
    """.route text (str) for ids [T, k] and weights [T, k]: one line per token
    in token order, `t, e_1, ..., e_k, w_1, ..., w_k`, weights with 9
    significant digits (float32 round-trips exactly)."""
    ids, w = _topk_pair((ids, weights), None, None)
    T, k = ids.shape
    parts = []
    if header:
        parts.append("# colibri routing: %d tokens, k = %d; token, %d expert ids, %d weights\n" % (T, k, k, k))
    line = ", ".join(["%d"] * (1 + k) + ["%.9g"] * k) + "\n"
    w64 = w.astype(np.float64)
    for start in range(0, T, rows_per_chunk):
        stop = min(T, start + rows_per_chunk)
        n = stop - start
        cols = np.empty((n, 1 + 2 * k), dtype=object)
        cols[:, 0] = np.arange(start, stop)
        cols[:, 1 : 1 + k] = ids[start:stop]
        cols[:, 1 + k :] = w64[start:stop]
        parts.append((line * n) % tuple(cols.ravel().tolist()))
    return "".join(parts)


def export_routing(router_logits_or_topk, path, k=None, renormalize=True, n_experts=None, scoring="softmax",
                   header=True):
    """Writes a `.route` file (docs/FORMAT.md) and returns (ids int32 [T, k],
    weights float32 [T, k]) as written.

    router_logits_or_topk: router logits [T, E] (then k is required: scores
    = softmax, or sigmoid with scoring='sigmoid', top-k, renormalised to sum 1
    if `renormalize`), or an (ids [T, k], weights [T, k]) pair, exported as
    given (any k; real weights; ids must be distinct experts >= 0, below
    n_experts when given). NumPy arrays or torch tensors. The file is written
    to a temporary name and renamed, so a failure leaves no partial file.
    """
    ids, w = _as_topk(router_logits_or_topk, k, renormalize, n_experts, scoring)
    if ids.shape[0] > _MAX_TOKENS:
        raise ValueError("%d tokens; a routing holds at most 2^28" % ids.shape[0])
    text = routing_text(ids, w, header=header)
    _write_atomic(path, text.encode("ascii"), ".route-")
    return ids.astype(np.int32), w


def _compile_options(n_experts, compact, q4_weights, f16_weights):
    if isinstance(n_experts, bool) or not isinstance(n_experts, (int, np.integer)):
        raise TypeError("n_experts must be an int, got %s" % type(n_experts).__name__)
    o = L.RouteCompileOptions()
    L.lib().colibri_route_compile_options_default(ctypes.byref(o))
    o.n_experts = int(n_experts)
    o.compact = 1 if compact else 0
    o.q4_weights = 1 if q4_weights else 0
    o.weight_encoding = L.ROUTE_WEIGHTS_F16 if f16_weights else L.ROUTE_WEIGHTS_F32
    return o


def compile_routing(text_or_topk, n_experts, k=None, renormalize=True, compact=False, q4_weights=False,
                    f16_weights=False, source_name="<routing>"):
    """routing.bin bytes (colibri_route_compile), in memory.

    text_or_topk: `.route` text (str or bytes), an (ids, weights) pair, or
    router logits [T, E] with k (as export_routing). Options as the CLI's
    `route compile`: compact (seed's 1 byte/token, E <= 4, k = 2),
    q4_weights (text weights are 4-bit codes q/15), f16_weights.
    Errors in the text raise ColibriError naming `source_name` and the line.
    """
    if isinstance(text_or_topk, str):
        data = text_or_topk.encode("utf-8")
    elif isinstance(text_or_topk, (bytes, bytearray, memoryview)):
        data = bytes(text_or_topk)
    else:
        ids, w = _as_topk(text_or_topk, k, renormalize, n_experts)
        data = routing_text(ids, w, header=False).encode("ascii")
    opts = _compile_options(n_experts, compact, q4_weights, f16_weights)
    blob = ctypes.c_void_p()
    size = ctypes.c_size_t()
    name = source_name.encode("utf-8") if source_name is not None else None
    st = L.lib().colibri_route_compile(ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p), len(data), name,
                                       ctypes.byref(opts), ctypes.byref(blob), ctypes.byref(size))
    L.check(st, "colibri_route_compile")
    try:
        return ctypes.string_at(blob, size.value) if size.value else b""
    finally:
        L.lib().colibri_buffer_free(blob)


def compile_routing_file(route_path, out_path, n_experts, compact=False, q4_weights=False, f16_weights=False):
    """Compiles a `.route` file to a routing.bin file (colibri_route_compile_file;
    no partial file on failure)."""
    opts = _compile_options(n_experts, compact, q4_weights, f16_weights)
    st = L.lib().colibri_route_compile_file(os.fsencode(os.fspath(route_path)), os.fsencode(os.fspath(out_path)),
                                            ctypes.byref(opts))
    L.check(st, "colibri_route_compile_file")


def load_routing(path_or_bytes, n_experts=0, q4_weights=False, source_name="<routing>"):
    """Reads a routing back: routing.bin bytes (colibri_routing_decode), or a
    file path, routing.bin or `.route` text (colibri_routing_load; text needs
    n_experts). Returns (ids int32 [T, k], weights float32 [T, k]), fresh
    NumPy arrays. If n_experts > 0, ids must lie below it."""
    r = ctypes.c_void_p()
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        data = bytes(path_or_bytes)
        st = L.lib().colibri_routing_decode(ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p), len(data),
                                            int(n_experts), source_name.encode("utf-8"), ctypes.byref(r))
        L.check(st, "colibri_routing_decode")
    elif isinstance(path_or_bytes, (str, os.PathLike)):
        st = L.lib().colibri_routing_load(os.fsencode(os.fspath(path_or_bytes)), int(n_experts),
                                          1 if q4_weights else 0, ctypes.byref(r))
        L.check(st, "colibri_routing_load")
    else:
        raise TypeError("load_routing takes a path or routing.bin bytes, got %s" % type(path_or_bytes).__name__)
    lib = L.lib()
    try:
        T = lib.colibri_routing_n_tokens(r)
        k = lib.colibri_routing_top_k(r)
        n = T * k
        ids = np.empty((T, k), dtype=np.int32)
        w = np.empty((T, k), dtype=np.float32)
        if n:
            ctypes.memmove(ids.ctypes.data, lib.colibri_routing_expert_ids(r), n * 4)
            ctypes.memmove(w.ctypes.data, lib.colibri_routing_expert_weights(r), n * 4)
    finally:
        lib.colibri_routing_free(r)
    return ids, w


# ---------------------------------------------------------------- routing traces

TRACE_MAGIC = b"CLBTRACE"
TRACE_VERSION = 1
_TRACE_HEADER = struct.Struct("<8sIIIIQ")  # magic, version, n_layers, n_experts, top_k, n_steps: 32 bytes
_TRACE_MAX_LAYERS = 4096
_TRACE_MAX_TOKENS = 1 << 28


def _check_header_fields(n_layers, n_experts, top_k, where):
    for name, v, hi in (("n_layers", n_layers, _TRACE_MAX_LAYERS), ("n_experts", n_experts, _MAX_EXPERTS)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError("%s%s must be an int, got %s" % (where, name, type(v).__name__))
        if not 1 <= int(v) <= hi:
            raise ValueError("%s%s %d out of range [1, %d]" % (where, name, v, hi))
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
        raise TypeError("%stop_k must be an int, got %s" % (where, type(top_k).__name__))
    if not 1 <= int(top_k) <= int(n_experts):
        raise ValueError("%stop_k %d out of range [1, n_experts = %d]" % (where, top_k, n_experts))


class RoutingTrace:
    """The experts a model's MoE layers used, one record ("step") per call
    of one layer, in call order: for a decoder, token 0 layers 0..L-1, token
    1 layers 0..L-1, ...; a prefill is one record per layer holding all its
    tokens.

    Attributes: n_layers, n_experts, top_k, and steps, a list of (layer int,
    ids np.int32 [n_tokens, top_k]); -1 marks an empty slot. Ids lie in
    [-1, n_experts), layers in [0, n_layers). `steps` may be edited directly;
    save() (and validate()) check everything.

    File format (`.ctrace`, little-endian; docs/FORMAT.md): a 32-byte header
    (magic b"CLBTRACE", u32 version 1, u32 n_layers, u32 n_experts, u32
    top_k, u64 n_steps), then per step u32 layer, u32 n_tokens and
    n_tokens * top_k int32 ids, row-major [token][slot].
    """

    def __init__(self, n_layers, n_experts, top_k, steps=None):
        _check_header_fields(n_layers, n_experts, top_k, "")
        self.n_layers = int(n_layers)
        self.n_experts = int(n_experts)
        self.top_k = int(top_k)
        self.steps = []
        for layer, ids in steps or ():
            self.append(layer, ids)

    # -- building and checking

    def _step_problem(self, layer, ids):
        """(layer int, ids int32 [n, k]) or raises ValueError/TypeError
        without a step prefix."""
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError("layer must be an int, got %s" % type(layer).__name__)
        layer = int(layer)
        if not 0 <= layer < self.n_layers:
            raise ValueError("layer %d out of range [0, %d)" % (layer, self.n_layers))
        a = _to_numpy(ids, "ids")
        if a.ndim == 1 and a.shape[0] == self.top_k:
            a = a.reshape(1, self.top_k)
        if a.ndim != 2 or a.shape[1] != self.top_k:
            raise ValueError("ids must be [n_tokens, top_k = %d], got shape %s" % (self.top_k, list(a.shape)))
        if a.dtype.kind not in "iu":
            raise TypeError("ids must be integers, got %s" % a.dtype)
        if a.shape[0] > _TRACE_MAX_TOKENS:
            raise ValueError("n_tokens %d out of range [0, 2^28]" % a.shape[0])
        if a.size:
            bad = (a < -1) | (a >= self.n_experts)
            if bad.any():
                t, j = np.argwhere(bad)[0]
                raise ValueError("token %d, slot %d: expert id %d out of range [-1, %d)"
                                 % (t, j, a[t, j], self.n_experts))
        return layer, a

    def append(self, layer, ids):
        """Appends one record: layer, ids [n_tokens, top_k] (or [top_k] for
        one token); ids are copied to int32."""
        try:
            layer, a = self._step_problem(layer, ids)
        except (ValueError, TypeError) as e:
            raise type(e)("step %d: %s" % (len(self.steps), e)) from None
        self.steps.append((layer, np.array(a, dtype=np.int32, order="C", copy=True)))

    def validate(self):
        """Checks every step (as append does); ValueError/TypeError naming the step."""
        _check_header_fields(self.n_layers, self.n_experts, self.top_k, "")
        for i, (layer, ids) in enumerate(self.steps):
            try:
                self._step_problem(layer, ids)
            except (ValueError, TypeError) as e:
                raise type(e)("step %d: %s" % (i, e)) from None

    def __len__(self):
        return len(self.steps)

    def __iter__(self):
        return iter(self.steps)

    def __repr__(self):
        return "RoutingTrace(n_layers=%d, n_experts=%d, top_k=%d, steps=%d)" % (
            self.n_layers, self.n_experts, self.top_k, len(self.steps))

    def n_tokens(self):
        """Tokens over all records."""
        return sum(int(ids.shape[0]) for _, ids in self.steps)

    def total_lookups(self):
        """Cache lookups the trace makes: the number of distinct experts
        (-1 ignored) of each record, summed over the records (what
        simulate_cache's `lookups` counts)."""
        return int(_lookup_sequence(self)[0].shape[0])

    # -- bytes and files

    def to_bytes(self):
        """The `.ctrace` bytes."""
        self.validate()
        parts = [_TRACE_HEADER.pack(TRACE_MAGIC, TRACE_VERSION, self.n_layers, self.n_experts, self.top_k,
                                    len(self.steps))]
        rec = struct.Struct("<II")
        for layer, ids in self.steps:
            ids = np.asarray(ids)
            parts.append(rec.pack(int(layer), int(ids.shape[0])))
            parts.append(np.ascontiguousarray(ids, dtype="<i4").tobytes())
        return b"".join(parts)

    def save(self, path):
        """Writes the trace to `path` (a temporary name, then renamed, so a
        failure leaves no partial file)."""
        _write_atomic(path, self.to_bytes(), ".ctrace-")

    @classmethod
    def load(cls, path):
        """Reads a `.ctrace` file; every problem is a ValueError starting
        with the path (`trace.ctrace: step 12: layer 9 out of range [0, 4)`)."""
        path = os.fspath(path)
        with open(path, "rb") as f:
            data = f.read()
        return cls.from_bytes(data, name=path)

    @classmethod
    def from_bytes(cls, data, name="<trace>"):
        """Parses `.ctrace` bytes (as load; errors start with `name`)."""
        data = bytes(data)
        name = os.fsdecode(name) if isinstance(name, bytes) else str(name)

        def fail(msg):
            raise ValueError("%s: %s" % (name, msg))

        H = _TRACE_HEADER.size
        if len(data) < H:
            if len(data) >= 8 and data[:8] != TRACE_MAGIC:
                fail("not a routing trace: bad magic %r (expected %r)" % (data[:8], TRACE_MAGIC))
            fail("truncated header: %d of %d bytes" % (len(data), H))
        magic, version, n_layers, n_experts, top_k, n_steps = _TRACE_HEADER.unpack_from(data, 0)
        if magic != TRACE_MAGIC:
            fail("not a routing trace: bad magic %r (expected %r)" % (magic, TRACE_MAGIC))
        if version != TRACE_VERSION:
            fail("unsupported version %d (expected %d)" % (version, TRACE_VERSION))
        try:
            _check_header_fields(n_layers, n_experts, top_k, "header: ")
        except ValueError as e:
            fail(str(e))
        # Every record is a whole number of 4-byte words after the 32-byte
        # header, so the body is read as one u32/i32 array.
        body_bytes = len(data) - H
        nwords = body_bytes // 4
        u = np.frombuffer(data, dtype="<u4", count=nwords, offset=H)
        k = top_k
        starts, counts = [], []
        problem = None  # (step, message) of the first structural problem
        p = 0
        step = 0
        while step < n_steps:
            if p + 2 > nwords:
                left = body_bytes - 4 * p
                problem = (step, "truncated record header: %d of 8 bytes" % left)
                break
            layer, n = int(u[p]), int(u[p + 1])
            if layer >= n_layers:
                if problem is None:
                    problem = (step, "layer %d out of range [0, %d)" % (layer, n_layers))
            if n > _TRACE_MAX_TOKENS:
                problem = problem or (step, "n_tokens %d out of range [0, 2^28]" % n)
                break
            need = n * k
            if p + 2 + need > nwords:
                left = body_bytes - 4 * (p + 2)
                problem = problem or (step, "truncated record: n_tokens %d needs %d bytes of expert ids, %d left"
                                      % (n, 4 * need, left))
                break
            starts.append(p)
            counts.append(n)
            p += 2 + need
            step += 1
        end = p
        starts = np.asarray(starts, dtype=np.int64)
        counts = np.asarray(counts, dtype=np.int64)
        words = np.frombuffer(data, dtype="<i4", count=nwords, offset=H)
        mask = np.ones(end, dtype=bool)
        mask[starts] = False
        mask[starts + 1] = False
        ids_all = words[:end][mask].astype(np.int32)
        bad = (ids_all < -1) | (ids_all >= n_experts)
        if bad.any():
            i = int(np.argmax(bad))
            offsets = np.concatenate([[0], np.cumsum(counts * k)])
            s = int(np.searchsorted(offsets, i, side="right") - 1)
            if problem is None or s < problem[0]:
                r = i - int(offsets[s])
                problem = (s, "token %d, slot %d: expert id %d out of range [-1, %d)"
                           % (r // k, r % k, ids_all[i], n_experts))
        if problem is not None:
            fail("step %d: %s" % problem)
        if end * 4 != body_bytes:
            fail("%d trailing bytes after the last step (n_steps = %d)" % (body_bytes - end * 4, n_steps))
        trace = cls(n_layers, n_experts, top_k)
        layers = u[starts].tolist()
        o = 0
        for layer, n in zip(layers, counts.tolist()):
            trace.steps.append((layer, ids_all[o:o + n * k].reshape(n, k)))
            o += n * k
        return trace


def _lookup_sequence(trace):
    """The lookups simulate_cache makes, in order: (record index, layer,
    expert) int64 arrays; per record its distinct experts (-1 dropped) in
    ascending id order."""
    E = int(trace.n_experts)
    steps = trace.steps
    if not steps:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    sizes = np.fromiter((np.asarray(ids).size for _, ids in steps), dtype=np.int64, count=len(steps))
    layers = np.fromiter((int(layer) for layer, _ in steps), dtype=np.int64, count=len(steps))
    flat = np.concatenate([np.asarray(ids, dtype=np.int64).ravel() for _, ids in steps])
    rec = np.repeat(np.arange(len(steps), dtype=np.int64), sizes)
    keep = flat >= 0
    # Sorting record * E + expert orders by record, then by expert id.
    u = np.unique(rec[keep] * E + flat[keep])
    r = u // E
    return r, layers[r], u % E


def trace_working_set(trace):
    """The distinct (layer, expert) keys of a trace and how many lookups
    each gets (one per record using it): a dict {(layer, expert): count},
    in ascending key order. len() of it is the number of compulsory misses
    of any cache."""
    _, layer, expert = _lookup_sequence(trace)
    if layer.size == 0:
        return {}
    keys, counts = np.unique(layer * trace.n_experts + expert, return_counts=True)
    E = trace.n_experts
    return {(int(k // E), int(k % E)): int(c) for k, c in zip(keys.tolist(), counts.tolist())}


_POLICIES = ("lru", "freq", "belady")


def simulate_cache(trace, capacity, policy="freq", half_life=None):
    """Simulates one expert cache, shared by all layers, holding at most
    `capacity` experts, keyed by (layer, expert), on a RoutingTrace.
    Returns {"hits", "misses", "hit_rate" (hits / lookups, 0.0 for none),
    "lookups"}; the cache starts empty.

    Lookups: records are processed in order; a record looks up its distinct
    experts (-1 ignored, duplicates within the record counted once) in
    ascending expert id order. Its lookups are split into waves of
    `capacity` consecutive lookups (all of them in one wave when they fit);
    while a wave is processed all of its keys are pinned, resident or not
    yet: a miss never evicts a member of the current wave (there is always
    an unpinned resident when the cache is full, as the wave's missing key
    is not resident). A hit changes no residency; a miss inserts the key,
    first evicting one victim if `capacity` keys are resident.

    A global clock `now` starts at 0 and is incremented by 1 at every lookup
    (hit or miss), before anything else about that lookup, so the first
    lookup has now = 1.

    policy "lru": the victim is the unpinned resident key with the oldest
      (smallest) time of last access (each access time is unique).
    policy "freq" (decayed frequency), half-life H = half_life, or
      4 * capacity when None: every key ever looked up keeps (score, last),
      also after eviction. At a lookup of key x at time now: if the lookup
      is a miss with the cache full, the victim is chosen first: the
      unpinned resident key with the smallest decayed score
      score * 0.5 ** ((now - last) / H), ties broken by smaller last, then
      by smaller (layer, expert). Then x is scored: score = 1 if x was never
      seen, else score * 0.5 ** ((now - last) / H) + 1; last = now.
      Arithmetic is IEEE double: (now - last) / H is the integer difference
      converted to double divided by H as a double, and the power is C's
      pow(0.5, that) (Python's float ** is pow()).
    policy "belady" (offline optimal reference): the victim is the unpinned
      resident key whose next lookup (in the lookup order above) is
      furthest in the future, never being furthest of all; ties (keys never
      looked up again) broken by smaller (layer, expert).
    """
    if not isinstance(trace, RoutingTrace):
        raise TypeError("simulate_cache takes a RoutingTrace, got %s" % type(trace).__name__)
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ValueError("capacity must be an int >= 1, got %r" % (capacity,))
    capacity = int(capacity)
    if policy not in _POLICIES:
        raise ValueError("policy must be one of %s, got %r" % (", ".join(_POLICIES), policy))
    if half_life is None:
        H = float(4 * capacity)
    else:
        if isinstance(half_life, bool) or not isinstance(half_life, (int, float, np.integer, np.floating)) \
                or not math.isfinite(half_life) or not half_life > 0:
            raise ValueError("half_life must be a positive finite number, got %r" % (half_life,))
        H = float(half_life)
    rec, layer, expert = _lookup_sequence(trace)
    n = int(rec.shape[0])
    keys = (layer * trace.n_experts + expert).tolist()  # ordering of keys = ordering of (layer, expert)
    # Waves: runs of at most `capacity` lookups within one record.
    bounds = np.flatnonzero(np.diff(rec)) + 1 if n else np.zeros(0, dtype=np.int64)
    rec_starts = [0] + bounds.tolist()
    rec_ends = bounds.tolist() + [n]
    waves = []
    for a, b in zip(rec_starts, rec_ends):
        for w in range(a, b, capacity):
            waves.append((w, min(b, w + capacity)))
    if n == 0:
        waves = []

    hits = 0
    if policy == "lru":
        res = OrderedDict()  # resident keys, oldest access first
        for a, b in waves:
            pinned = set(keys[a:b])
            for x in keys[a:b]:
                if x in res:
                    hits += 1
                    res.move_to_end(x)
                    continue
                if len(res) >= capacity:
                    for y in res:
                        if y not in pinned:
                            break
                    del res[y]
                res[x] = None
    elif policy == "freq":
        score, last = {}, {}
        res = set()
        now = 0
        pw = math.pow
        for a, b in waves:
            pinned = set(keys[a:b])
            for x in keys[a:b]:
                now += 1
                if x in res:
                    hits += 1
                else:
                    if len(res) >= capacity:
                        best = None
                        for y in res:
                            if y in pinned:
                                continue
                            ly = last[y]
                            c = (score[y] * pw(0.5, (now - ly) / H), ly, y)
                            if best is None or c < best:
                                best = c
                        res.discard(best[2])
                    res.add(x)
                lx = last.get(x)
                score[x] = 1.0 if lx is None else score[x] * pw(0.5, (now - lx) / H) + 1.0
                last[x] = now
    else:  # belady
        karr = np.asarray(keys, dtype=np.int64)
        nxt = np.full(n, n, dtype=np.int64)  # n = never again
        if n:
            order = np.argsort(karr, kind="stable")
            same = karr[order[1:]] == karr[order[:-1]]
            nxt[order[:-1][same]] = order[1:][same]
        nxt = nxt.tolist()
        res = {}  # key -> position of its next lookup
        i = 0
        for a, b in waves:
            pinned = set(keys[a:b])
            for i in range(a, b):
                x = keys[i]
                if x in res:
                    hits += 1
                elif len(res) >= capacity:
                    best = None
                    for y, ny in res.items():
                        if y in pinned:
                            continue
                        c = (-ny, y)
                        if best is None or c < best:
                            best = c
                    del res[best[1]]
                res[x] = nxt[i]
    return {"hits": hits, "misses": n - hits, "hit_rate": (hits / n) if n else 0.0, "lookups": n}


# ------------------------------------------------------------ synthetic traces


def _check_prob(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not 0.0 <= v <= 1.0:
        raise ValueError("%s must be a probability in [0, 1], got %r" % (name, v))
    return float(v)


def _check_count(name, v, lo=0):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ValueError("%s must be an int >= %d, got %r" % (name, lo, v))
    return int(v)


def synthetic_trace(n_layers, n_experts, top_k, n_steps_tokens, *, prefill_tokens=0, skew=1.0, layer_corr=0.6,
                    temporal=0.3, seed=0):
    """A generated RoutingTrace: `n_steps_tokens` decode tokens, one record
    per layer per token (n_tokens = 1), in decoder order, optionally
    preceded by a prefill of `prefill_tokens` tokens (one record per layer,
    layers 0..L-1, each holding all the prefill tokens).

    The model (all randomness from np.random.default_rng(seed), so a seed
    gives the same trace):
    - popularity: layer l ranks the experts by a random permutation; the
      expert of rank r (0-based) has probability proportional to
      (r + 1) ** -skew (skew 0 = uniform).
    - successor maps: for each l < L-1 a fixed random permutation succ_l of
      the experts (the layer-(l+1) expert that co-activates with a layer-l one).
    - each token (the prefill tokens, then the decode tokens, in order)
      chooses k distinct experts per layer, layer by layer, slot by slot.
      For each slot: with probability layer_corr (layers l > 0) the expert
      is succ_{l-1}(e) for e uniformly one of the token's layer-(l-1)
      experts whose successor is not chosen yet; otherwise, with
      probability temporal (tokens after the first), it is uniformly one of
      the previous token's experts at the same layer not chosen yet;
      otherwise (or when that candidate list is empty) it is drawn from the
      layer's popularity among the experts not chosen yet. So a slot
      follows the layer before with probability layer_corr and repeats the
      previous token with probability (1 - layer_corr) * temporal.
    """
    _check_header_fields(n_layers, n_experts, top_k, "")
    L, E, k = int(n_layers), int(n_experts), int(top_k)
    N = _check_count("n_steps_tokens", n_steps_tokens)
    P = _check_count("prefill_tokens", prefill_tokens)
    if P > _TRACE_MAX_TOKENS:
        raise ValueError("prefill_tokens %d above 2^28" % P)
    if isinstance(skew, bool) or not isinstance(skew, (int, float, np.integer, np.floating)) \
            or not math.isfinite(skew) or skew < 0:
        raise ValueError("skew must be a finite number >= 0, got %r" % (skew,))
    layer_corr = _check_prob("layer_corr", layer_corr)
    temporal = _check_prob("temporal", temporal)
    rng = np.random.default_rng(seed)

    weights = np.arange(1, E + 1, dtype=np.float64) ** -float(skew)
    weights /= weights.sum()
    pop = np.empty((L, E), dtype=np.float64)
    for l in range(L):
        pop[l, rng.permutation(E)] = weights
    succ = [rng.permutation(E).tolist() for _ in range(L - 1)]
    cdf = np.cumsum(pop, axis=1)
    cdf[:, -1] = 1.0

    T = P + N
    out = np.empty((T, L, k), dtype=np.int32)
    CHUNK, A = 256, 4  # tokens whose random numbers are drawn at once; popularity draws per slot
    prev = None  # the previous token's [L][k] choices
    for c0 in range(0, T, CHUNK):
        m = min(T, c0 + CHUNK) - c0
        u_corr = rng.random((m, L, k)).tolist()
        u_temp = rng.random((m, L, k)).tolist()
        src = rng.random((m, L, k)).tolist()  # which candidate, as a fraction of the candidate list
        ur = rng.random((m, L, k, A))
        draws = np.empty((m, L, k, A), dtype=np.int64)
        for l in range(L):
            draws[:, l] = np.searchsorted(cdf[l], ur[:, l], side="right")
        draws = np.minimum(draws, E - 1).tolist()
        for i in range(m):
            t = c0 + i
            cur = []
            for l in range(L):
                chosen = []
                uc, ut, sr, dr = u_corr[i][l], u_temp[i][l], src[i][l], draws[i][l]
                for j in range(k):
                    cand, cands = -1, None
                    if l > 0 and uc[j] < layer_corr:
                        sl = succ[l - 1]
                        cands = [sl[e] for e in cur[l - 1] if sl[e] not in chosen]
                    elif t > 0 and ut[j] < temporal:
                        cands = [e for e in prev[l] if e not in chosen]
                    if cands:
                        cand = cands[int(sr[j] * len(cands))]
                    else:
                        for d in dr[j]:
                            if d not in chosen:
                                cand = d
                                break
                        if cand < 0:
                            p = pop[l].copy()
                            p[chosen] = 0.0
                            s = p.sum()
                            if s > 0:
                                cand = int(rng.choice(E, p=p / s))
                            else:  # popularity underflowed to 0 outside the chosen ones: uniform
                                rest = np.setdiff1d(np.arange(E), chosen)
                                cand = int(rest[rng.integers(0, rest.shape[0])])
                    chosen.append(cand)
                cur.append(chosen)
            out[t] = cur
            prev = cur

    trace = RoutingTrace(L, E, k)
    if P:
        for l in range(L):
            trace.steps.append((l, np.ascontiguousarray(out[:P, l, :])))
    for t in range(P, T):
        for l in range(L):
            trace.steps.append((l, out[t, l:l + 1, :]))
    return trace


# ------------------------------------------------- recording a transformers model


class _Recorded:
    """How one MoE block's routing is read: the module hooked, and the rule
    turning its output into top-k ids."""

    def __init__(self, path, block, router, family, n_experts, top_k, spec):
        self.path, self.block, self.router = path, block, router
        self.family, self.n_experts, self.top_k, self.spec = family, n_experts, top_k, spec


def _routing_only_spec(block, ct):
    """For a block colibri.torch cannot run (its experts), what its router
    alone says: (family, router module, n_experts, top_k, spec or None), or
    why not."""
    import torch

    if getattr(block, "gate", None) is not None:
        gate = block.gate
        w = getattr(gate, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            return "its .gate has no 2-D weight [n_experts, d_model]"
        E, D = w.shape
        rule = ct._fused_router_rule(block, E, D)
        if isinstance(rule, str):
            return rule
        spec = ct._spec_from_rule(rule, layout="unknown", n_experts=E, d_model=D, d_ff=0, experts=None)
        return rule.family, gate, E, rule.top_k, spec
    router = getattr(block, "router", None)
    if router is not None:
        w = getattr(router, "weight", None)
        top_k = ct._int_attr(router, "top_k")
        if not isinstance(w, torch.Tensor) or w.dim() != 2 or top_k is None or not 1 <= top_k <= w.shape[0]:
            return "its .router has no 2-D weight [n_experts, d_model] and top_k"
        return "gpt_oss", router, int(w.shape[0]), top_k, None
    return "no .gate or .router module"


def _moe_blocks(model):
    """[_Recorded] for every MoE block (module with .experts) of the model,
    in module order; ValueError naming a block whose routing is unknown."""
    from . import torch as ct

    found = []
    for path, block in model.named_modules():
        experts = getattr(block, "experts", None)
        if experts is None:
            continue
        where = "%s (%s)" % (path or "<root>", type(block).__name__)
        state = block.__dict__.get("_colibri_state") or getattr(experts, "__dict__", {}).get("_colibri_state")
        spec = state.spec if state is not None else ct.recognise(block)
        if not isinstance(spec, str):
            router = block.router if spec.family == "gpt_oss" else getattr(block, "gate", None)
            if router is None:
                raise ValueError("record_trace: MoE block %s, family %s, has no router module to hook"
                                 % (where, spec.family))
            found.append(_Recorded(path, block, router, spec.family, int(spec.n_experts), spec.top_k, spec))
            continue
        alt = _routing_only_spec(block, ct)
        if isinstance(alt, str):
            raise ValueError("record_trace: cannot record the MoE block %s: not a recognised family (%s), and "
                             "its router is not a known kind (%s)" % (where, spec, alt))
        family, router, E, top_k, rspec = alt
        found.append(_Recorded(path, block, router, family, E, top_k, rspec))
    return found


def _ids_from_router_output(rb, output):
    """Top-k ids [N, k] (a torch tensor) from the router module's output:
    the one integer tensor it returns (the ids the block routes with), or,
    for a router returning bare logits, the family's top-k rule as the
    block applies it."""
    import torch
    import torch.nn.functional as F

    if isinstance(output, (tuple, list)):
        ints = [o for o in output if isinstance(o, torch.Tensor) and not o.is_floating_point()
                and not o.is_complex() and o.dtype != torch.bool]
        if len(ints) != 1:
            raise RuntimeError("record_trace: the router of MoE block %s (family %s) returned %d integer tensors; "
                               "expected exactly one (its top-k expert ids)" % (rb.path or "<root>", rb.family,
                                                                             len(ints)))
        return ints[0]
    if not isinstance(output, torch.Tensor) or not output.is_floating_point():
        raise RuntimeError("record_trace: the router of MoE block %s (family %s) returned %s, neither top-k ids "
                           "nor logits" % (rb.path or "<root>", rb.family, type(output).__name__))
    logits = output.detach().reshape(-1, output.shape[-1])
    with torch.no_grad():
        if rb.family in ("deepseek_v2", "deepseek_v3") and rb.spec is not None:
            if hasattr(rb.block, "route_tokens_to_experts"):
                return rb.block.route_tokens_to_experts(output)[0]
            from . import torch as ct
            return ct._route_deepseek(rb.spec, rb.router, logits)[0]
        if rb.family == "gpt_oss":
            return torch.topk(logits, rb.top_k, dim=-1)[1]
        if rb.family in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe") and rb.top_k:
            # The blocks' own rule: softmax over the experts in float32, torch.topk.
            probs = F.softmax(logits, dim=1, dtype=torch.float)
            return torch.topk(probs, rb.top_k, dim=-1)[1]
    raise RuntimeError("record_trace: MoE block %s (family %s): its router returns bare logits and the top-k rule "
                       "of this family is not known" % (rb.path or "<root>", rb.family))


@contextlib.contextmanager
def record_trace(model, n_experts=None, top_k=None):
    """Records the routing of a transformers model:

        with colibri.routing.record_trace(model) as trace:
            model.generate(input_ids, max_new_tokens=64)
        trace.save("model.ctrace")

    Every MoE block (a module with .experts that colibri.torch recognises:
    Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3-Next, OLMoE, DeepSeek-V2/V3,
    GLM-4-MoE, gpt-oss, in transformers 4.57 and 5.x, also after
    colibri.torch.accelerate) gets a forward hook on its router module
    (.gate, or gpt-oss's .router); each call appends one record (layer, ids
    [tokens, top_k]) to the yielded RoutingTrace, in call order. Layer =
    the block's position among the model's MoE blocks (0..L-1, module
    order). The ids are exactly the ones the block routes with: the id
    tensor the router returns, or, for routers returning bare logits (4.57's
    Mixtral/Qwen/OLMoE blocks), the block's own rule (softmax in float32,
    torch.topk). All tokens of a call are recorded (a batch's rows, padding
    included), row-major as the block flattens them. Ids transformers marks
    as "no expert" (>= the block's expert count) are recorded as -1.

    n_experts / top_k: the trace's (default: the largest of the blocks'; a
    given value must be at least that); a block with a smaller top_k fills
    its remaining slots with -1. A block that cannot be recorded raises
    ValueError naming it. The hooks are removed on exit, also on exceptions.
    """
    import torch.nn as nn

    if not isinstance(model, nn.Module):
        raise TypeError("record_trace takes a torch.nn.Module, got %s" % type(model).__name__)
    blocks = _moe_blocks(model)
    if not blocks:
        raise ValueError("record_trace: no MoE blocks (modules with .experts) in %s" % type(model).__name__)
    missing = [b for b in blocks if not b.top_k]
    if missing and top_k is None:
        raise ValueError("record_trace: MoE block %s (family %s) has no known top_k; pass top_k="
                         % (missing[0].path or "<root>", missing[0].family))
    model_e = max(b.n_experts for b in blocks)
    model_k = max(b.top_k or 0 for b in blocks)
    if n_experts is None:
        n_experts = model_e
    elif isinstance(n_experts, bool) or not isinstance(n_experts, (int, np.integer)) or n_experts < model_e:
        raise ValueError("record_trace: n_experts=%r, but the model's blocks have up to %d experts"
                         % (n_experts, model_e))
    if top_k is None:
        top_k = model_k
    elif isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < model_k:
        raise ValueError("record_trace: top_k=%r, but the model's blocks route to up to %d experts"
                         % (top_k, model_k))
    trace = RoutingTrace(len(blocks), int(n_experts), int(top_k))
    K = trace.top_k

    def make_hook(layer, rb):
        def hook(module, inputs, output):
            ids = _ids_from_router_output(rb, output).detach()
            kk = ids.shape[-1] if ids.dim() else 1
            if kk > K:
                raise RuntimeError("record_trace: MoE block %s routed to %d experts per token, the trace holds %d"
                                   % (rb.path or "<root>", kk, K))
            a = ids.reshape(-1, kk).cpu().numpy().astype(np.int64)
            a[(a < 0) | (a >= rb.n_experts)] = -1
            if kk < K:
                a = np.concatenate([a, np.full((a.shape[0], K - kk), -1, dtype=np.int64)], axis=1)
            trace.steps.append((layer, np.ascontiguousarray(a, dtype=np.int32)))
        return hook

    def make_routed_hook(layer, rb, routed):
        # A block routed in Colibri (colibri.torch.from_pretrained on
        # transformers 5) never calls its router module: its ids come from
        # the same built-in router colibri_infer runs (colibri_route). The
        # hook on the block also keeps colibri.decode's direct step off, so
        # every decode step passes through it.
        cmodel, _, colibri_layer, d_model = routed[:4]

        def hook(module, inputs):
            x = inputs[0].detach().reshape(-1, d_model).float()
            ids, _ = cmodel.route(x.contiguous(), layer=colibri_layer)
            a = ids.reshape(-1, ids.shape[-1]).cpu().numpy().astype(np.int64)
            a[(a < 0) | (a >= rb.n_experts)] = -1
            if a.shape[1] < K:
                a = np.concatenate([a, np.full((a.shape[0], K - a.shape[1]), -1, dtype=np.int64)], axis=1)
            trace.steps.append((layer, np.ascontiguousarray(a, dtype=np.int32)))
        return hook

    handles = []
    try:
        for layer, rb in enumerate(blocks):
            routed = rb.block.__dict__.get("_colibri_routed")
            if routed is not None:
                handles.append(rb.block.register_forward_pre_hook(make_routed_hook(layer, rb, routed)))
            else:
                handles.append(rb.router.register_forward_hook(make_hook(layer, rb)))
        yield trace
    finally:
        for h in handles:
            h.remove()
