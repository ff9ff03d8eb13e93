"""Routing to and from Colibri's formats (docs/FORMAT.md).

- export_routing(logits or (ids, weights), path): writes `.route` text, the
  format the CLI (`colibri infer --routing`, `colibri route compile`) reads.
- compile_routing(text or (ids, weights) or logits, n_experts): routing.bin
  bytes in memory (colibri_route_compile), for Model.infer(routing=...) or to
  write to a file.
- load_routing(path or bytes): (ids, weights) back from either form
  (colibri_routing_load / colibri_routing_decode).

Everything is vectorised with NumPy; torch tensors are accepted wherever an
array is (read through .detach().cpu().numpy()).
"""

import ctypes
import os
import sys
import tempfile

import numpy as np

from . import _lib as L

__all__ = ["export_routing", "compile_routing", "compile_routing_file", "load_routing", "topk_routing",
           "routing_text"]

_MAX_TOKENS = 1 << 28
_MAX_EXPERTS = 65536


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
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".route-", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="ascii", newline="\n") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
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
