"""Block-scaled FP8 (fp8_e4m3): the format against PyTorch's float8_e4m3fn,
and Hugging Face FP8 checkpoints (quantization_config.quant_method "fp8",
128 x 128 weight_scale_inv tiles, DeepSeek-V3's and Qwen3's layouts)
opened by colibri.torch.from_pretrained as stored, against the plain
transformers model holding the same dequantised weights."""

import json
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import colibri  # noqa: E402
import colibri.torch as ct  # noqa: E402
from colibri.fp8 import Fp8Weight  # noqa: E402


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def test_every_code_dequantises_as_pytorch():
    codes = torch.arange(256, dtype=torch.uint8).reshape(2, 128)
    for scale in (1.0, 0.37, 3.1e-5, 2.0**-130):  # the last: products in float32's subnormals
        w = Fp8Weight(codes.view(torch.float8_e4m3fn), torch.tensor([[scale]]), (128, 128), "codes")
        ours = colibri.dequantize(w.packed(), "fp8_e4m3", 128)
        ref = (codes.view(torch.float8_e4m3fn).float() * torch.tensor(scale, dtype=torch.float32)).numpy()
        assert np.array_equal(ours, ref, equal_nan=True), scale
        assert np.array_equal(np.signbit(ours), np.signbit(ref))
        assert np.isnan(ours).sum() == 2  # 0x7f and 0xff


