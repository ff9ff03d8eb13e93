"""colibri.routing: .route export (docs/FORMAT.md grammar), compile to
routing.bin in memory, load back, and the CLI on exported files."""

import os
import re
import struct
import subprocess

import numpy as np
import pytest
import torch

import colibri
from colibri import _lib
from colibri.routing import compile_routing, compile_routing_file, export_routing, load_routing, topk_routing
from helpers import rel_err, swiglu_reference, find_cli

LINE = re.compile(r"^(\d+)((?:, \d+)+)((?:, [-+0-9.eE]+)+)$")


def parse_route_strict(text, k):
    """Checks every line against the .route grammar; returns {token: (ids, weights)}."""
    rows = {}
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        cols = [c.strip() for c in line.split(",")]
        assert len(cols) == 2 * k + 1, "line %d: %d columns" % (n, len(cols))
        assert all(cols), "line %d has an empty field" % n
        assert not any(c.startswith("+") for c in cols)
        t = int(cols[0])
        assert t not in rows
        ids = [int(c) for c in cols[1:1 + k]]
        assert len(set(ids)) == k
        rows[t] = (ids, [float(c) for c in cols[1 + k:]])
    assert sorted(rows) == list(range(len(rows)))
    return rows


def test_export_from_logits(tmp_path):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((50, 8)).astype(np.float32) * 3
    path = tmp_path / "r.route"
    ids, w = export_routing(logits, path, k=2)
    text = path.read_text()
    assert text.startswith("#")
    assert "\r" not in text and text.endswith("\n")
    rows = parse_route_strict(text, 2)
    assert len(rows) == 50
    # softmax over all experts, top-2, renormalised
    p = np.exp(logits.astype(np.float64))
    p /= p.sum(1, keepdims=True)
    top = np.argsort(-p, axis=1)[:, :2]
    np.testing.assert_array_equal(ids, top)
    pw = np.take_along_axis(p, top, 1)
    np.testing.assert_allclose(w, pw / pw.sum(1, keepdims=True), rtol=1e-6)
    for t, (rid, rw) in rows.items():
        assert rid == ids[t].tolist()
        assert np.float32(rw[0]) == w[t, 0] and np.float32(rw[1]) == w[t, 1]  # 9 digits: exact in float32
    lids, lw = load_routing(path, n_experts=8)
    np.testing.assert_array_equal(lids, ids)
    np.testing.assert_array_equal(lw, w)


def test_export_logits_options(tmp_path):
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [5.0, 5.0, 5.0, 1.0]])
    ids, w = export_routing(logits, tmp_path / "a.route", k=3, renormalize=False)
    assert ids.tolist() == [[3, 2, 1], [0, 1, 2]]  # ties go to the lower index
    p = torch.softmax(logits.double(), -1)
    np.testing.assert_allclose(w, torch.gather(p, 1, torch.tensor(ids).long()).numpy(), rtol=1e-6)
    assert w.sum(1)[0] < 1.0
    ids, w = topk_routing(logits, 1, scoring="sigmoid", renormalize=False)
    np.testing.assert_allclose(w[0, 0], 1 / (1 + np.exp(-3.0)), rtol=1e-6)
    with pytest.raises(ValueError, match="k .* is required"):
        export_routing(logits, tmp_path / "b.route")
    with pytest.raises(ValueError, match=r"k must be an int in \[1, 4\]"):
        export_routing(logits, tmp_path / "b.route", k=5)
    with pytest.raises(ValueError, match="non-finite"):
        export_routing(torch.tensor([[0.0, float("nan")]]), tmp_path / "b.route", k=1)
    assert not (tmp_path / "b.route").exists()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_export_pair_any_k_real_weights(tmp_path, k):
    rng = np.random.default_rng(k)
    T, E = 40, 300  # > 256 experts: routing.bin uses u16 ids
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)])
    w = (rng.standard_normal((T, k)) * 10).astype(np.float32)  # negative and > 1 are legal
    w[0, 0] = 1e-30
    w[1, 0] = -0.0
    path = tmp_path / "p.route"
    rid, rw = export_routing((torch.from_numpy(ids), torch.from_numpy(w)), path)
    np.testing.assert_array_equal(rid, ids)
    parse_route_strict(path.read_text(), k)
    lids, lw = load_routing(str(path), n_experts=E)
    np.testing.assert_array_equal(lids, ids)
    np.testing.assert_array_equal(lw, w)
    blob = compile_routing((ids, w), n_experts=E)
    lids, lw = load_routing(blob)
    np.testing.assert_array_equal(lids, ids)
    np.testing.assert_array_equal(lw, w)


