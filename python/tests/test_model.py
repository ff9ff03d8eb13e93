"""colibri.Model: opening, inspection, inference with NumPy and torch, zero
copy, and every bad-argument path."""

import ctypes
import gc
import os
import threading

import numpy as np
import pytest
import torch

import colibri
from colibri import _lib
from helpers import needs_v2, random_experts, rel_err, swiglu_reference

D = 32


def routing(rng, T, k=2, E=4):
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    w = rng.uniform(-0.5, 1.5, size=(T, k)).astype(np.float32)
    return ids, w


# ------------------------------------------------------------------ loading


def test_library_found_and_versioned():
    assert os.path.exists(colibri.library_path())
    assert colibri.library_version().count(".") == 2
    assert colibri.cpu_isa() in ("scalar", "avx2", "avx512", "amx")


def test_library_lookup_order(monkeypatch, tmp_path):
    monkeypatch.setenv("COLIBRI_LIBRARY", str(tmp_path / "nope.so"))
    cands = _lib.candidate_paths()
    assert cands == [("COLIBRI_LIBRARY", str(tmp_path / "nope.so"))]
    monkeypatch.delenv("COLIBRI_LIBRARY")
    origins = [o for o, _ in _lib.candidate_paths()]
    assert origins[0] == "package"  # bundled library first, then build trees, then the system
    order = {"package": 0, "build tree": 1, "system": 2}
    assert [order[o] for o in origins] == sorted(order[o] for o in origins)
    for origin, p in _lib.candidate_paths():
        if origin == "build tree":
            assert not _lib._is_sanitized(p)


def test_info_stats_kernels(small_model):
    m, layers = small_model
    info = m.info
    assert (info.n_layers, info.n_experts, info.d_model, info.d_ff, info.dtype) == (2, 4, D, 24, "f32")
    assert info.n_threads == 2
    assert info.router_family is None and info.router_top_k == 0 and info.shared_d_ff == 0
    st = m.stats
    assert st.bytes_mapped >= 2 * 4 * 3 * D * 24 * 4
    assert st.infer_calls == 0
    assert st.huge_page_kind in ("none", "transparent", "hugetlbfs")
    assert isinstance(m.kernels, str) and m.kernels
    assert "4 experts" in repr(m)


def test_open_options(small_dir):
    path, _ = small_dir
    with colibri.Model(path, threads=1, lock=False, huge_pages=False, verify=False, bf16_compute=True) as m:
        assert m.info.n_threads == 1
        assert m.stats.bytes_locked == 0
    with pytest.raises(ValueError, match="threads"):
        colibri.Model(path, threads=-1)


def test_open_errors_raise_colibri_error(tmp_path):
    with pytest.raises(colibri.ColibriError) as ei:
        colibri.Model(tmp_path / "missing")
    e = ei.value
    assert e.status == _lib.ERR_IO and e.status_name == "COLIBRI_ERR_IO"
    assert "missing" in e.message and "missing" in str(e)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "colibri.json").write_text('{"format": "colibri-moe", "version": 1, "n_layers": 0}')
    with pytest.raises(colibri.ColibriError) as ei:
        colibri.Model(tmp_path / "bad")
    assert ei.value.status == _lib.ERR_FORMAT
    assert "n_layers" in ei.value.message or "n_experts" in ei.value.message


# ---------------------------------------------------------------- inference


@pytest.mark.parametrize("layer", [0, 1])
def test_infer_numpy_matches_reference(small_model, layer):
    m, layers = small_model
    rng = np.random.default_rng(layer)
    x = rng.standard_normal((9, D)).astype(np.float32)
    ids, w = routing(rng, 9)
    ids[3, 1] = -1  # no expert in that slot
    y = m.infer(x, ids, w, layer=layer)
    assert isinstance(y, np.ndarray) and y.dtype == np.float32 and y.shape == (9, D)
    assert rel_err(y, swiglu_reference(x, layers[layer], ids, w)) < 1e-5
    assert m.stats.infer_calls == 1


