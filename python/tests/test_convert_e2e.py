"""colibri convert end to end: small Hugging Face checkpoints of every family,
written here in the family's own tensor naming by a minimal safetensors writer,
converted by the CLI, then run through the engine's built-in router (and
shared expert) and compared with the reference blocks of reference_moe.py.

Each case builds reference MoE blocks with random weights of realistic scale,
places them at the family's MoE layer indices of a tiny decoder (dense MLP,
attention, norm and embedding tensors beside them must be ignored), writes
config.json + model.safetensors (or two shards and an index), converts with
`colibri convert --hf DIR --out OUT --dtype ...`, and checks:

- the manifest and Model.info (router family, top_k, shared_d_ff, which HF
  layers became Colibri layers);
- Model.infer(x, layer=j) with no routing (built-in router + shared expert)
  against the reference block's hidden-states output, T in {1, 7, 64};
- Model.route(x, layer=j) against the reference's expert sets;
- `colibri infer` without --routing on one model.
"""

import copy
import dataclasses
import json
import os
import struct
import subprocess
from typing import Optional

import numpy as np
import pytest
import torch

import colibri
from helpers import find_cli, needs_v2
from reference_moe import blocks_of, make_model, reference_selection, rel_l2

pytestmark = needs_v2

D, F_, E, K = 64, 48, 8, 2
VOCAB = 96
TOKENS = (1, 7, 64)

# A choice whose deciding scores differ by less than this may go either way
# in float32; such inputs are redrawn (never a looser tolerance).
TIE = 1e-4
TOL_F32 = 1e-5
# bf16 experts: Colibri computes with the bf16 weights as stored but, on CPUs
# with AVX512_BF16 / AMX, also rounds the activations (x, then h = silu(g)*u)
# to bf16 (8 significant bits, relative error <= 2^-8 = 3.9e-3 each, spread
# over both signs), docs/PRECISION.md: about 3e-3 relative L2 per layer,
# 3.5e-3 at worst in the engine tests. The reference holds the same
# bf16-rounded weights in float64, so only that activation rounding remains;
# 5e-3 (the engine tests' bound) holds here.
TOL_BF16 = 5e-3


# ------------------------------------------------------------- safetensors


def tensor_bytes(t, dtype):
    t = t.detach().contiguous()
    if dtype == "F32":
        return t.to(torch.float32).numpy().astype("<f4").tobytes()
    if dtype == "BF16":
        return t.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
    if dtype == "F16":
        return t.to(torch.float16).numpy().astype("<f2").tobytes()
    raise ValueError(dtype)