def test_quantiser_rounds_as_pytorch():
    """d = max|x| / 448 per block of 128, codes = e4m3(x / d): PyTorch's
    round-to-nearest-even cast, on magnitudes from 1e-3 to 1e3 (subnormal
    codes included) and on exact ties."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 384, generator=g) * torch.logspace(-3, 3, 384)
    q = colibri.quantize(x.numpy(), "fp8_e4m3").reshape(48, 3, 132)
    blocks = x.reshape(48, 3, 128)
    d = blocks.abs().amax(-1) / 448
    assert np.array_equal(q[:, :, :4].copy().view(np.float32)[..., 0], d.numpy())
    ref = (blocks / d[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(q[:, :, 4:], ref)
    # ties between neighbouring codes (normal and subnormal), scale 1 (448 in the block)
    ties = torch.tensor([448.0, 1.0625, 1.1875, -2.0**-9 * 2.5, 2.0**-9 * 3.5, 2.0**-9 * 0.5, 2.0**-6 * 1.0625, 0.0])
    row = torch.zeros(128)
    row[:ties.numel()] = ties
    q = colibri.quantize(row[None].numpy(), "fp8_e4m3")[0]
    assert np.array_equal(q[4:4 + ties.numel()], ties.to(torch.float8_e4m3fn).view(torch.uint8).numpy())


@pytest.mark.parametrize("shape,block", [((200, 300), (128, 128)), ((130, 256), (64, 256)), ((5, 128), (128, 128))])
def test_checkpoint_tiles_become_rows_of_blocks(shape, block):
    """Each row of a tile keeps the tile's scale; ragged last tiles and rows
    that end inside a block (zero codes after them)."""
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    codes[codes & 0x7f == 0x7f] = 0x11  # no NaN codes
    scales = torch.rand(math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]), generator=g) + 0.01
    w = Fp8Weight(codes.view(torch.float8_e4m3fn), scales.to(torch.bfloat16), block, "w")
    rows = w.packed()
    assert rows.shape == (shape[0], math.ceil(shape[1] / 128) * 132)
    ours = colibri.dequantize(rows, "fp8_e4m3", shape[1])
    assert np.array_equal(ours, w.dequantize().numpy())
    expanded = scales.to(torch.bfloat16).float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    ref = codes.view(torch.float8_e4m3fn).float() * expanded[:shape[0], :shape[1]]
    assert np.array_equal(ours, ref.numpy())


# ------------------------------------------------ checkpoints

def tiny_config(family):
    common = dict(vocab_size=300, num_hidden_layers=3, num_attention_heads=4, num_experts_per_tok=2,
                  max_position_embeddings=256)
    if family == "deepseek_v3":
        # A leading dense block and a shared expert; projections of 128 and
        # 256 inputs run as stored, kv_b_proj's 64 inputs end inside a block.
        return transformers.DeepseekV3Config(
            **common, hidden_size=256, first_k_dense_replace=1, n_routed_experts=8, moe_intermediate_size=128,
            intermediate_size=384, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
            qk_rope_head_dim=32, v_head_dim=32, n_shared_experts=1, n_group=2, topk_group=1,
            routed_scaling_factor=2.0, norm_topk_prob=True)
    # Qwen3: d_model 192, so every expert row and projection input ends half
    # way through its second block.
    return transformers.Qwen3MoeConfig(**common, hidden_size=192, num_key_value_heads=2, num_experts=8,
                                       moe_intermediate_size=128, head_dim=32, norm_topk_prob=True,
                                       intermediate_size=256)


def quantised_fp8(w, block=(128, 128)):
    """DeepSeek's weight_quant on a 2-D float tensor: per tile amax / 448."""
    rows, cols = w.shape
    br, bc = block
    pr, pc = math.ceil(rows / br) * br, math.ceil(cols / bc) * bc
    padded = torch.nn.functional.pad(w.float(), (0, pc - cols, 0, pr - rows))
    tiles = padded.reshape(pr // br, br, pc // bc, bc)
    scale = tiles.abs().amax(dim=(1, 3)) / 448
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = (tiles / scale[:, None, :, None]).reshape(pr, pc)[:rows, :cols].to(torch.float8_e4m3fn)
    return codes, scale


def is_fp8_target(key, t):
    return (key.endswith(("weight", "gate_up_proj", "down_proj")) and t.dim() in (2, 3) and "norm" not in key
            and "embed_tokens" not in key and not key.startswith("lm_head") and not key.endswith("mlp.gate.weight"))


def fp8_checkpoint(tmp_path, family, scale_dtype=torch.float32):
    """(FP8 checkpoint dir, the same weights dequantised in a float32 dir)."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(7)
    plain = transformers.AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
        for name, b in plain.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    src = tmp_path / (family + "-src")
    plain.save_pretrained(src)
    state = load_file(str(src / "model.safetensors"))
    fp8, dequantised = {}, {}
    for key, t in state.items():
        if not is_fp8_target(key, t):
            fp8[key] = dequantised[key] = t
            continue
        mats = t if t.dim() == 3 else t[None]
        pairs = [quantised_fp8(m) for m in mats]
        codes = torch.stack([c for c, _ in pairs])
        scale = torch.stack([s for _, s in pairs]).to(scale_dtype)
        deq = torch.stack([Fp8Weight(c, s, (128, 128), key).dequantize() for c, s in zip(codes, scale)])
        squeeze = (lambda x: x) if t.dim() == 3 else (lambda x: x[0])
        fp8[key] = squeeze(codes)
        fp8[key + "_scale_inv"] = squeeze(scale)  # x.weight_scale_inv; fused experts' x.gate_up_proj_scale_inv
        dequantised[key] = squeeze(deq)
    out, ref = tmp_path / family, tmp_path / (family + "-dequantised")
    for d, s, quant in ((out, fp8, True), (ref, dequantised, False)):
        os.makedirs(d)
        save_file(s, str(d / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads((src / "config.json").read_text())
        if quant:
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
        (d / "config.json").write_text(json.dumps(cfg))
    return str(out), str(ref)


@pytest.mark.parametrize("family,scale_dtype", [("deepseek_v3", torch.float32), ("qwen3_moe", torch.bfloat16)])
def test_fp8_checkpoint_runs_as_stored(tmp_path, family, scale_dtype):
    path, ref_path = fp8_checkpoint(tmp_path, family, scale_dtype)
    plain = transformers.AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval()
    model = ct.from_pretrained(path, threads=2)
    exact = ct.from_pretrained(path, threads=2, exact_prefill=True)
    assert type(model) is type(plain)
    assert {r.models[0].info.dtype for r in model._colibri_report} == {"fp8_e4m3"}
    attn = model.model.layers[1].self_attn
    stored = {n: m.dtype_name for n, m in attn.named_modules() if hasattr(m, "dtype_name")}
    assert "fp8_e4m3" in stored.values(), stored
    if family == "deepseek_v3":
        assert stored["kv_b_proj"] == "f32"  # 64 inputs: widened, as stored it would end inside a block
        assert model.model.layers[0].mlp.down_proj.dtype_name == "fp8_e4m3"  # the dense block's MLP
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        want = plain(ids).logits
        assert rel_l2(model(ids).logits, want) <= 3e-2
        assert rel_l2(exact(ids).logits, want) <= 1e-4
        a = exact.generate(ids[:1, :5], max_new_tokens=8, do_sample=False, pad_token_id=0)
        b = plain.generate(ids[:1, :5], max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert a.tolist() == b.tolist()


def test_fp8_checkpoint_quantised_to_another_type(tmp_path):
    """dtype= takes FP8 weights through their dequantised values: the
    reference holds those values quantised to q8_0 and back (every
    projection, expert and the head; not the embedding or the routers)."""
    from safetensors.torch import load_file, save_file

    path, ref_path = fp8_checkpoint(tmp_path, "deepseek_v3")
    state = load_file(os.path.join(ref_path, "model.safetensors"))
    for key, t in state.items():
        if is_fp8_target(key, t) or key.startswith("lm_head"):
            rows = t.reshape(-1, t.shape[-1]).numpy()
            state[key] = torch.from_numpy(colibri.dequantize(colibri.quantize(rows, "q8_0"), "q8_0",
                                                             rows.shape[1])).reshape(t.shape)
    save_file(state, os.path.join(ref_path, "model.safetensors"), metadata={"format": "pt"})
    plain = transformers.AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval()
    model = ct.from_pretrained(path, threads=2, dtype="q8_0", exact_prefill=True)
    assert {r.models[0].info.dtype for r in model._colibri_report} == {"q8_0"}
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert rel_l2(model(ids).logits, plain(ids).logits) <= 1e-4


def test_bad_fp8_checkpoints_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = fp8_checkpoint(tmp_path, "qwen3_moe")
    cfg_path = os.path.join(path, "config.json")
    cfg = json.loads(open(cfg_path).read())
    for change, message in (({"fmt": "e5m2"}, "fmt"), ({"weight_block_size": [128, 64]}, "multiple of 128"),
                            ({"activation_scheme": "static"}, "activation_scheme")):
        bad = dict(cfg, quantization_config=dict(cfg["quantization_config"], **change))
        open(cfg_path, "w").write(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            ct.from_pretrained(path)
    open(cfg_path, "w").write(json.dumps(cfg))
    f = os.path.join(path, "model.safetensors")
    state = load_file(f)
    key = next(k for k in state if k.endswith("self_attn.q_proj.weight_scale_inv"))
    state[key] = state[key][:, :1]
    save_file(state, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="q_proj.weight_scale_inv has shape"):
        ct.from_pretrained(path)
    del state[key]
    save_file(state, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="has no .*q_proj.weight_scale_inv"):
        ct.from_pretrained(path)
    cfg.pop("quantization_config")
    open(cfg_path, "w").write(json.dumps(cfg))
    with pytest.raises(ValueError, match="no quantization_config"):
        ct.from_pretrained(path)


def test_convert_hf_keeps_fp8_as_stored(tmp_path):
    """colibri convert --hf on the transformers-saved DeepSeek-V3 FP8
    checkpoint: each expert file holds the checkpoint's codes and scales as
    fp8_e4m3 rows (Fp8Weight.packed), the shared expert's too, whichever
    layout (per-expert or fused) this transformers saved."""
    import subprocess
    from safetensors.torch import load_file
    from helpers import find_cli

    cli = find_cli()
    if cli is None:
        pytest.skip("colibri CLI not found: build target colibri_cli and set COLIBRI_CLI")
    path, _ = fp8_checkpoint(tmp_path, "deepseek_v3")
    out = tmp_path / "converted"
    r = subprocess.run([cli, "convert", "--hf", path, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    state = load_file(os.path.join(path, "model.safetensors"))
    manifest = json.loads((out / "colibri.json").read_text())
    assert manifest["dtype"] == "fp8_e4m3"

    def packed(prefix, e=None):
        rows = []
        for proj in ("gate_proj", "up_proj", "down_proj"):
            key = prefix + proj + ".weight"
            if key in state:
                w = Fp8Weight(state[key], state[key + "_scale_inv"], (128, 128), key)
                rows.append(w.packed().tobytes())
                continue
            fused = prefix + ("gate_up_proj" if proj != "down_proj" else "down_proj")
            if proj == "up_proj":
                continue  # gate_up covers both
            codes, scale = state[fused][e], state[fused + "_scale_inv"][e]
            rows.append(Fp8Weight(codes, scale, (128, 128), fused).packed().tobytes())
        return b"".join(rows)

    for j, hf in enumerate((1, 2)):
        block = "model.layers.%d.mlp." % hf
        per_expert = block + "experts.0.gate_proj.weight" in state
        for e in range(8):
            want = packed(block + "experts.%d." % e) if per_expert else packed(block + "experts.", e)
            assert (out / ("layer_%02d" % j) / ("expert_%02d.bin" % e)).read_bytes() == want, (hf, e)
        assert (out / ("layer_%02d" % j) / "shared_expert.bin").read_bytes() == packed(block + "shared_experts.")


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_accelerate_takes_fp8_experts_from_the_checkpoint(tmp_path, family):
    """A model loaded with dequantised weights (as transformers gives an FP8
    checkpoint on CPU), accelerated with checkpoint=FP8_DIR: the experts
    (and DeepSeek's FP8 shared expert) run as stored in fp8_e4m3, the
    model's logits those of the plain model within fp32 rounding."""
    path, ref_path = fp8_checkpoint(tmp_path, family)
    plain = transformers.AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval()
    with torch.no_grad():  # the model's own experts wrong: only the checkpoint's give plain's logits
        for name, p in model.named_parameters():
            if ".experts." in name or ".shared_expert" in name:
                p.zero_()
    report = ct.accelerate(model, checkpoint=path, threads=2, exact_prefill=True)
    assert report.accelerated and not report.skipped
    assert {m.info.dtype for m in report.models} == {"fp8_e4m3"}
    if family == "deepseek_v3":
        assert all(b.shared == "colibri" for b in report.accelerated)  # in the model's fp8_e4m3
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        assert rel_l2(model(ids).logits, plain(ids).logits) <= 1e-4
    # dtype= quantises the stored values as read.
    q8 = transformers.AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval()
    report = ct.accelerate(q8, checkpoint=path, dtype="q8_0", threads=2)
    assert {m.info.dtype for m in report.models} == {"q8_0"}


def test_accelerate_checkpoint_refusals(tmp_path):
    path, ref_path = fp8_checkpoint(tmp_path, "qwen3_moe")
    model = transformers.AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval()
    with pytest.raises(ValueError, match="excludes gguf"):
        ct.accelerate(model, checkpoint=path, gguf=os.path.join(path, "x.gguf"))
    other, _ = fp8_checkpoint(tmp_path / "deepseek", "deepseek_v3")
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts.0.gate_proj.weight is missing"):
        ct.accelerate(model, checkpoint=other)  # another architecture: its first block is dense
    cfg_path = os.path.join(path, "config.json")
    cfg = json.loads(open(cfg_path).read())
    cfg["quantization_config"]["quant_method"] = "gptq"
    open(cfg_path, "w").write(json.dumps(cfg))
    with pytest.raises(ValueError, match="gptq"):
        ct.accelerate(model, checkpoint=path)