def test_infer_torch_returns_tensor(small_model):
    m, layers = small_model
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, D)).astype(np.float32)
    ids, w = routing(rng, 5)
    y = m.infer(torch.from_numpy(x), torch.from_numpy(ids).long(), torch.from_numpy(w))
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32 and tuple(y.shape) == (5, D)
    assert rel_err(y.numpy(), swiglu_reference(x, layers[0], ids, w)) < 1e-5
    # ids and weights may be of the other kind; the result follows x
    y2 = m.infer(x, torch.from_numpy(ids), w)
    assert isinstance(y2, np.ndarray)
    np.testing.assert_array_equal(y2, y.numpy())


def test_int64_ids_equal_int32(small_model):
    m, _ = small_model
    rng = np.random.default_rng(2)
    x = rng.standard_normal((7, D)).astype(np.float32)
    ids, w = routing(rng, 7)
    np.testing.assert_array_equal(m.infer(x, ids, w), m.infer(x, ids.astype(np.int64), w))


def test_out_numpy_zero_copy(small_model):
    m, layers = small_model
    rng = np.random.default_rng(3)
    big = rng.standard_normal((20, D)).astype(np.float32)
    x = big[4:12]  # a view at an offset: read in place
    assert not x.flags["OWNDATA"]
    ids, w = routing(rng, 8)
    out = np.full((8, D), np.nan, np.float32)
    y = m.infer(x, ids, w, out=out)
    assert y is out
    assert rel_err(out, swiglu_reference(x, layers[0], ids, w)) < 1e-5


def test_out_torch_zero_copy(small_model):
    m, _ = small_model
    rng = np.random.default_rng(4)
    x = torch.from_numpy(rng.standard_normal((6, D)).astype(np.float32))
    ids, w = routing(rng, 6)
    out = torch.empty(6, D)
    ptr = out.data_ptr()
    y = m.infer(x, torch.from_numpy(ids), torch.from_numpy(w), out=out)
    assert y is out and y.data_ptr() == ptr
    np.testing.assert_array_equal(out.numpy(), m.infer(x.numpy(), ids, w))


def test_zero_tokens(small_model):
    m, _ = small_model
    y = m.infer(np.zeros((0, D), np.float32), np.zeros((0, 2), np.int32), np.zeros((0, 2), np.float32))
    assert y.shape == (0, D)


def test_routing_blob(small_model):
    m, _ = small_model
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, D)).astype(np.float32)
    ids, w = routing(rng, 6, k=3)
    blob = colibri.routing.compile_routing((ids, w), n_experts=4)
    np.testing.assert_array_equal(m.infer(x, routing=blob), m.infer(x, ids, w))
    with pytest.raises(colibri.ColibriError, match="token"):
        m.infer(x[:5], routing=blob)  # 6 tokens in the blob
    with pytest.raises(ValueError, match="routing="):
        m.infer(x, ids, w, routing=blob)


def test_concurrent_infer(small_model):
    m, _ = small_model
    rng = np.random.default_rng(6)
    x = rng.standard_normal((16, D)).astype(np.float32)
    ids, w = routing(rng, 16)
    want = m.infer(x, ids, w)
    results, errors = [], []

    def run():
        try:
            for _ in range(20):
                results.append(m.infer(x, ids, w))
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 80
    for r in results:
        np.testing.assert_array_equal(r, want)


def test_gil_released_during_infer():
    """ctypes releases the GIL around calls through a CDLL (not a PyDLL), so
    other Python threads run while colibri_infer works."""
    lib = _lib.lib()
    assert isinstance(lib, ctypes.CDLL) and not isinstance(lib, ctypes.PyDLL)
    assert lib._func_flags_ & ctypes._FUNCFLAG_PYTHONAPI == 0


# ------------------------------------------------------------ bad arguments


def bad_call(m, **kw):
    rng = np.random.default_rng(0)
    args = dict(x=rng.standard_normal((4, D)).astype(np.float32),
                ids=np.array([[0, 1]] * 4, np.int32), weights=np.full((4, 2), 0.5, np.float32))
    args.update(kw)
    return m.infer(**args)