def write_safetensors(path, tensors):
    """tensors: [(name, tensor, dtype)] written in that order: an 8-byte
    little-endian header length, the JSON header (padded with spaces to a
    multiple of 8, as the reference writer does), then the raw bytes."""
    header = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, t, dtype in tensors:
        b = tensor_bytes(t, dtype)
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def write_checkpoint(directory, config, tensors, sharded, seed):
    """config.json and model.safetensors, or (sharded) two shards in a
    shuffled split with model.safetensors.index.json."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    order = np.random.default_rng(seed).permutation(len(tensors))  # the reader must not rely on order
    tensors = [tensors[i] for i in order]
    if not sharded:
        write_safetensors(os.path.join(directory, "model.safetensors"), tensors)
        return
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    # tensors split between the shards one by one: a layer's experts straddle both
    parts = [tensors[0::2], tensors[1::2]]
    weight_map = {}
    for name, part in zip(names, parts):
        write_safetensors(os.path.join(directory, name), part)
        weight_map.update({t[0]: name for t in part})
    total = sum(len(tensor_bytes(t, dt)) for _, t, dt in tensors)
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


# -------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    ref: str  # reference_moe family (make_model)
    model_type: str
    n_hidden: int
    moe_layers: tuple  # the HF indices convert must pick
    config: dict  # the family's fields
    ckpt_dtype: str = "F32"  # of the checkpoint's tensors
    sharded: bool = False
    dtypes: tuple = ("f32",)  # colibri convert --dtype values to test
    block: str = "mlp"  # model.layers.{i}.<block>
    fused_suffix: str = ""  # "" or ".weight" on the fused tensors
    shared_d_ff: int = 0
    shared_gate: bool = False
    router: Optional[dict] = None  # expected manifest router fields besides family/top_k
    seed: int = 0
    E: int = E
    K: int = K


CASES = [
    Case("mixtral", "mixtral", "mixtral", 2, (0, 1),
         {"intermediate_size": F_, "router_aux_loss_coef": 0.02},
         dtypes=("f32", "bf16"), block="block_sparse_moe", router={"norm_topk_prob": True}, seed=1),
    Case("qwen2_moe", "qwen2_moe", "qwen2_moe", 4, (0, 2, 3),
         {"moe_intermediate_size": F_, "intermediate_size": 80,
          "shared_expert_intermediate_size": 2 * F_ + 16, "norm_topk_prob": False,
          "decoder_sparse_step": 1, "mlp_only_layers": [1]},
         ckpt_dtype="BF16", sharded=True, shared_d_ff=2 * F_ + 16, shared_gate=True,
         router={"norm_topk_prob": False}, seed=2),
    Case("qwen2_moe_norm", "qwen2_moe_norm", "qwen2_moe", 6, (1, 5),
         {"moe_intermediate_size": F_, "intermediate_size": 80,
          "shared_expert_intermediate_size": F_, "norm_topk_prob": True,
          "decoder_sparse_step": 2, "mlp_only_layers": [3]},
         shared_d_ff=F_, shared_gate=True, router={"norm_topk_prob": True}, seed=3),
    Case("qwen3_moe", "qwen3_moe", "qwen3_moe", 3, (1, 2),  # 12 experts, top-3
         {"moe_intermediate_size": F_, "intermediate_size": 80, "norm_topk_prob": True,
          "decoder_sparse_step": 1, "mlp_only_layers": [0]},
         ckpt_dtype="BF16", router={"norm_topk_prob": True}, seed=4, E=12, K=3),
    Case("olmoe", "olmoe", "olmoe", 2, (0, 1),  # norm_topk_prob absent: false
         {"intermediate_size": F_},
         sharded=True, router={"norm_topk_prob": False}, seed=5),
    Case("deepseek_v2", "deepseek_v2", "deepseek_v2", 3, (1, 2),  # greedy: the groups are ignored
         {"moe_intermediate_size": F_, "intermediate_size": 80, "n_shared_experts": 2,
          "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 4,
          "topk_group": 2, "routed_scaling_factor": 1.5, "norm_topk_prob": False, "scoring_func": "softmax"},
         shared_d_ff=2 * F_, router={"norm_topk_prob": False, "n_group": 1, "routed_scaling_factor": 1.5},
         seed=6),
    # 16 experts in 4 groups, 2 groups kept, top-4: with top_k <= topk_group the group limit would never
    # change the greedy choice (the best groups hold the best experts)
    Case("deepseek_v2_group", "deepseek_v2_group", "deepseek_v2", 5, (2, 4),
         {"moe_intermediate_size": F_, "intermediate_size": 80, "n_shared_experts": 1,
          "first_k_dense_replace": 1, "moe_layer_freq": 2, "topk_method": "group_limited_greedy", "n_group": 4,
          "topk_group": 2, "routed_scaling_factor": 2.0, "norm_topk_prob": False, "scoring_func": "softmax"},
         ckpt_dtype="BF16", sharded=True, shared_d_ff=F_,
         router={"norm_topk_prob": False, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.0}, seed=7,
         E=16, K=4),
    Case("deepseek_v2_norm", "deepseek_v2_norm", "deepseek_v2", 2, (1,),  # n_shared_experts null: none
         {"moe_intermediate_size": F_, "intermediate_size": 80, "n_shared_experts": None,
          "first_k_dense_replace": 1, "topk_method": "greedy", "norm_topk_prob": True},
         router={"norm_topk_prob": True, "n_group": 1}, seed=8),
    Case("deepseek_v3", "deepseek_v3", "deepseek_v3", 3, (1, 2),
         {"moe_intermediate_size": F_, "intermediate_size": 80, "n_shared_experts": 1,
          "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "noaux_tc", "n_group": 4,
          "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid"},
         ckpt_dtype="BF16", sharded=True, dtypes=("f32", "bf16"), shared_d_ff=F_,
         router={"norm_topk_prob": True, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}, seed=9),
    Case("deepseek_v3_nonorm", "deepseek_v3_nonorm", "deepseek_v3", 2, (1,),  # topk_method, scoring_func: defaults
         {"moe_intermediate_size": F_, "intermediate_size": 80, "n_shared_experts": 1,
          "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.0,
          "norm_topk_prob": False},
         shared_d_ff=F_, router={"norm_topk_prob": False, "n_group": 2, "topk_group": 1}, seed=10),
    # transformers v5's fused layout: experts.gate_up_proj [E, 2F, D] (gate rows first), experts.down_proj [E, D, F]
    Case("fused_mixtral", "fused", "mixtral", 2, (0, 1),
         {"intermediate_size": F_}, router={"norm_topk_prob": True}, seed=11),
    Case("fused_qwen3_bf16", "fused", "qwen3_moe", 2, (0, 1),  # TopKRouter renormalises: norm_topk_prob true
         {"moe_intermediate_size": F_, "intermediate_size": 80, "norm_topk_prob": True},
         ckpt_dtype="BF16", sharded=True, fused_suffix=".weight", router={"norm_topk_prob": True}, seed=12),
]
CASE = {c.name: c for c in CASES}


EXPERTS_FIELD = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts", "qwen3_moe": "num_experts",
                 "olmoe": "num_experts", "deepseek_v2": "n_routed_experts", "deepseek_v3": "n_routed_experts"}


def hf_config(case):
    cfg = {"architectures": ["TinyForCausalLM"], "model_type": case.model_type, "hidden_size": D,
           "num_hidden_layers": case.n_hidden, "num_experts_per_tok": case.K, EXPERTS_FIELD[case.model_type]: case.E,
           "num_attention_heads": 4, "vocab_size": VOCAB, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16" if case.ckpt_dtype == "BF16" else "float32"}
    cfg.update(case.config)
    return cfg


def moe_tensors(case, i, blk, mutation=None):
    """{HF name: parameter} of the reference block `blk` placed at decoder
    layer i, in the family's naming (written out here, not taken from the
    module's attribute names)."""
    B = "model.layers.%d.%s" % (i, case.block)
    out = {B + ".gate.weight": blk.gate.weight}
    if case.ref == "fused":
        out[B + ".experts.gate_up_proj" + case.fused_suffix] = blk.experts.gate_up_proj
        out[B + ".experts.down_proj" + case.fused_suffix] = blk.experts.down_proj
        return out
    if case.model_type == "mixtral":
        names = {"gate": "w1", "up": "w3", "down": "w2"}
    else:
        names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    if mutation == "swap_gate_up":
        names["gate"], names["up"] = names["up"], names["gate"]
    for j, e in enumerate(blk.experts):
        if case.model_type == "mixtral":
            mats = {"gate": e.w1.weight, "up": e.w3.weight, "down": e.w2.weight}
        else:
            mats = {"gate": e.gate_proj.weight, "up": e.up_proj.weight, "down": e.down_proj.weight}
        for role, w in mats.items():
            out["%s.experts.%d.%s.weight" % (B, j, names[role])] = w
    if case.model_type == "qwen2_moe":
        for p in ("gate_proj", "up_proj", "down_proj"):
            out["%s.shared_expert.%s.weight" % (B, p)] = getattr(blk.shared_expert, p).weight
        out[B + ".shared_expert_gate.weight"] = blk.shared_expert_gate.weight
    if case.model_type.startswith("deepseek"):
        if getattr(blk, "shared_experts", None) is not None:
            for p in ("gate_proj", "up_proj", "down_proj"):
                out["%s.shared_experts.%s.weight" % (B, p)] = getattr(blk.shared_experts, p).weight
        if hasattr(blk.gate, "e_score_correction_bias"):
            out[B + ".gate.e_score_correction_bias"] = blk.gate.e_score_correction_bias
    return out


