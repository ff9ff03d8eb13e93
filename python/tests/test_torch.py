"""colibri.torch: ColibriExperts and accelerate(model) against reference
blocks that follow each family's Hugging Face forward (reference_moe.py)."""

import copy
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn as nn

import colibri
from helpers import import_paths, needs_v2
from reference_moe import (EXPECTED_FAMILY, FAMILIES, MLP, MoEGate, Qwen3MoeSparseMoeBlock, blocks_of, init_, make_block, make_model,
                           rel_l2)

pytestmark = needs_v2

if colibri.has_open_memory():
    import colibri.torch as ct

D = 64


def first(out):
    return out[0] if isinstance(out, tuple) else out


def total_calls(report):
    return sum(m.stats.infer_calls for m in report.models)


def round_weights(model, dtype):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    return model


# ------------------------------------------------------------- accelerate


@pytest.mark.parametrize("family", FAMILIES)
def test_accelerate_f32_matches(family):
    model = make_model(family, seed=1)
    ref_model = copy.deepcopy(model)
    x = torch.randn(3, 11, D, generator=torch.Generator().manual_seed(2))
    report = ct.accelerate(model, threads=2)
    assert [b.path for b in report.accelerated] == [
        "layers.%d.%s" % (i, "block_sparse_moe" if family == "mixtral" else "mlp") for i in range(2)]
    assert {b.family for b in report.accelerated} == {EXPECTED_FAMILY[family]}
    assert report.skipped == []
    assert len(report.models) == 1 and report.models[0].info.n_layers == 2  # one pool for both blocks
    b0 = report.accelerated[0]
    assert (b0.n_experts, b0.top_k, b0.d_model, b0.d_ff, b0.dtype) == (8, 2, D, 48, "f32")
    has_shared = family.startswith("qwen2") or (family.startswith("deepseek") and family != "deepseek_v2_norm")
    assert b0.shared == ("colibri" if has_shared else None)
    assert b0.layout == ("fused" if family == "fused" else "experts")
    assert "accelerated" in str(report)
    with torch.no_grad():
        want = ref_model(x)
        got = model(x)
        assert total_calls(report) == 2
        assert rel_l2(got, want) <= 1e-5
        for blk, ref_blk in zip(blocks_of(model), blocks_of(ref_model)):
            o, r = blk(x), ref_blk(x)
            assert type(o) is type(r)  # (hidden, router_logits) or hidden, as the original
            if isinstance(r, tuple):
                assert len(o) == len(r)
                torch.testing.assert_close(o[1], r[1])  # router logits, from the block's own gate
            assert first(o).shape == first(r).shape and first(o).dtype == first(r).dtype
            assert rel_l2(first(o), first(r)) <= 1e-5
    assert model.state_dict().keys() == ref_model.state_dict().keys()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v2_group", "deepseek_v3", "fused"])
@pytest.mark.parametrize("dtype,tdtype", [("f16", torch.float16), ("bf16", torch.bfloat16)])
def test_accelerate_half_precision(family, dtype, tdtype):
    """Colibri with f16/bf16 weights against PyTorch computing in fp32 with
    the same rounded weights, and (f16) against the unrounded model."""
    model = make_model(family, seed=3)
    x = torch.randn(2, 40, D, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain_want = model(x)
        round_weights(model, tdtype)
        ref_model = copy.deepcopy(model)
        report = ct.accelerate(model, dtype=dtype, threads=2)
        assert {b.dtype for b in report.accelerated} == {dtype}
        assert rel_l2(model(x), ref_model(x)) <= 5e-3
        for blk, ref_blk in zip(blocks_of(model), blocks_of(ref_model)):
            assert rel_l2(first(blk(x)), first(ref_blk(x))) <= 5e-3
        if dtype == "f16":
            assert rel_l2(model(x), plain_want) <= 5e-3


def test_accelerate_dtype_from_weights():
    model = make_model("qwen3_moe", seed=5)
    with torch.no_grad():
        for blk in blocks_of(model):
            for e in blk.experts:
                e.half()
    report = ct.accelerate(model)
    assert {b.dtype for b in report.accelerated} == {"f16"}


def test_fallback_when_gradients_are_wanted():
    model = make_model("mixtral", seed=6)
    ref_model = copy.deepcopy(model)
    report = ct.accelerate(model, threads=2, keep_pytorch_weights=True)
    assert report.released_bytes == 0
    x = torch.randn(2, 5, D, requires_grad=True)
    out = model(x)  # autograd recording: the PyTorch path, differentiable
    assert total_calls(report) == 0
    out.sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(out, ref_model(x))
    model.train()
    with torch.no_grad():
        model(x)
    assert total_calls(report) == 0
    model.eval()
    with torch.no_grad():
        model(x)
    assert total_calls(report) == 2
    with torch.inference_mode():
        model(x)
    assert total_calls(report) == 4


def test_released_weights_and_what_restore_cannot_undo():
    """By default accelerate() empties the PyTorch copies of the weights
    Colibri took over (routed and shared experts); the PyTorch fallback and
    restore() then refuse clearly instead of computing with empty weights."""
    model = make_model("qwen2_moe", seed=9)
    ref_model = copy.deepcopy(model)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if ".experts." in n or ".shared_expert." in n)
    gates = {n: p.clone() for n, p in model.named_parameters() if "gate.weight" in n or "shared_expert_gate" in n}
    report = ct.accelerate(model, threads=2)
    assert report.released_bytes == expert_bytes > 0
    assert "MiB of PyTorch weights released" in str(report)
    for n, p in model.named_parameters():
        if ".experts." in n or ".shared_expert." in n:
            assert p.numel() == 0, n
        elif n in gates:
            assert torch.equal(p, gates[n]), n  # routers keep their weights
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        assert rel_l2(model(x), ref_model(x)) <= 1e-5
    model.train()
    with pytest.raises(RuntimeError, match="keep_pytorch_weights=True"):
        model(x)
    model.eval()
    with pytest.raises(RuntimeError, match="cannot be given back"):
        ct.restore(model)
    with torch.no_grad():  # restore() changed nothing
        assert rel_l2(model(x), ref_model(x)) <= 1e-5


