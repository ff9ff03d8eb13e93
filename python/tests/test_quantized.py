"""Block-quantised experts from Python: Model.from_arrays, ColibriExperts and
accelerate(model, dtype=...) quantise on load, and their outputs match the
same model with its expert weights replaced by their dequantised values
(colibri.dequantize(colibri.quantize(w))): within 2e-2 with int8
activations, 1e-5 with exact_prefill."""

import copy
import os

import numpy as np
import pytest
import torch

import colibri
from helpers import needs_v2
from reference_moe import make_model, rel_l2

pytestmark = needs_v2

if colibri.has_open_memory():
    import colibri.torch as ct

D = 64
FORMATS = ["q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q4_k_m"]


def _quantised_param(name):
    # Expert and shared-expert matrices; routers and the shared expert's
    # sigmoid gate stay f32.
    return ((".experts." in name or "shared_expert." in name or "shared_experts." in name)
            and "shared_expert_gate" not in name)


def dequantised_copy(model, dtype):
    """model with every expert matrix replaced by its round trip through
    `dtype` (rows along the last axis, as Colibri quantises them)."""
    gate_up, down = colibri.quant.split_dtype(dtype)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if not _quantised_param(name) or p.dim() < 2:
                continue
            t = down if ("down" in name or name.endswith("w2.weight")) else gate_up
            a = p.detach().float().reshape(-1, p.shape[-1]).numpy()
            back = colibri.dequantize(colibri.quantize(a, t), t, a.shape[1])
            p.copy_(torch.from_numpy(back).reshape(p.shape))
    return ref


def _logits(model, x):
    with torch.no_grad():
        out = model(x)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "fused"])
def test_accelerate_quantised_matches_dequantised_model(family, dtype):
    # One MoE layer for the int8 comparison: with two, the ~1% the int8
    # activations move the first layer's output can flip a close top-k
    # choice of the second layer's router, which no tolerance covers.
    model = make_model(family, seed=3, n_layers=1)
    x = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(4))
    want = _logits(dequantised_copy(model, dtype), x)
    report = ct.accelerate(model, dtype=dtype, threads=2)
    assert report.skipped == [] and len(report.accelerated) == 1
    assert {b.dtype for b in report.accelerated} == {dtype}
    gu, dn = colibri.quant.split_dtype(dtype)
    info = report.models[0].info
    assert (info.dtype, info.down_dtype) == (gu, dn)
    assert 0 < report.colibri_bytes
    if dtype in ("q8_0", "q4_0"):  # whole blocks at d 64 / 48 (the K formats pad 48 and 64 to 256)
        assert report.colibri_bytes < report.source_bytes / 3
    assert "MiB in Colibri" in str(report)
    assert rel_l2(_logits(model, x), want) <= 2e-2

    # Exact: the same routing whatever the depth, so two layers.
    exact = make_model(family, seed=3)
    want = _logits(dequantised_copy(exact, dtype), x)
    ct.accelerate(exact, dtype=dtype, threads=2, exact_prefill=True)
    assert rel_l2(_logits(exact, x), want) <= 1e-5


def test_from_arrays_quantises_and_reports_types():
    rng = np.random.default_rng(0)
    E, F = 4, 40
    experts = [(rng.standard_normal((F, D), dtype=np.float32) * 0.1,
                rng.standard_normal((F, D), dtype=np.float32) * 0.1,
                rng.standard_normal((D, F), dtype=np.float32) * 0.1) for _ in range(E)]
    with colibri.Model.from_arrays([{"experts": experts}], dtype="q4_k_m", lock=False, huge_pages=False) as m:
        assert (m.info.dtype, m.info.down_dtype) == ("q4_k", "q6_k")
        x = rng.standard_normal((3, D), dtype=np.float32)
        ids = np.array([[0, 1], [2, 3], [1, -1]], dtype=np.int32)
        w = np.array([[0.6, 0.4], [0.5, 0.5], [1.0, 0.0]], dtype=np.float32)
        y = m.infer(x, ids, w)
        # The reference on the dequantised weights, in float64.
        deq = [(colibri.dequantize(colibri.quantize(g, "q4_k"), "q4_k", D),
                colibri.dequantize(colibri.quantize(u, "q4_k"), "q4_k", D),
                colibri.dequantize(colibri.quantize(d, "q6_k"), "q6_k", F)) for g, u, d in experts]
        ref = np.zeros((3, D))
        for t in range(3):
            for j in range(2):
                e = ids[t, j]
                if e < 0:
                    continue
                g, u, d = (a.astype(np.float64) for a in deq[e])
                gx, ux = g @ x[t], u @ x[t]
                ref[t] += w[t, j] * (d @ (gx / (1 + np.exp(-gx)) * ux))
        assert np.linalg.norm(y - ref) / np.linalg.norm(ref) <= 2e-2
    with pytest.raises(ValueError, match="dtype"):
        colibri.Model.from_arrays([{"experts": experts}], dtype="q7_k")