@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(x=np.zeros((4, D), np.float64)), TypeError, r"x must have dtype float32, got numpy.float64"),
    (dict(x=np.zeros((4, D), ">f4")), TypeError, r"x must have dtype float32"),
    (dict(x=[[0.0] * D] * 4), TypeError, r"x must be a numpy.ndarray or a torch.Tensor, got list"),
    (dict(x=np.zeros((4 * D,), np.float32)), ValueError, r"x must be 2-D \[\?, 32\]"),
    (dict(x=np.zeros((4, D + 1), np.float32)), ValueError, r"x must have shape \[\?, 32\], got \[4, 33\]"),
    (dict(x=np.zeros((D, 8), np.float32).T[:4]), ValueError, r"x must be C-contiguous"),
    (dict(x=np.zeros((4, 2 * D), np.float32)[:, ::2]), ValueError, r"x must be C-contiguous"),
    (dict(ids=np.zeros((4, 2), np.float32)), TypeError, r"ids must have dtype int32 or int64"),
    (dict(ids=np.zeros((4, 2), np.int16)), TypeError, r"ids must have dtype int32 or int64"),
    (dict(ids=np.zeros((3, 2), np.int32)), ValueError, r"ids must have shape \[T, k\] with T = 4"),
    (dict(ids=np.zeros((4,), np.int32)), ValueError, r"ids must be 2-D"),
    (dict(ids=np.zeros((4, 5), np.int32), weights=np.zeros((4, 5), np.float32)), ValueError, r"1 <= k <= 4"),
    (dict(ids=np.zeros((4, 2), np.int64) + 2**33), ValueError, r"ids holds values outside int32"),
    (dict(ids=np.zeros((8, 2), np.int32)[::2]), ValueError, r"ids must be C-contiguous"),
    (dict(weights=np.zeros((4, 2), np.float64)), TypeError, r"weights must have dtype float32"),
    (dict(weights=np.zeros((4, 3), np.float32)), ValueError, r"weights must have shape \[4, 2\]"),
    (dict(weights=None), ValueError, r"ids and weights go together"),
    (dict(ids=None), ValueError, r"ids and weights go together"),
    (dict(layer=2), ValueError, r"layer must be in \[0, 1\], got 2"),
    (dict(layer=-1), ValueError, r"layer must be in \[0, 1\]"),
    (dict(layer=0.0), TypeError, r"layer must be an int"),
    (dict(threads=-1), ValueError, r"threads must be in"),
])
def test_bad_arguments(small_model, kw, exc, pattern):
    m, _ = small_model
    with pytest.raises(exc, match=pattern):
        bad_call(m, **kw)
    assert m.stats.infer_calls == 0


@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(x=torch.zeros(4, D, dtype=torch.float64)), TypeError, r"x must have dtype float32, got torch.float64"),
    (dict(x=torch.zeros(4, D, dtype=torch.bfloat16)), TypeError, r"x must have dtype float32, got torch.bfloat16"),
    (dict(x=torch.zeros(D, 4).t()), ValueError, r"x must be C-contiguous.*\.contiguous\(\)"),
    (dict(x=torch.zeros(4, D, device="meta")), ValueError, r"x must be a CPU tensor, got a tensor on meta"),
    (dict(x=torch.zeros(4, D).to_sparse()), ValueError, r"x must be a dense"),
    (dict(ids=torch.zeros(4, 2, dtype=torch.int8)), TypeError, r"ids must have dtype int32 or int64, got torch.int8"),
    (dict(ids=torch.zeros(4, 2, dtype=torch.int64, device="meta")), ValueError, r"ids must be a CPU tensor"),
    (dict(weights=torch.zeros(4, 2, dtype=torch.float16)), TypeError, r"weights must have dtype float32"),
    (dict(weights=torch.zeros(2, 4).t()), ValueError, r"weights must be C-contiguous"),
])
def test_bad_torch_arguments(small_model, kw, exc, pattern):
    m, _ = small_model
    if "x" in kw:
        kw.setdefault("ids", torch.zeros(4, 2, dtype=torch.int32) + torch.tensor([0, 1], dtype=torch.int32))
        kw.setdefault("weights", torch.full((4, 2), 0.5))
    with pytest.raises(exc, match=pattern):
        bad_call(m, **kw)