def other_tensors(case, gen):
    """Embedding, attention, norms, lm_head and the dense MLP of non-MoE
    layers: all must be ignored."""
    r = lambda *s: torch.randn(*s, generator=gen) / s[-1] ** 0.5  # noqa: E731
    out = {"model.embed_tokens.weight": r(VOCAB, D), "model.norm.weight": torch.ones(D), "lm_head.weight": r(VOCAB, D)}
    dense_ff = case.config.get("intermediate_size", 80)
    for i in range(case.n_hidden):
        L = "model.layers.%d." % i
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[L + "self_attn.%s.weight" % p] = r(D, D)
        out[L + "input_layernorm.weight"] = torch.ones(D)
        out[L + "post_attention_layernorm.weight"] = torch.ones(D)
        if i not in case.moe_layers:  # a dense layer: mlp.{gate,up,down}_proj, not mlp.gate / mlp.experts
            out[L + "mlp.gate_proj.weight"] = r(dense_ff, D)
            out[L + "mlp.up_proj.weight"] = r(dense_ff, D)
            out[L + "mlp.down_proj.weight"] = r(D, dense_ff)
    return out


def round_bf16_(params):
    with torch.no_grad():
        for p in params:
            p.copy_(p.to(torch.bfloat16).float())


def expert_params(blk):
    """The parameters Colibri stores in the model's dtype: routed and shared
    experts (the router, its bias and Qwen2's shared gate stay f32)."""
    mods = [blk.experts] + [getattr(blk, a) for a in ("shared_expert", "shared_experts")
                            if getattr(blk, a, None) is not None]
    return [p for m in mods for p in m.parameters()]