def test_compile_header_and_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    ids = np.stack([rng.permutation(8)[:2] for _ in range(10)]).astype(np.int32)
    w = rng.uniform(0, 1, (10, 2)).astype(np.float32)
    export_routing((ids, w), tmp_path / "r.route")
    text = (tmp_path / "r.route").read_text()
    blob = compile_routing(text, n_experts=8)
    assert blob[:4] == bytes([0xC0, 0x6C, 0x31, 0x62])
    version, header, T, E, k, id_enc, w_enc, flags, payload = struct.unpack_from("<HHIIHBBIQ", blob, 4)
    assert (version, header, T, E, k, id_enc, w_enc, flags) == (1, 40, 10, 8, 2, 1, 1, 0)
    assert payload == 10 * 2 * (1 + 4) and len(blob) == 40 + payload
    assert compile_routing(text.encode(), n_experts=8) == blob
    assert compile_routing((ids, w), n_experts=8) == blob  # the pair, through the same text
    lids, lw = load_routing(blob, n_experts=8)
    np.testing.assert_array_equal(lids, ids)
    np.testing.assert_array_equal(lw, w)
    # the file form, compiled by the library to disk
    compile_routing_file(tmp_path / "r.route", tmp_path / "r.bin", n_experts=8)
    assert (tmp_path / "r.bin").read_bytes() == blob
    lids, lw = load_routing(tmp_path / "r.bin")
    np.testing.assert_array_equal(lids, ids)


def test_compile_encodings():
    ids = np.array([[0, 3], [2, 1], [1, 0]])
    w = np.array([[0.7, 0.3], [0.2, 0.8], [1.0, 0.0]], np.float32)
    f16 = compile_routing((ids, w), n_experts=4, f16_weights=True)
    _, lw = load_routing(f16)
    np.testing.assert_allclose(lw, w, atol=1e-3)
    compact = compile_routing((ids, w), n_experts=4, compact=True)
    assert len(compact) == 40 + 3
    cids, cw = load_routing(compact)
    np.testing.assert_array_equal(cids, ids)
    np.testing.assert_allclose(cw[:, 0], np.round(w[:, 0] * 15) / 15, atol=1e-6)
    np.testing.assert_allclose(cw.sum(1), 1.0, atol=1e-6)
    q4 = compile_routing("0, 1, 2, 15, 5\n", n_experts=4, q4_weights=True)
    _, qw = load_routing(q4)
    np.testing.assert_allclose(qw, [[1.0, 5 / 15]], rtol=1e-6)
    with pytest.raises(colibri.ColibriError) as ei:
        compile_routing((np.array([[0, 1, 2]]), np.ones((1, 3))), n_experts=4, compact=True)
    assert ei.value.status == _lib.ERR_INVALID_ARGUMENT


def test_compile_errors_name_the_line():
    with pytest.raises(colibri.ColibriError) as ei:
        compile_routing("0, 1, 2, 0.5, 0.5\n1, 1, 9, 0.5, 0.5\n", n_experts=8, source_name="mine.route")
    e = ei.value
    assert e.status == _lib.ERR_FORMAT
    assert e.message.startswith("mine.route:2:") and "9" in e.message
    with pytest.raises(colibri.ColibriError, match="no data lines"):
        compile_routing("# nothing\n", n_experts=8)
    with pytest.raises(colibri.ColibriError) as ei:
        compile_routing("0, 1, 0.5\n", n_experts=0)
    assert ei.value.status == _lib.ERR_INVALID_ARGUMENT
    with pytest.raises(TypeError, match="n_experts"):
        compile_routing("0, 1, 0.5\n", n_experts="8")


