"""Colibri as transformers 5's "colibri" experts implementation
(colibri.experts_backend), on the real classes. Skipped on transformers 4."""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("experts implementations need transformers 5", allow_module_level=True)

import colibri.experts_backend as cb  # noqa: E402
from test_transformers_models import FAMILIES, build, input_ids, logits, rel_l2  # noqa: E402


def colibri_calls(model):
    n = 0
    for m in model.modules():
        cached = m.__dict__.get(cb._CACHE)
        if cached is not None and cached[1] is not None:
            n += cached[1].colibri_model.stats.infer_calls
    return n


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert cb.register(threads=2) is True  # 5.6+ accept registered names


@pytest.mark.parametrize("family", FAMILIES)
def test_colibri_implementation_matches_eager(family):
    ref_model = build(family)
    ref_model.set_experts_implementation("eager")
    model = copy.deepcopy(ref_model)
    model.set_experts_implementation("colibri")
    ids = input_ids()
    assert rel_l2(logits(model, ids), logits(ref_model, ids)) <= 1e-5
    prompt = ids[:1, :6]
    with torch.inference_mode():
        want = ref_model.generate(prompt, do_sample=False, max_new_tokens=16, min_new_tokens=16, pad_token_id=0)
        got = model.generate(prompt, do_sample=False, max_new_tokens=16, min_new_tokens=16, pad_token_id=0)
    assert torch.equal(got, want)
    st = cb.status(model)
    assert len(st) >= 2 and all(s == "colibri" for _, s, _ in st), st
    assert colibri_calls(model) > 0


def test_from_config_and_fallbacks():
    cfg = build("qwen3_moe").config
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="colibri")
    assert model.config._experts_implementation == "colibri"
    ref = build("qwen3_moe")
    model.load_state_dict(ref.state_dict())
    model.eval()
    ref.set_experts_implementation("eager")
    ids = input_ids()
    assert rel_l2(logits(model, ids), logits(ref, ids)) <= 1e-5
    calls = colibri_calls(model)
    # autograd: the eager forward, differentiable
    out = model(ids).logits
    out.float().sum().backward()
    assert model.model.layers[0].mlp.experts.gate_up_proj.grad is not None
    assert colibri_calls(model) == calls
    # training mode: eager too
    model.train()
    with torch.no_grad():
        model(ids)
    assert colibri_calls(model) == calls
    model.eval()
    # weights changed in place: a new Colibri copy, not stale results
    with torch.no_grad():
        for m in (model, ref):
            m.model.layers[1].mlp.experts.down_proj.mul_(-2.0)
    assert rel_l2(logits(model, ids), logits(ref, ids)) <= 1e-5


def test_no_expert_sentinel_ids():
    model = build("mixtral")
    experts = model.model.layers[0].mlp.experts
    E = experts.num_experts
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, experts.hidden_dim, generator=g)
    ids = torch.randint(0, E, (9, 2), generator=g)
    ids[::3, 1] = E  # expert parallelism's "no expert here"
    w = torch.rand(9, 2, generator=g)
    with torch.inference_mode():
        want = cb._eager(experts)(x, ids, w)
        got = cb.experts_forward(experts, x, ids, w)
    assert rel_l2(got, want) <= 1e-5


def test_a_module_it_cannot_compute_runs_eager_with_a_reason():
    model = build("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    experts.limit = 7.0  # a clamped-SwiGLU marker: not what the engine computes

    class PlusOneGate(type(experts)):
        def _apply_gate(self, gate_up_out):
            gate, up = gate_up_out.chunk(2, dim=-1)
            return self.act_fn(gate) * (up + 1)

    model.model.layers[1].mlp.experts.__class__ = PlusOneGate
    ref = copy.deepcopy(model)
    ref.set_experts_implementation("eager")
    model.set_experts_implementation("colibri")
    ids = input_ids()
    with pytest.warns(UserWarning, match="runs its eager forward"):
        got = logits(model, ids)
    assert rel_l2(got, logits(ref, ids)) <= 1e-6
    st = {p: (s, why) for p, s, why in cb.status(model)}
    assert st["model.layers.0.mlp.experts"][0] == "eager" and "gating variant" in st["model.layers.0.mlp.experts"][1]
    assert st["model.layers.1.mlp.experts"][0] == "eager" and "_apply_gate" in st["model.layers.1.mlp.experts"][1]


def test_versions_whose_name_check_knows_only_builtins(monkeypatch):
    """transformers 5.0-5.5 accept only their built-in names: simulated here by
    their check; set_experts_implementation() then sets the configs, which
    their dispatch (ALL_EXPERTS_FUNCTIONS[name]) honours."""
    def old_check(self, requested):
        name = "grouped_mm" if requested is None else requested
        if name not in ["eager", "grouped_mm", "batched_mm"]:
            raise ValueError('Specified `experts_implementation="%s"` is not supported.' % name)
        return name

    monkeypatch.setattr(transformers.PreTrainedModel, "get_correct_experts_implementation", old_check)
    assert cb.accepts_name() is False
    model = build("olmoe")
    ref = copy.deepcopy(model)
    ref.set_experts_implementation("eager")
    with pytest.raises(ValueError, match="not supported"):
        model.set_experts_implementation("colibri")
    cb.set_experts_implementation(model)
    assert model.config._experts_implementation == "colibri"
    ids = input_ids()
    assert rel_l2(logits(model, ids), logits(ref, ids)) <= 1e-5
    assert colibri_calls(model) > 0