def build_checkpoint(case, directory, mutation=None):
    """Writes the checkpoint; returns {HF layer index: reference block} with
    exactly the weights written (bf16-rounded where the checkpoint is BF16)."""
    model = make_model(case.ref, seed=case.seed, n_layers=len(case.moe_layers), D=D, F_=F_, E=case.E, k=case.K)
    blocks = dict(zip(case.moe_layers, blocks_of(model)))
    tensors = []
    for i, blk in blocks.items():
        for name, p in moe_tensors(case, i, blk, mutation).items():
            # DeepSeek-V3 checkpoints keep e_score_correction_bias in F32 beside BF16 weights
            dt = "F32" if name.endswith("e_score_correction_bias") else case.ckpt_dtype
            if dt == "BF16":
                round_bf16_([p])  # the reference holds what the file holds
            tensors.append((name, p, dt))
    gen = torch.Generator().manual_seed(1000 + case.seed)
    for n, (name, t) in enumerate(other_tensors(case, gen).items()):
        tensors.append((name, t, ("BF16", "F32", "F16")[n % 3]))
    write_checkpoint(directory, hf_config(case), tensors, case.sharded, case.seed)
    return blocks


def convert(hf_dir, out_dir, dtype, extra=()):
    cli = find_cli()
    if cli is None:
        pytest.skip("colibri CLI not found: build target colibri_cli and set COLIBRI_CLI")
    args = [cli, "convert", "--hf", str(hf_dir), "--out", str(out_dir)] + (["--dtype", dtype] if dtype else [])
    r = subprocess.run(args + list(extra), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, "colibri convert failed (%d)\nstdout: %s\nstderr: %s" % (
        r.returncode, r.stdout, r.stderr)
    return r


_built = {}


def converted(name, dtype, tmp_path_factory):
    """(case, blocks, out_dir): the case's checkpoint, written once, converted once per dtype."""
    case = CASE[name]
    if name not in _built:
        hf = tmp_path_factory.mktemp("hf_" + name)
        _built[name] = (hf, build_checkpoint(case, str(hf)))
    hf, blocks = _built[name]
    key = (name, dtype)
    if key not in _built:
        out = tmp_path_factory.mktemp("out_%s_%s" % (name, dtype)) / "model"
        convert(hf, out, dtype)
        _built[key] = out
    return case, blocks, _built[key]


def reference_block(blk, dtype):
    """The reference in float64, holding the weights as the converted model
    stores them (experts rounded to bf16 for a bf16 model)."""
    ref = copy.deepcopy(blk)
    if dtype == "bf16":
        round_bf16_(expert_params(ref))
    return ref.double().eval()


def reference_forward(ref, x):
    with torch.no_grad():
        out = ref(x.double().unsqueeze(0))
    out = out[0] if isinstance(out, tuple) else out
    return out.squeeze(0)


def clear_input(blk, T, seed):
    """x [T, D] float32 on which the reference's choice is nowhere near a
    tie (redrawn otherwise), and the reference's expert sets."""
    for attempt in range(100):
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(seed * 7919 + attempt))
        ids, margin = reference_selection(blk, x)
        if float(margin.min()) >= TIE:
            return x, ids
    pytest.fail("no input without a near-tie in 100 draws (T=%d)" % T)