def test_kernels_chosen_by_measurement(tmp_path, monkeypatch):
    """tune_kernels (on by default) times the levels that can run the
    experts and says so in `kernels`, remembering the choice under
    COLIBRI_CACHE_DIR; off, the registry's tables. The C++ KernelChoice
    tests check the cache's keys, corrupted files and every remembered
    combination against the reference."""
    monkeypatch.delenv("COLIBRI_TUNE", raising=False)
    monkeypatch.setenv("COLIBRI_CACHE_DIR", str(tmp_path))
    rng = np.random.default_rng(3)
    E, F = 8, 64
    experts = [(rng.standard_normal((F, D), dtype=np.float32) * 0.1,
                rng.standard_normal((F, D), dtype=np.float32) * 0.1,
                rng.standard_normal((D, F), dtype=np.float32) * 0.1) for _ in range(E)]
    layers = [{"experts": experts}]
    levels = colibri.cpu_isa() in ("avx512", "amx") and not os.environ.get("COLIBRI_ISA")
    x = rng.standard_normal((5, D), dtype=np.float32)
    ids = np.array([[e % E, (e + 3) % E] for e in range(5)], dtype=np.int32)
    w = np.full((5, 2), 0.5, dtype=np.float32)
    with colibri.Model.from_arrays(layers, dtype="q4_0", lock=False, huge_pages=False) as m:
        assert ("chosen by measurement" in m.kernels) == levels, m.kernels
        tuned = m.infer(x, ids, w)
    assert (tmp_path / "kernels.tsv").exists() == levels
    with colibri.Model.from_arrays(layers, dtype="q4_0", lock=False, huge_pages=False, tune_kernels=False) as m:
        assert "measure" not in m.kernels
        plain = m.infer(x, ids, w)
    # Every level's int8 tables meet the same contract; here they agree closely.
    assert np.linalg.norm(tuned - plain) / np.linalg.norm(plain) <= 1e-2


def test_colibri_experts_quantised():
    torch.manual_seed(0)
    E, F = 4, 48
    gate = torch.randn(E, F, D) * 0.1
    up = torch.randn(E, F, D) * 0.1
    down = torch.randn(E, D, F) * 0.1
    experts = ct.ColibriExperts(gate, up, down, dtype="q8_0", threads=2)
    assert experts.dtype_name == "q8_0"
    x = torch.randn(5, D)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [0, -1]])
    w = torch.rand(5, 2)
    got = experts(x, ids, w)
    q = lambda a: torch.from_numpy(colibri.dequantize(colibri.quantize(a.reshape(-1, a.shape[-1]).numpy(), "q8_0"),
                                                      "q8_0", a.shape[-1])).reshape(a.shape)
    g, u, d = q(gate), q(up), q(down)
    want = torch.zeros(5, D)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            if e >= 0:
                h = torch.nn.functional.silu(g[e] @ x[t]) * (u[e] @ x[t])
                want[t] += w[t, j] * (d[e] @ h)
    assert rel_l2(got, want) <= 2e-2


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown dtype"):
        colibri.quantize(np.zeros((1, 32), np.float32), "q7_k")
    with pytest.raises(colibri.ColibriError, match="src holds"):
        colibri.dequantize(np.zeros((1, 10), np.uint8), "q8_0", 32)
    assert colibri.quant.row_bytes("q4_k", 300) == 288