def test_cuda_like_device_rejected(small_model):
    """A tensor whose device is not the CPU is refused before any pointer is
    taken (a CUDA tensor when CUDA exists; here 'meta', the same path)."""
    m, _ = small_model
    x = torch.empty(4, D, device="meta")
    with pytest.raises(ValueError, match="CPU tensor"):
        m.infer(x, torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, 2))
    if torch.cuda.is_available():  # pragma: no cover
        with pytest.raises(ValueError, match="CPU tensor.*cuda"):
            m.infer(x.to("cuda"), torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, 2))


def test_out_errors(small_model):
    m, _ = small_model
    rng = np.random.default_rng(0)
    buf = rng.standard_normal((8, D)).astype(np.float32)
    x = buf[:4]
    ids, w = np.array([[0, 1]] * 4, np.int32), np.full((4, 2), 0.5, np.float32)
    with pytest.raises(ValueError, match="out must not overlap x"):
        m.infer(x, ids, w, out=x)
    with pytest.raises(ValueError, match="out must not overlap x"):
        m.infer(x, ids, w, out=buf[2:6])  # partial overlap
    with pytest.raises(TypeError, match="out must be a numpy.ndarray like x, got a torch.Tensor"):
        m.infer(x, ids, w, out=torch.empty(4, D))
    with pytest.raises(TypeError, match="out must be a torch.Tensor like x"):
        m.infer(torch.from_numpy(x), ids, w, out=np.empty((4, D), np.float32))
    with pytest.raises(TypeError, match="out must have dtype float32"):
        m.infer(x, ids, w, out=np.empty((4, D), np.float64))
    with pytest.raises(ValueError, match=r"out must have shape \[4, 32\], got \[5, 32\]"):
        m.infer(x, ids, w, out=np.empty((5, D), np.float32))
    with pytest.raises(ValueError, match="out must be C-contiguous"):
        m.infer(x, ids, w, out=np.empty((D, 4), np.float32).T)
    ro = np.empty((4, D), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out must be writeable"):
        m.infer(x, ids, w, out=ro)
    wbuf = np.zeros(4 * D, np.float32)
    with pytest.raises(ValueError, match="out must not overlap weights"):
        m.infer(x, ids, wbuf[:8].reshape(4, 2), out=wbuf.reshape(4, D))
    tx = torch.from_numpy(x.copy())
    with pytest.raises(ValueError, match="out must not overlap x"):
        m.infer(tx, ids, w, out=tx)
    assert m.stats.infer_calls == 0


def test_library_errors_surface(small_model):
    m, _ = small_model
    x = np.zeros((2, D), np.float32)
    with pytest.raises(colibri.ColibriError) as ei:
        m.infer(x, np.array([[0, 9], [1, 2]], np.int32), np.ones((2, 2), np.float32))
    assert ei.value.status == _lib.ERR_INVALID_ARGUMENT
    assert "out of range" in ei.value.message and "9" in ei.value.message
    with pytest.raises(colibri.ColibriError) as ei:
        m.infer(x)  # no routing and no built-in router
    assert ei.value.status == _lib.ERR_INVALID_ARGUMENT and "router" in ei.value.message
    with pytest.raises(ValueError, match="no built-in router"):
        m.route(x)


def test_closed_model(small_dir):
    path, _ = small_dir
    m = colibri.Model(path)
    m.close()
    m.close()  # idempotent
    assert m.closed and "closed" in repr(m)
    x = np.zeros((2, D), np.float32)
    for call in (lambda: m.infer(x, np.zeros((2, 1), np.int32), np.ones((2, 1), np.float32)),
                 lambda: m.info, lambda: m.stats, lambda: m.kernels, lambda: m.route(x)):
        with pytest.raises(ValueError, match="closed"):
            call()
    with colibri.Model(path) as m2:
        assert not m2.closed
    assert m2.closed


def test_close_waits_for_running_calls(small_dir):
    path, _ = small_dir
    m = colibri.Model(path, threads=1)
    x = np.zeros((64, D), np.float32)
    ids, w = np.zeros((64, 1), np.int32), np.ones((64, 1), np.float32)
    errors = []

    def loop():
        while True:
            try:
                m.infer(x, ids, w)
            except ValueError:
                return  # closed
            except Exception as e:  # pragma: no cover
                errors.append(e)
                return

    ts = [threading.Thread(target=loop) for _ in range(3)]
    for t in ts:
        t.start()
    m.close()
    for t in ts:
        t.join()
    assert not errors


def test_model_is_freed_when_dropped(small_dir):
    path, _ = small_dir
    m = colibri.Model(path)
    handle = m._handle
    assert handle
    del m
    gc.collect()  # __del__ closed it; nothing to observe but the absence of a crash


def test_save_model_dtypes(tmp_path):
    rng = np.random.default_rng(11)
    ex = random_experts(rng, 3, 16, 8)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    ids = np.array([[0, 2]] * 5, np.int32)
    w = np.full((5, 2), 0.5, np.float32)
    want = swiglu_reference(x, ex, ids, w)
    for dt, tol in (("f32", 1e-5), ("f16", 5e-3), ("bf16", 2e-2)):
        p = colibri.save_model(tmp_path / dt, [{"experts": ex}], dtype=dt)
        with colibri.Model(p) as m:
            assert m.info.dtype == dt
            assert rel_err(m.infer(x, ids, w), want) < tol
    with pytest.raises(ValueError, match="format v1"):
        colibri.save_model(tmp_path / "x", [{"experts": ex, "shared": ex[0]}])


@needs_v2
def test_from_arrays_layouts_agree():
    rng = np.random.default_rng(12)
    E, Dm, F = 4, 16, 8
    ex = random_experts(rng, E, Dm, F)
    g = np.stack([e[0] for e in ex])
    u = np.stack([e[1] for e in ex])
    dn = np.stack([e[2] for e in ex])
    gu = np.concatenate([g, u], axis=1)  # [E, 2F, D], gate rows first
    x = rng.standard_normal((6, Dm)).astype(np.float32)
    ids = np.array([[0, 3], [1, 2], [2, -1], [3, 0], [1, 0], [2, 3]], np.int32)
    w = rng.uniform(0, 1, (6, 2)).astype(np.float32)
    want = swiglu_reference(x, ex, ids, w)
    for layer in ({"experts": ex}, {"experts": (g, u, dn)}, {"gate_up_proj": gu, "down_proj": dn},
                  {"gate_up_proj": torch.from_numpy(gu), "down_proj": torch.from_numpy(dn)}):
        with colibri.Model.from_arrays([layer], dtype="f32", threads=1) as m:
            assert m.source == "<memory>"
            assert rel_err(m.infer(x, ids, w), want) < 1e-5


@pytest.mark.parametrize("dtype", ["f32", "q8_0", "q4_k_m"])
def test_from_arrays_lazy_experts_are_read_one_at_a_time(dtype):
    """colibri._arrays.Lazy experts (colibri_model_desc_t.fetch_expert): the
    same model as from the arrays, each weight read once, no expert read
    before the library has copied the one before it, errors raised as the
    reader raised them."""
    from colibri._arrays import Lazy

    rng = np.random.default_rng(14)
    E, Dm, F = 6, 256, 256
    layers = [random_experts(rng, E, Dm, F) for _ in range(2)]
    bias = [rng.standard_normal((E, n)).astype(np.float32) for n in (F, F, Dm)]
    live, reads = [], []

    class Held(np.ndarray):  # tracks which experts' read arrays are still alive
        def __del__(self):
            if getattr(self, "tag", None) in live:
                live.remove(self.tag)

    def lazy(l, e, i):
        def read():
            reads.append((l, e, i))
            a = layers[l][e][i].copy().view(Held)
            a.tag = (l, e, i)
            assert len({t[:2] for t in live}) <= 1, live  # at most the expert being copied
            live.append(a.tag)
            return a
        return Lazy(layers[l][e][i].shape, read, layers[l][e][i].nbytes)

    opts = dict(dtype=dtype, threads=1, activation="clamped_swiglu")
    plain = colibri.Model.from_arrays([dict(experts=ex, gate_bias=bias[0], up_bias=bias[1], down_bias=bias[2])
                                       for ex in layers], **opts)
    lazy_layers = [dict(experts=[tuple(lazy(l, e, i) for i in range(3)) for e in range(E)], gate_bias=bias[0],
                        up_bias=bias[1], down_bias=bias[2]) for l in range(2)]
    fetched = colibri.Model.from_arrays(lazy_layers, **opts)
    assert sorted(reads) == [(l, e, i) for l in range(2) for e in range(E) for i in range(3)]
    x = rng.standard_normal((5, Dm)).astype(np.float32)
    ids = np.array([[0, 5], [1, 2], [3, -1], [4, 0], [5, 1]], np.int32)
    w = rng.uniform(0, 1, (5, 2)).astype(np.float32)
    for layer in range(2):
        np.testing.assert_array_equal(fetched.infer(x, ids, w, layer=layer), plain.infer(x, ids, w, layer=layer))

    def broken():
        raise OSError("shard 3 is unreadable")
    bad = [dict(lazy_layers[0], experts=[lazy_layers[0]["experts"][0], (Lazy((F, Dm), broken, 0),) * 2
                                         + (lazy(0, 1, 2),)] + list(lazy_layers[0]["experts"][2:]))]
    with pytest.raises(OSError, match="shard 3 is unreadable"):
        colibri.Model.from_arrays(bad, **opts)
    experts = list(lazy_layers[0]["experts"])
    experts[1] = experts[1][:2] + (Lazy((Dm, F + 1), lambda: None, 0),)
    with pytest.raises(ValueError, match=r"layers\[0\] expert 1 down must have shape \[256, 256\], got \[256, 257\]"):
        colibri.Model.from_arrays([dict(lazy_layers[0], experts=experts)], **opts)


@needs_v2
def test_from_arrays_shared_and_router():
    rng = np.random.default_rng(13)
    E, Dm, F, S = 4, 16, 8, 12
    ex = random_experts(rng, E, Dm, F)
    sh = random_experts(rng, 1, Dm, S)[0]
    sg = rng.standard_normal(Dm).astype(np.float32)
    router = rng.standard_normal((E, Dm)).astype(np.float32)
    x = rng.standard_normal((7, Dm)).astype(np.float32)
    m = colibri.Model.from_arrays([{"experts": ex, "shared": sh, "shared_gate": sg, "router": router}],
                                  router={"family": "mixtral", "top_k": 2}, threads=1)
    info = m.info
    assert (info.router_family, info.router_top_k, info.shared_d_ff) == ("mixtral", 2, S)
    ids, w = m.route(x)
    assert ids.dtype == np.int32 and w.dtype == np.float32 and ids.shape == (7, 2)
    logits = x.astype(np.float64) @ router.T.astype(np.float64)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    want_ids = np.argsort(-p, axis=1, kind="stable")[:, :2]
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w.sum(1), 1.0, rtol=1e-5)
    shared = swiglu_reference(x, [sh], np.zeros((7, 1), np.int32), np.ones((7, 1), np.float32))
    gate = 1.0 / (1.0 + np.exp(-(x.astype(np.float64) @ sg)))
    want = swiglu_reference(x, ex, ids, w) + gate[:, None] * shared
    assert rel_err(m.infer(x), want) < 1e-5  # built-in router + gated shared expert
    assert rel_err(m.infer(x, ids, w), want) < 1e-5
    tids, tw = m.route(torch.from_numpy(x))
    assert isinstance(tids, torch.Tensor) and tids.dtype == torch.int32
    m.close()