PARAMS = [pytest.param(c.name, d, id="%s-%s" % (c.name, d)) for c in CASES for d in c.dtypes]


# -------------------------------------------------------------------- tests


@pytest.mark.parametrize("name,dtype", PARAMS)
def test_convert_manifest_and_info(name, dtype, tmp_path_factory):
    case, blocks, out = converted(name, dtype, tmp_path_factory)
    manifest = json.loads((out / "colibri.json").read_text())
    assert manifest["version"] == 2
    assert manifest["source"] == {"format": "hf", "model_type": case.model_type, "layers": list(case.moe_layers)}
    r = manifest["router"]
    assert r["family"] == case.model_type and r["top_k"] == case.K
    defaults = {"norm_topk_prob": case.model_type == "mixtral", "n_group": 1, "topk_group": 1,
                "routed_scaling_factor": 1.0}
    for key, want in (case.router or {}).items():
        assert r.get(key, defaults[key]) == want, key
    if case.shared_d_ff:
        assert manifest["shared_expert"]["d_ff"] == case.shared_d_ff
        assert manifest["shared_expert"].get("gate", False) == case.shared_gate
    else:
        assert "shared_expert" not in manifest
    with colibri.Model(str(out), threads=2) as m:
        info = m.info
        assert (info.n_layers, info.n_experts, info.d_model, info.d_ff) == (len(case.moe_layers), case.E, D, F_)
        assert info.dtype == dtype and info.format_version == 2
        assert info.router_family == case.model_type and info.router_top_k == case.K
        assert info.shared_d_ff == case.shared_d_ff


def expert_triples(blk):
    """[(gate, up, down)] of the reference block's routed experts."""
    ex = blk.experts
    if hasattr(ex, "gate_up_proj"):  # fused
        F = ex.down_proj.shape[-1]
        return [(ex.gate_up_proj[e, :F], ex.gate_up_proj[e, F:], ex.down_proj[e]) for e in range(len(ex.down_proj))]
    if hasattr(ex[0], "w1"):
        return [(e.w1.weight, e.w3.weight, e.w2.weight) for e in ex]
    return [(e.gate_proj.weight, e.up_proj.weight, e.down_proj.weight) for e in ex]


@pytest.mark.parametrize("name,dtype", PARAMS)
def test_converted_files_are_exact(name, dtype, tmp_path_factory):
    """Every file holds exactly the checkpoint's values: experts and shared
    expert in the model's dtype (bf16: rounded to nearest even, as torch
    does), router, DeepSeek-V3 bias and Qwen2 shared gate in f32."""
    case, blocks, out = converted(name, dtype, tmp_path_factory)
    st = {"f32": "F32", "bf16": "BF16"}[dtype]
    cat = lambda mats, dt: b"".join(tensor_bytes(m, dt) for m in mats)  # noqa: E731
    for j, hf_layer in enumerate(case.moe_layers):
        blk = blocks[hf_layer]
        d = out / ("layer_%02d" % j) if len(case.moe_layers) > 1 else out
        for e, triple in enumerate(expert_triples(blk)):
            assert (d / ("expert_%02d.bin" % e)).read_bytes() == cat(triple, st), "layer %d expert %d" % (j, e)
        router = [blk.gate.weight]
        if hasattr(blk.gate, "e_score_correction_bias"):
            router.append(blk.gate.e_score_correction_bias)
        assert (d / "router.bin").read_bytes() == cat(router, "F32")
        shared = getattr(blk, "shared_expert", None) or getattr(blk, "shared_experts", None)
        if shared is not None:
            assert (d / "shared_expert.bin").read_bytes() == cat(
                (shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight), st)
        else:
            assert not (d / "shared_expert.bin").exists()
        if case.shared_gate:
            assert (d / "shared_gate.bin").read_bytes() == cat([blk.shared_expert_gate.weight], "F32")
        else:
            assert not (d / "shared_gate.bin").exists()


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("name,dtype", PARAMS)
def test_builtin_router_matches_reference(name, dtype, T, tmp_path_factory):
    case, blocks, out = converted(name, dtype, tmp_path_factory)
    tol = TOL_F32 if dtype == "f32" else TOL_BF16
    with colibri.Model(str(out), threads=2) as m:
        for j, hf_layer in enumerate(case.moe_layers):
            blk = blocks[hf_layer]
            ref = reference_block(blk, dtype)
            x, want_ids = clear_input(blk, T, seed=100 * case.seed + 10 * j + T)
            want = reference_forward(ref, x)
            got = m.infer(x, layer=j)  # no ids: the engine's router and shared expert
            assert got.shape == (T, D) and got.dtype == torch.float32
            err = rel_l2(got, want)
            assert err <= tol, "layer %d (HF %d), T=%d: relative L2 %.3g > %g" % (j, hf_layer, T, err, tol)
            ids, w = m.route(x, layer=j)
            assert ids.shape == (T, case.K)
            assert torch.equal(ids.long().sort(-1).values, want_ids), "layer %d (HF %d): expert sets differ" % (
                j, hf_layer)
            # the routed weights are the family's: the same output through explicit ids
            assert rel_l2(m.infer(x, ids, w, layer=j), want) <= tol