def test_restore_and_accelerate_twice():
    model = make_model("qwen2_moe", seed=7)
    r1 = ct.accelerate(model, keep_pytorch_weights=True)
    r2 = ct.accelerate(model)
    assert r2.accelerated == [] and [p for p, _ in r2.skipped] == ["layers.0.mlp", "layers.1.mlp"]
    assert all("already" in why for _, why in r2.skipped)
    assert ct.restore(model) == 2
    x = torch.randn(1, 3, D)
    with torch.no_grad():
        model(x)
    assert total_calls(r1) == 0
    assert len(ct.accelerate(model).accelerated) == 2


class GeluMLP(MLP):
    def __init__(self, D_, F_):
        super().__init__(D_, F_)
        self.act_fn = nn.GELU()


class BiasedMLP(nn.Module):
    def __init__(self, D_, F_):
        super().__init__()
        self.gate_proj = nn.Linear(D_, F_)
        self.up_proj = nn.Linear(D_, F_)
        self.down_proj = nn.Linear(F_, D_)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class UnknownRule(Qwen3MoeSparseMoeBlock):
    """gate_proj/up_proj/down_proj experts whose routing rule is not stated
    by a norm_topk_prob attribute."""

    def __init__(self):
        super().__init__(D, 48, 8, 2)
        self.renorm = self.norm_topk_prob
        del self.norm_topk_prob

    def forward(self, h):
        self.norm_topk_prob = self.renorm
        try:
            return super().forward(h)
        finally:
            del self.norm_topk_prob


def test_unrecognised_blocks_are_left_alone():
    model = make_model("qwen3_moe", seed=8, n_layers=5)
    layers = model.layers
    layers[0].mlp.experts = nn.ModuleList([GeluMLP(D, 48) for _ in range(8)])
    layers[1].mlp.experts = nn.ModuleList([BiasedMLP(D, 48) for _ in range(8)])
    layers[2].mlp = UnknownRule()
    layers[3].mlp.gate = nn.Linear(D, 7, bias=False)
    init_(model, torch.Generator().manual_seed(0))
    ref_model = copy.deepcopy(model)
    report = ct.accelerate(model)
    assert [b.path for b in report.accelerated] == ["layers.4.mlp"]
    reasons = dict(report.skipped)
    assert "not SiLU" in reasons["layers.0.mlp"]
    assert "bias-free" in reasons["layers.1.mlp"]
    assert "norm_topk_prob" in reasons["layers.2.mlp"]
    assert ".gate.weight" in reasons["layers.3.mlp"]
    assert "left alone layers.0.mlp" in str(report)
    x = torch.randn(2, 4, D)
    with torch.no_grad():
        layers[3].mlp.top_k = 2
        ref_model.layers[3].mlp.top_k = 2
        assert rel_l2(model.layers[4](x), ref_model.layers[4](x)) <= 1e-5
        for i in range(3):
            torch.testing.assert_close(model.layers[i](x), ref_model.layers[i](x))