@needs_v2
def test_from_arrays_errors():
    rng = np.random.default_rng(14)
    ex = random_experts(rng, 2, 8, 4)
    with pytest.raises(ValueError, match=r"expert 1 up must have shape \[4, 8\], got \[4, 7\]"):
        bad = list(ex)
        bad[1] = (ex[1][0], ex[1][1][:, :7], ex[1][2])
        colibri.Model.from_arrays([{"experts": bad}])
    with pytest.raises(ValueError, match="dtype"):
        colibri.Model.from_arrays([{"experts": ex}], dtype="f8")
    with pytest.raises(ValueError, match="needs 'router'"):
        colibri.Model.from_arrays([{"experts": ex}], router={"family": "mixtral", "top_k": 1})
    with pytest.raises(ValueError, match="unknown router family"):
        colibri.Model.from_arrays([{"experts": ex, "router": np.zeros((2, 8), np.float32)}],
                                  router={"family": "gpt", "top_k": 1})
    with pytest.raises(TypeError, match="floating-point"):
        colibri.Model.from_arrays([{"experts": [tuple(a.astype(np.int32) for a in e) for e in ex]}])
    with pytest.raises(ValueError, match="down_proj must be"):
        colibri.Model.from_arrays([{"gate_up_proj": np.zeros((2, 8, 8), np.float32),
                                    "down_proj": np.zeros((2, 4, 8), np.float32)}])
    with pytest.raises(colibri.ColibriError) as ei:  # the library's own check
        colibri.Model.from_arrays([{"experts": ex, "router": np.zeros((2, 8), np.float32)}],
                                  router={"family": "mixtral", "top_k": 3})
    assert ei.value.status == _lib.ERR_INVALID_ARGUMENT and "top_k" in ei.value.message