def test_layer_selection_picks_the_right_weights(tmp_path_factory):
    """Each Colibri layer holds its own HF layer's weights: layer j run on
    another HF layer's reference is far off (so the checks above could tell
    a shifted layer mapping apart)."""
    case, blocks, out = converted("qwen2_moe", "f32", tmp_path_factory)
    with colibri.Model(str(out), threads=2) as m:
        for j, hf_layer in enumerate(case.moe_layers):
            x, _ = clear_input(blocks[hf_layer], 16, seed=300 + j)
            got = m.infer(x, layer=j)
            for other in case.moe_layers:
                err = rel_l2(got, reference_forward(reference_block(blocks[other], "f32"), x))
                assert (err <= TOL_F32) == (other == hf_layer), (j, other, err)


@pytest.mark.parametrize("name,layer", [("deepseek_v3", 1), ("qwen2_moe", 2)])
def test_cli_infer_builtin_router(name, layer, tmp_path_factory, tmp_path):
    """`colibri infer` with no --routing: the model's own router."""
    case, blocks, out = converted(name, "f32", tmp_path_factory)
    blk = blocks[case.moe_layers[layer]]
    x, _ = clear_input(blk, 37, seed=500 + case.seed)
    x.numpy().astype("<f4").tofile(tmp_path / "x.bin")
    r = subprocess.run([find_cli(), "infer", "--model", str(out), "--input", str(tmp_path / "x.bin"), "--output",
                        str(tmp_path / "y.bin"), "--layer", str(layer), "--threads", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    y = torch.from_numpy(np.fromfile(tmp_path / "y.bin", dtype="<f4").reshape(37, D))
    assert rel_l2(y, reference_forward(reference_block(blk, "f32"), x)) <= TOL_F32
    with colibri.Model(str(out), threads=2) as m:
        assert rel_l2(y, m.infer(x, layer=layer)) <= 1e-6


def test_convert_layer_range(tmp_path_factory, tmp_path):
    """--layers a-b keeps the MoE layers among HF layers a..b."""
    case, blocks, _ = converted("qwen2_moe", "f32", tmp_path_factory)
    hf, _ = _built["qwen2_moe"]
    out = tmp_path / "m"
    convert(hf, out, "f32", ("--layers", "1-2"))
    manifest = json.loads((out / "colibri.json").read_text())
    assert manifest["source"]["layers"] == [2]
    x, _ = clear_input(blocks[2], 7, seed=77)
    with colibri.Model(str(out), threads=2) as m:
        assert m.info.n_layers == 1
        assert rel_l2(m.infer(x, layer=0), reference_forward(reference_block(blocks[2], "f32"), x)) <= TOL_F32


@pytest.mark.parametrize("name,want", [("olmoe", "f32"), ("fused_qwen3_bf16", "bf16")])
def test_default_dtype_is_the_checkpoints(name, want, tmp_path_factory, tmp_path):
    """Without --dtype the model takes the dtype of the checkpoint's experts."""
    converted(name, "f32", tmp_path_factory)
    hf, blocks = _built[name]
    convert(hf, tmp_path / "m", None)
    blk = blocks[CASE[name].moe_layers[0]]
    x, _ = clear_input(blk, 7, seed=5)
    with colibri.Model(str(tmp_path / "m"), threads=2) as m:
        assert m.info.dtype == want
        err = rel_l2(m.infer(x, layer=0), reference_forward(reference_block(blk, want), x))
        assert err <= (TOL_F32 if want == "f32" else TOL_BF16)


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v2"])
def test_swapped_gate_up_is_caught(name, tmp_path):
    """Negative control: a checkpoint whose gate and up projections are
    swapped converts fine but must not match the reference."""
    case = CASE[name]
    blocks = build_checkpoint(case, str(tmp_path / "hf"), mutation="swap_gate_up")
    convert(tmp_path / "hf", tmp_path / "m", "f32")
    x = torch.randn(32, D, generator=torch.Generator().manual_seed(1))
    with colibri.Model(str(tmp_path / "m"), threads=2) as m:
        for j, hf_layer in enumerate(case.moe_layers):
            assert rel_l2(m.infer(x, layer=j), reference_forward(reference_block(blocks[hf_layer], "f32"), x)) > 0.05


def dequantised_block(blk, dtype):
    """The reference in float64 holding the weights as a block-quantised
    model stores them: every routed and shared expert matrix through
    colibri.quantize / dequantize along its rows (the input dimension), down
    projections in the mix's down type."""
    gate_up, down = colibri.quant.split_dtype(dtype)
    ref = copy.deepcopy(blk)
    mods = [ref.experts] + [getattr(ref, a) for a in ("shared_expert", "shared_experts")
                            if getattr(ref, a, None) is not None]
    with torch.no_grad():
        for mod in mods:
            for pname, p in mod.named_parameters():
                if p.dim() < 2:
                    continue
                t = down if ("down" in pname or pname.endswith("w2.weight")) else gate_up
                a = p.detach().float().reshape(-1, p.shape[-1]).numpy()
                p.copy_(torch.from_numpy(colibri.dequantize(colibri.quantize(a, t), t, a.shape[1])).reshape(p.shape))
    return ref.double().eval()


@pytest.mark.parametrize("dtype", ["q8_0", "q4_k_m"])
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_convert_block_quantised(name, dtype, tmp_path_factory):
    """`colibri convert --hf --dtype q8_0|q4_k_m`: each expert file holds the
    quantiser's blocks of its gate, up and down rows, the manifest names both
    types, and the built-in router's output matches the reference on the
    dequantised weights within the int8-activation bound (docs/PRECISION.md)."""
    case, blocks, out = converted(name, dtype, tmp_path_factory)
    gate_up, down = colibri.quant.split_dtype(dtype)
    manifest = json.loads((out / "colibri.json").read_text())
    assert manifest["version"] == 3
    assert manifest["dtype"] == gate_up and manifest.get("down_dtype", gate_up) == down
    for j, hf_layer in enumerate(case.moe_layers):
        blk = blocks[hf_layer]
        d = out / ("layer_%02d" % j) if len(case.moe_layers) > 1 else out
        for e, (g, u, dn) in enumerate(expert_triples(blk)):
            q = lambda m, t: colibri.quantize(m.detach().float().numpy(), t).tobytes()  # noqa: E731
            want = q(g, gate_up) + q(u, gate_up) + q(dn, down)
            assert (d / ("expert_%02d.bin" % e)).read_bytes() == want, "layer %d expert %d" % (j, e)
    with colibri.Model(str(out), threads=2) as m:
        assert (m.info.dtype, m.info.down_dtype) == (gate_up, down)
        for j, hf_layer in enumerate(case.moe_layers):
            blk = blocks[hf_layer]
            ref = dequantised_block(blk, dtype)
            for T in (1, 64):
                x, want_ids = clear_input(blk, T, seed=700 + 10 * j + T)
                err = rel_l2(m.infer(x, layer=j), reference_forward(ref, x))
                assert err <= 2e-2, "layer %d, T=%d: relative L2 %.3g" % (j, T, err)
                ids, _ = m.route(x, layer=j)
                assert torch.equal(ids.long().sort(-1).values, want_ids)