def test_load_errors(tmp_path):
    blob = bytearray(compile_routing("0, 1, 2, 0.5, 0.5\n", n_experts=4))
    blob[-1] ^= 0xFF
    with pytest.raises(colibri.ColibriError) as ei:
        load_routing(bytes(blob))
    assert ei.value.status == _lib.ERR_CHECKSUM
    with pytest.raises(colibri.ColibriError) as ei:
        load_routing(b"not a routing file at all, but long enough for a header")
    assert ei.value.status == _lib.ERR_FORMAT
    with pytest.raises(colibri.ColibriError, match="model has 2"):
        load_routing(compile_routing("0, 1, 2, 0.5, 0.5\n", n_experts=4), n_experts=2)
    with pytest.raises(colibri.ColibriError) as ei:
        load_routing(tmp_path / "missing.bin")
    assert ei.value.status == _lib.ERR_IO
    with pytest.raises(TypeError):
        load_routing(12)


def test_pair_validation(tmp_path):
    p = tmp_path / "x.route"
    with pytest.raises(ValueError, match="no -1"):
        export_routing((np.array([[0, -1]]), np.ones((1, 2))), p)
    with pytest.raises(ValueError, match="repeat an expert"):
        export_routing((np.array([[0, 1], [2, 2]]), np.ones((2, 2))), p)
    with pytest.raises(ValueError, match="out of range"):
        export_routing((np.array([[0, 4]]), np.ones((1, 2))), p, n_experts=4)
    with pytest.raises(ValueError, match="not all finite"):
        export_routing((np.array([[0, 1]]), np.array([[np.inf, 1.0]])), p)
    with pytest.raises(ValueError, match="shape"):
        export_routing((np.array([[0, 1]]), np.ones((1, 3))), p)
    with pytest.raises(TypeError, match="integers"):
        export_routing((np.array([[0.0, 1.0]]), np.ones((1, 2))), p)
    with pytest.raises(ValueError, match="k=3"):
        export_routing((np.array([[0, 1]]), np.ones((1, 2))), p, k=3)
    assert not p.exists() and not [f for f in os.listdir(tmp_path) if f.startswith(".route-")]


def test_large_export_is_vectorised(tmp_path):
    rng = np.random.default_rng(3)
    T, E, k = 200_000, 64, 8
    logits = torch.from_numpy(rng.standard_normal((T, E)).astype(np.float32))
    ids, w = export_routing(logits, tmp_path / "big.route", k=k)
    blob = compile_routing((tmp_path / "big.route").read_bytes(), n_experts=E)
    lids, lw = load_routing(blob)
    np.testing.assert_array_equal(lids, ids)
    np.testing.assert_array_equal(lw, w)


def test_infer_with_exported_routing_matches_arrays(small_model, tmp_path):
    m, layers = small_model
    rng = np.random.default_rng(4)
    x = rng.standard_normal((12, 32)).astype(np.float32)
    ids, w = export_routing(rng.standard_normal((12, 4)), tmp_path / "r.route", k=2)
    blob = compile_routing((tmp_path / "r.route").read_text(), n_experts=4)
    y = m.infer(x, routing=blob)
    np.testing.assert_array_equal(y, m.infer(x, ids, w))
    assert rel_err(y, swiglu_reference(x, layers[0], ids, w)) < 1e-5


def test_cli_infer_on_exported_files(small_dir, tmp_path):
    """The first way in: export the routing to a file and run the CLI."""
    cli = find_cli()
    if cli is None:
        pytest.skip("colibri CLI not found (set COLIBRI_CLI)")
    path, layers = small_dir
    rng = np.random.default_rng(5)
    x = rng.standard_normal((10, 32)).astype(np.float32)
    ids, w = export_routing(rng.standard_normal((10, 4)), tmp_path / "r.route", k=2)
    x.tofile(tmp_path / "x.bin")
    subprocess.run([cli, "infer", "--model", path, "--routing", str(tmp_path / "r.route"), "--input",
                    str(tmp_path / "x.bin"), "--output", str(tmp_path / "y.bin"), "--layer", "1"], check=True,
                   capture_output=True)
    y = np.fromfile(tmp_path / "y.bin", dtype="<f4").reshape(10, 32)
    assert rel_err(y, swiglu_reference(x, layers[1], ids, w)) < 1e-5
    with colibri.Model(path) as m:
        np.testing.assert_allclose(y, m.infer(x, ids, w, layer=1), rtol=1e-6, atol=1e-6)
