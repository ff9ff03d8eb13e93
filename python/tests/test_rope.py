"""colibri.rope: each family's apply_rotary_pos_emb through colibri_rope
gives the original's result to the bit, at the shapes the attention
forwards pass (query and key heads viewed from [B, T, H, D], a batch of
positions, the one-token decode step), and falls back to the original
where it does not apply (autograd, other dtypes, extra arguments)."""

import importlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import colibri.rope as cr  # noqa: E402


def family_function(family):
    module = importlib.import_module("transformers.models.%s.modeling_%s" % (family, family))
    fn = module.apply_rotary_pos_emb
    return getattr(fn, "__wrapped__", fn) if getattr(fn, "_colibri_style", None) else fn


def inputs(style, B, T, D, seed):
    g = torch.Generator().manual_seed(seed)
    C = {"full": D, "partial": D // 2, "half": D // 2}[style]
    q = torch.randn(B, T, 6, D, generator=g).transpose(1, 2)
    k = torch.randn(B, T, 2, D, generator=g).transpose(1, 2)
    angles = torch.randn(1, T, C, generator=g) * 5  # one table for the batch, as the rotary modules give
    return q, k, angles.cos(), angles.sin()


@pytest.mark.parametrize("family", sorted(cr._STYLES))
def test_every_family_matches_its_own_function_to_the_bit(family):
    original = family_function(family)
    style = cr._STYLES[family]
    ours = cr._replacement(original, style)
    for B, T, D in ((1, 1, 128), (2, 7, 64), (3, 16, 96)):
        q, k, cos, sin = inputs(style, B, T, D, B * 100 + T)
        with torch.no_grad():
            want = original(q, k, cos, sin)
            got = ours(q, k, cos, sin)
        for a, b in zip(got, want):
            # The same layout (a size-1 dimension's stride is immaterial).
            assert a.shape == b.shape
            assert [st for st, n in zip(a.stride(), a.shape) if n > 1] == [st for st, n in zip(b.stride(), b.shape)
                                                                           if n > 1]
            assert torch.equal(a, b), (family, B, T, D, (a - b).abs().max())


def test_falls_back_where_it_does_not_apply(monkeypatch):
    original = family_function("qwen3_moe")
    ours = cr._replacement(original, "full")
    calls = []
    inner = cr.rope
    monkeypatch.setattr(cr, "rope", lambda *a, **k: calls.append(1) or inner(*a, **k))
    q, k, cos, sin = inputs("full", 1, 3, 64, 1)
    with torch.no_grad():
        ours(q, k, cos, sin)
    assert len(calls) == 2
    calls.clear()
    qg = q.clone().requires_grad_(True)
    out = ours(qg, k, cos, sin)  # autograd: the original's operators
    assert out[0].requires_grad and not calls
    ours(q.double(), k.double(), cos.double(), sin.double())
    ours(q, k, cos, sin, unsqueeze_dim=1)
    assert not calls


def test_install_replaces_only_a_function_it_reproduces(monkeypatch):
    module = importlib.import_module("transformers.models.mixtral.modeling_mixtral")
    original = family_function("mixtral")
    monkeypatch.setattr(module, "apply_rotary_pos_emb", original)

    class Attn(torch.nn.Module):
        layer_idx = 0
        o_proj = None

    Attn.__module__ = module.__name__
    model = torch.nn.Sequential(Attn())
    assert cr.install(model) == "full"
    assert module.apply_rotary_pos_emb._colibri_style == "full"
    assert cr.install(model) == "full"  # once
    # A function that computes something else is left alone.
    monkeypatch.setattr(module, "apply_rotary_pos_emb", lambda q, k, cos, sin, **kw: (q * cos, k * cos))
    assert cr.install(model) is None