def test_swap_expert(small_dir, tmp_path):
    if not _lib.has("colibri_swap_expert"):
        pytest.skip("the loaded libcolibri predates colibri_swap_expert")
    path, layers = small_dir
    rng = np.random.default_rng(15)
    x = rng.standard_normal((5, D)).astype(np.float32)
    w = np.ones((5, 1), np.float32)
    with colibri.Model(path, threads=2) as m:
        e2 = m.infer(x, np.full((5, 1), 2, np.int32), w, layer=1)
        m.swap_expert(1, 1, layers[1][2])  # expert 1 of layer 1 becomes a copy of expert 2
        np.testing.assert_array_equal(m.infer(x, np.full((5, 1), 1, np.int32), w, layer=1), e2)
        m.swap_expert(1, 1, tuple(torch.from_numpy(a) for a in layers[1][0]))  # torch tensors too
        want0 = swiglu_reference(x, layers[1], np.zeros((5, 1), np.int32), w)
        assert rel_err(m.infer(x, np.full((5, 1), 1, np.int32), w, layer=1), want0) < 1e-5
        expert_file = os.path.join(path, "layer_01", "expert_02.bin")
        m.swap_expert(1, 1, path=expert_file)
        np.testing.assert_array_equal(m.infer(x, np.full((5, 1), 1, np.int32), w, layer=1), e2)
        m.swap_expert(1, 1, open(expert_file, "rb").read())  # raw expert-file bytes
        assert m.stats.expert_swaps == 4
        with pytest.raises(ValueError, match=r"weights down must have shape \[32, 24\]"):
            m.swap_expert(0, 0, (layers[0][0][0], layers[0][0][1], layers[0][0][2][:, :5]))
        with pytest.raises(ValueError, match=r"expert must be in \[0, 3\]"):
            m.swap_expert(0, 4, layers[0][0])
        with pytest.raises(ValueError, match="either weights or path"):
            m.swap_expert(0, 0)
        with pytest.raises(colibri.ColibriError) as ei:
            m.swap_expert(0, 0, b"\0" * 12)  # wrong size: the old expert keeps serving
        assert ei.value.status in (_lib.ERR_INVALID_ARGUMENT, _lib.ERR_FORMAT)
        with pytest.raises(colibri.ColibriError) as ei:
            m.swap_expert(0, 0, layers[0][0], checksum=12345)
        assert ei.value.status == _lib.ERR_CHECKSUM
        assert m.stats.expert_swaps == 4