def test_accelerate_rejects_non_module():
    with pytest.raises(TypeError, match="nn.Module"):
        ct.accelerate(object())


def test_accelerate_shared_in_pytorch_option():
    model = make_model("qwen2_moe", seed=9)
    ref_model = copy.deepcopy(model)
    report = ct.accelerate(model, shared=False)
    assert {b.shared for b in report.accelerated} == {"pytorch"}
    assert report.models[0].info.shared_d_ff == 0
    x = torch.randn(2, 6, D)
    with torch.no_grad():
        assert rel_l2(model(x), ref_model(x)) <= 1e-5


def test_native_bf16_model_subprocess():
    """A model whose weights and activations are bf16 in PyTorch, with
    enough tokens for the AMX prefill kernels, PyTorch's bf16 matmuls
    (oneDNN, which releases the AMX tiles) running between Colibri calls on
    the same thread. Regression test: Colibri once configured the tiles only
    once per thread and died with SIGILL here. Run in a child process so a
    crash fails this test only."""
    code = r"""
import sys, copy, torch
sys.path[:0] = sys.argv[1:]
import colibri.torch as ct
from reference_moe import make_model, rel_l2, blocks_of
for fam in ("mixtral", "qwen2_moe", "deepseek_v3", "fused"):
    model = make_model(fam, seed=10).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 64, 64).to(torch.bfloat16)  # 64 tokens per expert: AMX prefill where present
    with torch.no_grad():
        report = ct.accelerate(model, threads=2)
        assert {b.dtype for b in report.accelerated} == {"bf16"}
        for _ in range(3):  # PyTorch bf16 matmuls and Colibri calls interleaved on one thread
            for blk, ref_blk in zip(blocks_of(model), blocks_of(ref)):
                got, want = blk(x), ref_blk(x)
                got, want = (got[0], want[0]) if isinstance(got, tuple) else (got, want)
                assert got.dtype == torch.bfloat16
                # PyTorch rounds every intermediate to bf16 (Colibri accumulates in
                # fp32), which alone puts the two about 5e-3 apart.
                assert rel_l2(got, want) <= 1.5e-2, (fam, rel_l2(got, want))
        got_model, want_model = model(x), ref(x)
        assert got_model.dtype == torch.bfloat16 and got_model.shape == want_model.shape
    print(fam, report.models[0].kernels)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code, *import_paths()], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, "child exited with %d (%s)\nstdout: %s\nstderr: %s" % (
        r.returncode, "SIGILL: AMX tile state lost between calls?" if r.returncode == -4 else "",
        r.stdout[-2000:], r.stderr[-4000:])
    assert r.stdout.strip().endswith("ok")


# -------------------------------------------------------- built-in router


def reference_choice(family, block, x):
    """The family's expert choice in float64 and, per token, the margin by
    which it was made (near-ties could go either way in float32)."""
    x = x.double().reshape(-1, D)
    w = block.gate.weight.double()
    logits = x @ w.T
    N, E = logits.shape
    k = block.gate.top_k if hasattr(block.gate, "top_k") else block.top_k
    margins = []
    if family.startswith("deepseek_v3"):
        s = torch.sigmoid(logits)
        c = s + block.gate.e_score_correction_bias.double()
    else:
        c = torch.softmax(logits, -1)
    if family.startswith("deepseek") and block.gate.n_group > 1 and block.gate.topk_method != "greedy":
        G, kg = block.gate.n_group, block.gate.topk_group
        grouped = c.view(N, G, -1)
        gs = grouped.topk(2, -1)[0].sum(-1) if family.startswith("deepseek_v3") else grouped.max(-1).values
        gsorted = gs.sort(-1, descending=True).values
        margins.append(gsorted[:, kg - 1] - gsorted[:, kg])
        keep = torch.zeros_like(gs).scatter_(1, gs.topk(kg, -1)[1], 1.0)
        mask = keep.unsqueeze(-1).expand(N, G, E // G).reshape(N, E).bool()
        c = c.masked_fill(~mask, float("-inf"))
    cs = c.sort(-1, descending=True).values
    margins.append(cs[:, k - 1] - cs[:, k])
    ids = c.topk(k, -1)[1]
    return ids.sort(-1).values, torch.stack(margins).min(0).values


@pytest.mark.parametrize("family", FAMILIES)
def test_builtin_router_matches_reference(family):
    model = make_model(family, seed=11, n_layers=1, gate_scale=3.0)
    block = blocks_of(model)[0]
    x = torch.randn(1, 200, D, generator=torch.Generator().manual_seed(12))
    want_ids, margin = reference_choice(family, block, x)
    clear = margin > 1e-4
    assert int(clear.sum()) >= 150  # most tokens are far from a tie
    xs = x[:, clear]
    experts = ct.ColibriExperts.from_moe_block(block, threads=2)
    info = experts.colibri_model.info
    assert info.router_family == EXPECTED_FAMILY[family] and info.router_top_k == 2
    with torch.no_grad():
        want = first(block(xs))
        got = experts(xs)  # no ids: Colibri's built-in router
    assert got.shape == want.shape
    assert rel_l2(got, want) <= 1e-5
    ids, w = experts.route(xs.reshape(-1, D))
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.long().sort(-1).values, want_ids[clear])
    # and the routed weights are the family's: same output through explicit ids
    with torch.no_grad():
        assert rel_l2(experts(xs.reshape(-1, D), ids, w), want.reshape(-1, D)) <= 1e-5


# ---------------------------------------------------------- ColibriExperts


def expert_reference(x, gate, up, down, ids, w):
    out = torch.zeros(x.shape[0], down[0].shape[0], dtype=torch.float64)
    xd = x.double()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = torch.nn.functional.silu(gate[e].double() @ xd[t]) * (up[e].double() @ xd[t])
            out[t] += float(w[t, j]) * (down[e].double() @ h)
    return out


def random_expert_tensors(E=6, D_=D, F_=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(E, F_, D_, generator=g) / D_**0.5
    up = torch.randn(E, F_, D_, generator=g) / D_**0.5
    down = torch.randn(E, D_, F_, generator=g) / F_**0.5
    return gate, up, down


def test_colibri_experts_constructors_agree():
    gate, up, down = random_expert_tensors()
    x = torch.randn(9, D)
    ids = torch.stack([torch.randperm(6)[:3] for _ in range(9)])
    ids[0, 2] = -1
    w = torch.rand(9, 3)
    want = expert_reference(x, gate, up, down, ids, w)
    mods = [
        ct.ColibriExperts(list(gate), list(up), list(down)),
        ct.ColibriExperts(gate, up, down, threads=1),
        ct.ColibriExperts(gate_up_proj=torch.cat([gate, up], 1), down_proj=down),
    ]
    for m in mods:
        assert isinstance(m, nn.Module) and len(m.state_dict()) == 0 and not list(m.parameters())
        assert (m.n_experts, m.d_model, m.d_ff, m.dtype_name) == (6, D, 40, "f32")
        with torch.no_grad():
            y = m(x, ids, w)
        assert y.dtype == torch.float32 and y.shape == (9, D)
        assert rel_l2(y, want) <= 1e-5
        assert rel_l2(m(x, ids.int(), w), want) <= 1e-5
        assert "experts=6" in repr(m)
    # [..., D] inputs and other float dtypes come back in their shape and dtype
    y3 = mods[0](x.reshape(3, 3, D), ids.reshape(3, 3, 3), w.reshape(3, 3, 3))
    assert y3.shape == (3, 3, D)
    yb = mods[0](x.bfloat16(), ids, w.bfloat16())
    assert yb.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype,tol", [("f16", 5e-3), (torch.float16, 5e-3), ("bf16", 1e-2), ("f32", 1e-5)])
def test_colibri_experts_dtypes(dtype, tol):
    gate, up, down = random_expert_tensors(seed=1)
    x = torch.randn(20, D)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(20)])
    w = torch.rand(20, 2)
    m = ct.ColibriExperts(gate, up, down, dtype=dtype)
    assert m.dtype_name == {"f16": "f16", torch.float16: "f16", "bf16": "bf16", "f32": "f32"}[dtype]
    assert rel_l2(m(x, ids, w), expert_reference(x, gate, up, down, ids, w)) <= tol
    mb = ct.ColibriExperts(gate.bfloat16(), up.bfloat16(), down.bfloat16())  # dtype from the weights
    assert mb.dtype_name == "bf16"


def test_colibri_experts_shared_expert():
    gate, up, down = random_expert_tensors(seed=2)
    sg, su, sd = (t[0] for t in random_expert_tensors(E=1, F_=24, seed=3))
    gvec = torch.randn(1, D) / D**0.5
    x = torch.randn(7, D)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(7)])
    w = torch.rand(7, 2)
    routed = expert_reference(x, gate, up, down, ids, w)
    shared = expert_reference(x, sg[None], su[None], sd[None], torch.zeros(7, 1, dtype=torch.long), torch.ones(7, 1))
    m = ct.ColibriExperts(gate, up, down, shared=(sg, su, sd))
    assert m.colibri_model.info.shared_d_ff == 24
    assert rel_l2(m(x, ids, w), routed + shared) <= 1e-5
    m = ct.ColibriExperts(gate, up, down, shared=(sg, su, sd), shared_gate=gvec)
    s = torch.sigmoid(x.double() @ gvec.double().T)
    assert rel_l2(m(x, ids, w), routed + s * shared) <= 1e-5


def test_colibri_experts_keeps_no_weight_references():
    gate, up, down = random_expert_tensors(seed=4)
    refs = [weakref.ref(t) for t in (gate, up, down)]
    m = ct.ColibriExperts(gate, up, down)
    x, ids, w = torch.randn(3, D), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    want = m(x, ids, w)
    del gate, up, down
    assert all(r() is None for r in refs)  # Colibri copied the weights at open
    torch.testing.assert_close(m(x, ids, w), want)


def test_colibri_experts_errors():
    gate, up, down = random_expert_tensors(seed=5)
    with pytest.raises(ValueError, match="needs gate, up and down"):
        ct.ColibriExperts(gate, up)
    with pytest.raises(ValueError, match="not both"):
        ct.ColibriExperts(gate, up, down, gate_up_proj=torch.cat([gate, up], 1))
    with pytest.raises(ValueError, match="same number"):
        ct.ColibriExperts(gate, up[:5], down)
    with pytest.raises(ValueError, match=r"down must have shape \[64, 40\]"):
        ct.ColibriExperts(gate, up, down[:, :, :39])
    with pytest.raises(ValueError, match="dtype"):
        ct.ColibriExperts(gate, up, down, dtype="int8")
    with pytest.raises(ValueError, match="router_config"):
        ct.ColibriExperts(gate, up, down, router=torch.zeros(6, D))
    m = ct.ColibriExperts(gate, up, down)
    x = torch.randn(2, D)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 64\]"):
        m(torch.randn(2, D + 1), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1))
    with pytest.raises(TypeError, match="ids must be int32 or int64"):
        m(x, torch.zeros(2, 1), torch.ones(2, 1))
    with pytest.raises(ValueError, match="weights given without ids"):
        m(x, None, torch.ones(2, 1))
    with pytest.raises(colibri.ColibriError, match="router"):
        m(x)  # no built-in router
    with pytest.raises(colibri.ColibriError, match="out of range"):
        m(x, torch.full((2, 1), 6), torch.ones(2, 1))
    m.close()
    with pytest.raises(ValueError, match="closed"):
        m(x, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1))
    with pytest.raises(ValueError, match="not a recognised MoE block"):
        ct.ColibriExperts.from_moe_block(nn.Linear(3, 3))


def test_colibri_experts_warns_about_gradients():
    gate, up, down = random_expert_tensors(seed=6)
    m = ct.ColibriExperts(gate, up, down)
    x = torch.randn(2, D, requires_grad=True)
    ct._grad_warned = False
    with pytest.warns(UserWarning, match="no gradients"):
        y = m(x, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1))
    assert not y.requires_grad


def test_recognise_reports_families():
    for fam in FAMILIES:
        spec = ct.recognise(make_block(fam))
        assert not isinstance(spec, str), spec
        assert spec.family == EXPECTED_FAMILY[fam]
    assert ct.recognise(nn.Linear(2, 2)) == "no .experts"
    gate = MoEGate(D, 8, 2, 2)
    gate.scoring_func = "sigmoid"
    blk = make_block("deepseek_v2")
    blk.gate = gate
    assert "not a known combination" in ct.recognise(blk)


def test_deepcopy_of_accelerated_model():
    import pickle

    model = make_model("deepseek_v3", seed=13)
    ref_model = copy.deepcopy(model)
    report = ct.accelerate(model, threads=2, keep_pytorch_weights=True)
    twin = copy.deepcopy(model)  # shares the Colibri model, routes with its own gates
    x = torch.randn(2, 7, D)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), model(x))
        assert total_calls(report) == 4
        for g in (blk.gate for blk in blocks_of(twin)):
            g.weight.mul_(-1.0)  # the twin's routing changes, not the original's
        for g in (blk.gate for blk in blocks_of(ref_model)):
            g.weight.mul_(-1.0)
        assert rel_l2(twin(x), ref_model(x)) <= 1e-5
        assert rel_l2(model(x), twin(x)) > 1e-3
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(report.models[0])
    assert ct.restore(twin) == 2 and ct.restore(model) == 2
