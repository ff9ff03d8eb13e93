"""GGUF files opened directly: MoE GGUFs written by the gguf package in each
architecture's naming (gguf_fixtures.py), run through colibri.Model and
compared with a float64 reference on the weights as the gguf package
dequantises them, with the built-in router (llama.cpp's rule for the
architecture) and with routing from the caller."""

import numpy as np
import pytest

import colibri
import gguf_fixtures as gf

INT8_TOL = 2e-2
EXACT_TOL = 1e-5
BF16_TOL = 5e-3


def rel_l2(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def silu(x):
    return x / (1.0 + np.exp(-x))


def route_reference(fix, layer, x):
    """llama.cpp's gating for the fixture's architecture, in float64:
    ids [T, k] and weights [T, k]."""
    L = fix.layers[layer]
    logits = x.astype(np.float64) @ L.router.astype(np.float64).T
    if fix.arch == "gpt-oss":  # top k of the biased logits, softmax over those k
        logits = logits + L.bias.astype(np.float64)
        ids = np.argsort(-logits, axis=1, kind="stable")[:, : fix.top_k]
        top = np.take_along_axis(logits, ids, axis=1)
        z = np.exp(top - top.max(axis=1, keepdims=True))
        return ids, z / z.sum(axis=1, keepdims=True)
    if fix.arch in ("deepseek2", "glm4moe"):
        probs = 1.0 / (1.0 + np.exp(-logits))
        choice = probs + L.bias.astype(np.float64)
    else:
        z = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = z / z.sum(axis=1, keepdims=True)
        choice = probs
    ids = np.argsort(-choice, axis=1, kind="stable")[:, : fix.top_k]
    w = np.take_along_axis(probs, ids, axis=1)
    if fix.norm_topk_prob:
        w = w / w.sum(axis=1, keepdims=True)
    if fix.arch in ("deepseek2", "glm4moe"):
        w = w * 2.5
    return ids, w


def moe_reference(fix, layer, x, ids, w):
    L = fix.layers[layer]
    x64 = x.astype(np.float64)
    y = np.zeros_like(x64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            g = L.gate[e].astype(np.float64) @ x64[t]
            u = L.up[e].astype(np.float64) @ x64[t]
            if L.gate_bias is not None:  # gpt-oss: biases and ggml_swiglu_oai(alpha 1.702, limit 7)
                g = np.minimum(g + L.gate_bias[e], 7.0)
                u = np.clip(u + L.up_bias[e], -7.0, 7.0)
                h = (u + 1.0) * g / (1.0 + np.exp(-1.702 * g))
                y[t] += w[t, j] * (L.down[e].astype(np.float64) @ h + L.down_bias[e])
                continue
            h = silu(g) * u
            y[t] += w[t, j] * (L.down[e].astype(np.float64) @ h)
    if L.shared_gate_proj is not None:
        h = silu(x64 @ L.shared_gate_proj.astype(np.float64).T) * (x64 @ L.shared_up.astype(np.float64).T)
        s = h @ L.shared_down.astype(np.float64).T
        if L.shared_gate is not None:
            s = s * (1.0 / (1.0 + np.exp(-(x64 @ L.shared_gate.astype(np.float64)))))[:, None]
        y += s
    return y


CASES = [
    # (architecture, gate/up type, down type, extra fixture arguments)
    ("qwen3moe", "q4_k", "q6_k", dict(dense_blocks=1)),  # Q4_K_M-style, Qwen3-MoE naming
    ("llama", "q4_k", "q6_k", dict()),  # Q4_K_M-style Mixtral (llama architecture)
    ("qwen2moe", "q8_0", "q8_0", dict(shared_d_ff=128)),
    ("olmoe", "q4_0", "q4_0", dict(router_dtype="f16")),
    ("deepseek2", "q5_k", "q6_k", dict(dense_blocks=1, shared_d_ff=256, fused=True)),
    ("glm4moe", "q8_0", "q8_0", dict(dense_blocks=1, shared_d_ff=256)),
    # Q4_K_M as llama.cpp writes it: the down type changes from block to block.
    ("llama", "q4_k", "q6_k", dict(n_blocks=3, block_down_dtypes=["q6_k", "q4_k", "q6_k"])),
    ("qwen2moe", "q4_k", "q4_k", dict(shared_d_ff=256, block_down_dtypes=["q4_k", "q6_k"])),
    ("olmoe", "q6_k", "q5_k", dict()),
    # MXFP4 experts (gpt-oss's format) in an architecture Colibri runs.
    ("qwen3moe", "mxfp4", "mxfp4", dict()),
    # gpt-oss itself: MXFP4 experts with biases, the biased router, the clamped SwiGLU. Its
    # inputs are 6x the others' (so the clamps bite) and its router 1/6: logits of the other
    # fixtures' size, whose fp32 rounding the top-k softmax weights then inherit alike.
    ("gpt-oss", "mxfp4", "mxfp4", dict(top_k=4, router_scale=1 / 6)),
    ("gpt-oss", "bf16", "bf16", dict(router_scale=1 / 6)),
    # The legacy and iq4 formats, and "dynamic" mixes of them from block to block.
    ("qwen3moe", "iq4_xs", "iq4_xs", dict(dense_blocks=1)),
    ("llama", "q5_0", "q5_1", dict()),
    ("olmoe", "iq4_nl", "q4_1", dict()),
    ("deepseek2", "iq4_xs", "q5_0", dict(dense_blocks=1, shared_d_ff=256, block_down_dtypes=["q5_0", "iq4_xs"])),
    # Q2_K / Q3_K as llama.cpp's Q2_K and Q3_K_M mixes lay them out.
    ("deepseek2", "q2_k", "q3_k", dict(dense_blocks=1, shared_d_ff=256, block_down_dtypes=["q3_k", "q4_k"])),
    ("qwen3moe", "q3_k", "q3_k", dict()),
    # IQ2_XXS experts (random grid blocks: the format is read, not made) with Q3_K down.
    ("qwen3moe", "iq2_xxs", "q3_k", dict()),
    # The 1-bit mixes: IQ1_S / IQ1_M experts with IQ3_XXS / IQ2_XXS down (as
    # llama.cpp's IQ1_S and IQ1_M mixes give the larger type to down).
    ("qwen3moe", "iq1_s", "iq3_xxs", dict()),
    # IQ2_XS / IQ2_S / IQ3_S, llama.cpp's IQ2_XS, IQ2_M and IQ3_M mixes.
    ("qwen3moe", "iq2_xs", "iq3_s", dict()),
    ("olmoe", "iq2_s", "iq3_s", dict()),
    ("deepseek2", "iq1_m", "iq2_xxs", dict(dense_blocks=1, shared_d_ff=256, block_down_dtypes=["iq2_xxs", "iq1_s"])),
    # The ternary TQ1_0 / TQ2_0 (gguf's own quantisers), alone and mixed with
    # a finer down from block to block.
    ("qwen3moe", "tq1_0", "tq1_0", dict()),
    ("deepseek2", "tq2_0", "tq1_0", dict(dense_blocks=1, shared_d_ff=256, block_down_dtypes=["tq1_0", "q4_k"])),
    ("qwen3moe", "bf16", "bf16", dict()),
    ("llama", "f16", "f16", dict()),
    ("qwen2moe", "f32", "f32", dict(shared_d_ff=128, router_dtype="bf16")),
]


@pytest.mark.parametrize("arch,dtype,down,extra", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
@pytest.mark.parametrize("exact", [False, True], ids=["int8", "exact"])
def test_gguf_layers_match_float64(tmp_path, arch, dtype, down, extra, exact):
    path = str(tmp_path / "model.gguf")
    extra = dict(extra)
    n_blocks = extra.pop("n_blocks", 3 if extra.get("dense_blocks") else 2)
    fix = gf.write_moe_gguf(path, arch, n_blocks=n_blocks, dtype=dtype, down_dtype=down,
                            seed=hash((arch, dtype)) % 1000, **extra)
    quantized = dtype not in ("f32", "f16", "bf16")
    # Default precision: int8 activations for the block formats, and bf16
    # weights' prefill on bf16-rounded activations (docs/PRECISION.md).
    tol = EXACT_TOL if exact else INT8_TOL if quantized else BF16_TOL if dtype == "bf16" else EXACT_TOL
    rng = np.random.default_rng(5)
    with colibri.Model(path, exact_prefill=exact) as m:
        info = m.info
        assert (info.n_layers, info.n_experts, info.d_model, info.d_ff) == (len(fix.layers), fix.n_experts,
                                                                              fix.d_model, fix.d_ff)
        assert info.dtype == dtype and info.down_dtype == down
        assert info.shared_d_ff == fix.shared_d_ff
        assert m.origin.startswith(f"gguf {arch}, layers 0-{len(fix.layers) - 1} = blocks {fix.first_block}-")
        if fix.first_block:
            assert "dense blocks skipped: 0" in m.origin and "skipped" in m.warning
        for layer, block_down in enumerate(extra.get("block_down_dtypes") or [down] * len(fix.layers)):
            assert m.layer_dtypes(layer) == (dtype, block_down)
        if extra.get("block_down_dtypes"):
            assert " in blocks " in m.origin, m.origin
        for layer in range(len(fix.layers)):
            for T in (1, 5, 40):
                x = rng.standard_normal((T, fix.d_model)).astype(np.float32)
                if arch == "gpt-oss":
                    x *= 6.0  # gate and up products of several units: the clamps bite
                    L = fix.layers[layer]
                    g = np.einsum("efd,td->tef", L.gate, x) + L.gate_bias[None]
                    assert (g > 7.0).mean() > 0.05, "the clamp hardly bites"
                ids, w = route_reference(fix, layer, x)
                # The built-in router picks llama.cpp's experts with its weights.
                got_ids, got_w = m.route(x, layer=layer)
                assert np.array_equal(np.sort(got_ids, axis=1), np.sort(ids, axis=1)), (layer, T)
                order = np.argsort(got_ids, axis=1)
                np.testing.assert_allclose(np.take_along_axis(got_w, order, axis=1),
                                           np.take_along_axis(w, np.argsort(ids, axis=1), axis=1), rtol=1e-4,
                                           atol=1e-6)
                ref = moe_reference(fix, layer, x, ids, w)
                assert rel_l2(m.infer(x, layer=layer), ref) <= tol, (layer, T)
                # Caller routing: the same experts and weights given explicitly.
                assert rel_l2(m.infer(x, ids.astype(np.int32), w.astype(np.float32), layer=layer), ref) <= tol


def test_gguf_bad_files_name_the_problem(tmp_path):
    path = str(tmp_path / "m.gguf")
    gf.write_moe_gguf(path, "qwen3moe", dtype="q8_0")
    raw = open(path, "rb").read()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(raw[:-100])
    with pytest.raises(colibri.ColibriError, match=r"bad\.gguf: tensor blk\.1\.\S+ .*outside the file"):
        colibri.Model(str(bad))
    bad.write_bytes(b"GGUF" + (7).to_bytes(4, "little") + raw[8:])
    with pytest.raises(colibri.ColibriError, match="unknown GGUF version 7"):
        colibri.Model(str(bad))
    # An architecture Colibri does not route, and a type it does not compute.
    gf.write_moe_gguf(path, "qwen3moe", dtype="q8_0", extra_kv={"qwen3moe.expert_gating_func": 2})
    with pytest.raises(colibri.ColibriError, match="expert_gating_func is 2, not softmax"):
        colibri.Model(path)


def test_split_set_opens_from_its_first_file(tmp_path):
    path = str(tmp_path / "split.gguf")
    fix = gf.write_moe_gguf(path, "qwen3moe", n_blocks=3, dtype="q8_0", split=2)
    assert fix.path.endswith("split-00001-of-00006.gguf"), fix.path
    whole = str(tmp_path / "whole.gguf")
    gf.write_moe_gguf(whole, "qwen3moe", n_blocks=3, dtype="q8_0")
    x = np.random.default_rng(1).standard_normal((7, fix.d_model)).astype(np.float32)
    with colibri.Model(fix.path) as a, colibri.Model(whole) as b:
        for layer in range(3):
            assert np.array_equal(a.infer(x, layer=layer), b.infer(x, layer=layer))
    # A later part is not a model's start; a missing part is named.
    with pytest.raises(colibri.ColibriError, match="part 2 of a split set of 6; open its first file"):
        colibri.Model(fix.path.replace("00001-of", "00002-of"))
    missing = fix.path.replace("00001-of", "00004-of")
    import os
    os.remove(missing)
    with pytest.raises(colibri.ColibriError, match=r"part 4 of 6 \(.*split-00004-of-00006\.gguf\) is missing"):
        colibri.Model(fix.path)


def _cli():
    from helpers import find_cli
    cli = find_cli()
    if cli is None:
        pytest.skip("colibri CLI not found: build target colibri_cli and set COLIBRI_CLI")
    return cli


CONVERT_CASES = {
    "qwen3moe-q4_k_m": CASES[0],
    "qwen2moe-shared": CASES[2],
    "deepseek2-fused": CASES[4],
    "glm4moe": CASES[5],
    "llama-per-block": CASES[6],
    "gpt-oss-mxfp4": next(c for c in CASES if c[0] == "gpt-oss"),
    "qwen2moe-shared-per-block": CASES[7],
}
assert CONVERT_CASES["llama-per-block"][3].get("block_down_dtypes")
assert CONVERT_CASES["qwen2moe-shared-per-block"][3].get("block_down_dtypes")


@pytest.mark.parametrize("arch,dtype,down,extra", list(CONVERT_CASES.values()), ids=list(CONVERT_CASES))
def test_convert_gguf_directory_is_bit_identical(tmp_path, arch, dtype, down, extra):
    """`colibri convert --gguf` keeps every byte: the directory and the GGUF
    give the same outputs bit for bit, and the directory verifies."""
    import subprocess
    cli = _cli()
    path = str(tmp_path / "model.gguf")
    extra = dict(extra)
    n_blocks = extra.pop("n_blocks", 3 if extra.get("dense_blocks") else 2)
    fix = gf.write_moe_gguf(path, arch, n_blocks=n_blocks, dtype=dtype, down_dtype=down, seed=3, **extra)
    out = tmp_path / "dir"
    r = subprocess.run([cli, "convert", "--gguf", path, "--out", str(out), "--progress"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"gguf {arch}" in r.stdout
    assert "converting %s [##############################] 100%%" % path in r.stderr, r.stderr
    r = subprocess.run([cli, "verify", "--model", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    x = np.random.default_rng(2).standard_normal((33, fix.d_model)).astype(np.float32)
    with colibri.Model(path) as g, colibri.Model(str(out)) as d:
        assert d.origin == "colibri model directory"
        assert (g.info.dtype, g.info.down_dtype) == (d.info.dtype, d.info.down_dtype)
        for layer in range(len(fix.layers)):
            assert g.layer_dtypes(layer) == d.layer_dtypes(layer)
            assert np.array_equal(g.infer(x, layer=layer), d.infer(x, layer=layer))
            assert np.array_equal(g.route(x, layer=layer)[0], d.route(x, layer=layer)[0])
        # Hot swap in the directory: each layer's expert files have that
        # layer's size; expert 0 given expert 1's file then computes as
        # expert 1 did.
        last = len(fix.layers) - 1
        one = np.ones((x.shape[0], 1), np.float32)
        want = d.infer(x, np.full((x.shape[0], 1), 1, np.int32), one, layer=last)
        d.swap_expert(last, 0, path=str(out / ("layer_%02d" % last) / "expert_01.bin"))
        assert np.array_equal(d.infer(x, np.zeros((x.shape[0], 1), np.int32), one, layer=last), want)
    # A second conversion into the same directory is refused.
    r = subprocess.run([cli, "convert", "--gguf", path, "--out", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0 and "already holds a model" in r.stderr


def test_cli_info_and_infer_on_gguf(tmp_path):
    """The CLI takes a GGUF wherever it takes --model: info names the
    architecture, blocks and types; infer matches the library."""
    import subprocess
    cli = _cli()
    path = str(tmp_path / "mixtral.gguf")
    fix = gf.write_moe_gguf(path, "llama", dtype="q4_k", down_dtype="q6_k", seed=4)
    r = subprocess.run([cli, "info", "--model", path], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "source       gguf llama, layers 0-1 = blocks 0-1 of 2, gate/up Q4_K, down Q6_K" in r.stdout
    assert "dtype        q4_k (down q6_k)" in r.stdout
    x = np.random.default_rng(6).standard_normal((9, fix.d_model)).astype(np.float32)
    x.astype("<f4").tofile(tmp_path / "x.bin")
    r = subprocess.run([cli, "infer", "--model", path, "--input", str(tmp_path / "x.bin"), "--output",
                        str(tmp_path / "y.bin"), "--layer", "1", "--threads", "2"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    y = np.fromfile(tmp_path / "y.bin", dtype="<f4").reshape(9, fix.d_model)
    ids, w = route_reference(fix, 1, x)
    assert rel_l2(y, moe_reference(fix, 1, x, ids, w)) <= INT8_TOL
    with colibri.Model(path, threads=2) as m:
        assert np.array_equal(y, m.infer(x, layer=1))


def test_cli_info_lists_types_per_block_and_tensor(tmp_path):
    """colibri info names every type of a file that mixes them from tensor
    to tensor and block to block: a count per type, the types per block (runs
    of equal blocks merged), and with --tensors every tensor."""
    import subprocess
    import gguf
    cli = _cli()
    path = str(tmp_path / "mixed.gguf")
    gf.write_moe_gguf(path, "deepseek2", n_blocks=3, dtype="iq1_m", down_dtype="iq2_xxs", seed=5, dense_blocks=1,
                      shared_d_ff=256, block_down_dtypes=["iq2_xxs", "iq1_s"])
    reader = gguf.GGUFReader(path)
    counts = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    r = subprocess.run([cli, "info", "--model", path], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    listed = {}
    for line in r.stdout.split("tensor types\n", 1)[1].splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "tensors":
            listed[parts[0]] = int(parts[1])
    assert listed == counts
    blocks = {line.split(":")[0].strip(): line for line in r.stdout.splitlines() if line.startswith("  blk.")}
    assert "ffn_gate_exps IQ1_M" in blocks["blk.1"] and "ffn_down_exps IQ2_XXS" in blocks["blk.1"]
    assert "ffn_down_exps IQ1_S" in blocks["blk.2"]
    assert not any("exps" in line for name, line in blocks.items() if name == "blk.0")  # the dense block
    r = subprocess.run([cli, "info", "--model", path, "--tensors"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = r.stdout.split("\ntensors\n", 1)[1].splitlines()
    assert len(rows) == len(reader.tensors)
    first = reader.tensors[0]
    assert rows[0].split()[:2] == [first.name, first.tensor_type.name]


@pytest.mark.parametrize("family,dtype,down", [("mixtral", "q4_k", "q6_k"), ("qwen3_moe", "q8_0", "q8_0"),
                                               ("qwen2_moe_norm", "q4_0", "q8_0")])
def test_accelerate_takes_experts_from_the_gguf(tmp_path, family, dtype, down):
    """accelerate(model, gguf=...) runs each block's experts from the file in
    their stored formats: the model's outputs match the same model with the
    weights the file dequantises to, and the PyTorch expert weights are
    released."""
    import torch
    from reference_moe import make_model, rel_l2 as t_rel_l2
    import colibri.torch as ct

    path = str(tmp_path / "m.gguf")
    # One MoE layer for int8 (a close second-layer top-k choice could flip),
    # two for exact.
    for exact, n_layers, tol in ((False, 1, INT8_TOL), (True, 2, EXACT_TOL)):
        model = make_model(family, seed=7, n_layers=n_layers, D=256, F_=256)
        ref = gf.gguf_from_torch(model, path, family, dtype, down)
        x = torch.randn(2, 9, 256, generator=torch.Generator().manual_seed(8))
        with torch.no_grad():
            want = ref(x)
        report = ct.accelerate(model, gguf=path, threads=2, exact_prefill=exact)
        assert report.skipped == [] and len(report.accelerated) == n_layers
        assert [b.colibri_layer for b in report.accelerated] == list(range(n_layers))
        assert report.released_bytes > 0
        info = report.models[0].info
        assert (info.dtype, info.down_dtype) == (dtype, down)
        with torch.no_grad():
            got = model(x)
        assert t_rel_l2(got, want) <= tol, (exact, t_rel_l2(got, want))


def test_accelerate_gguf_refuses_a_mismatch(tmp_path):
    import torch
    from reference_moe import make_model
    import colibri.torch as ct

    path = str(tmp_path / "m.gguf")
    gf.gguf_from_torch(make_model("qwen3_moe", seed=1, n_layers=1, D=256, F_=256), path, "qwen3_moe", "q8_0")
    other = make_model("qwen3_moe", seed=1, n_layers=2, D=256, F_=512)
    with pytest.raises(ValueError, match=r"block layers\.0\.mlp \(GGUF block 0\).*\(experts, d_model, d_ff\) = "
                                         r"\(8, 256, 512\), the file \(8, 256, 256\)"):
        ct.accelerate(other, gguf=path)
    with pytest.raises(ValueError, match="dtype and gguf exclude each other"):
        ct.accelerate(other, gguf=path, dtype="q4_k")


def test_gguf_inconsistent_files_name_the_tensor_or_key(tmp_path):
    """Expert tensors whose shapes disagree with each other or with the
    metadata, and types Colibri does not compute, are refused naming them."""
    import gguf

    path = str(tmp_path / "m.gguf")

    def write(mutate):
        w = gguf.GGUFWriter(path, "qwen3moe")
        w.add_block_count(1)
        w.add_embedding_length(64)
        w.add_expert_count(4)
        w.add_expert_used_count(2)
        w.add_expert_feed_forward_length(32)
        t = {"blk.0.ffn_gate_exps.weight": np.zeros((4, 32, 64), np.float32),
             "blk.0.ffn_up_exps.weight": np.zeros((4, 32, 64), np.float32),
             "blk.0.ffn_down_exps.weight": np.zeros((4, 64, 32), np.float32),
             "blk.0.ffn_gate_inp.weight": np.zeros((4, 64), np.float32)}
        mutate(w, t)
        for name, a in t.items():
            if isinstance(a, tuple):
                w.add_tensor(name, a[0], raw_dtype=a[1])
            else:
                w.add_tensor(name, a)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    def refused(mutate, pattern):
        write(mutate)
        with pytest.raises(colibri.ColibriError, match=pattern):
            colibri.Model(path)

    refused(lambda w, t: t.update({"blk.0.ffn_up_exps.weight": np.zeros((4, 16, 64), np.float32)}),
            r"tensor blk\.0\.ffn_up_exps\.weight has dimensions \[64, 16, 4\], expected \[64, 32, 4\]")
    refused(lambda w, t: t.update({"blk.0.ffn_down_exps.weight": np.zeros((4, 64, 16), np.float32)}),
            r"tensor blk\.0\.ffn_down_exps\.weight has dimensions \[16, 64, 4\], expected \[32, 64, 4\]")
    refused(lambda w, t: t.update({"blk.0.ffn_gate_inp.weight": np.zeros((3, 64), np.float32)}),
            r"tensor blk\.0\.ffn_gate_inp\.weight has dimensions \[64, 3\], expected \[64, 4\]")
    refused(lambda w, t: t.pop("blk.0.ffn_gate_inp.weight"), r"tensor blk\.0\.ffn_gate_inp\.weight is missing")
    # (the gguf writer keeps the last value of a repeated key: expert_count 8)
    refused(lambda w, t: w.add_expert_count(8),
            r"tensor blk\.0\.ffn_gate_exps\.weight has dimensions \[64, 32, 4\], expected \[64, 32, 8\]")
    # The metadata against the tensors: d_ff, and experts.
    def ff(w, t):
        for name in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"):
            t[name] = np.zeros((4, 16, 64), np.float32)
        t["blk.0.ffn_down_exps.weight"] = np.zeros((4, 64, 16), np.float32)
    refused(ff, r"key qwen3moe\.expert_feed_forward_length is 32 but blk\.0\.ffn_gate_exps\.weight has 16 rows")
    def experts(w, t):
        for name in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"):
            t[name] = np.zeros((3, 32, 64), np.float32)
        t["blk.0.ffn_down_exps.weight"] = np.zeros((3, 64, 32), np.float32)
    refused(experts, r"ffn_gate_exps\.weight has dimensions \[64, 32, 3\], expected \[64, 32, 4\]")
    # Gate and up of different types; a type Colibri does not compute.
    half = np.zeros((4, 32, 64), np.float16)
    refused(lambda w, t: t.update({"blk.0.ffn_up_exps.weight": half}),
            r"ffn_up_exps\.weight is F16 but blk\.0\.ffn_gate_exps\.weight is F32; gate and up must share a type")
    # Q8_1 (ggml's activation type, 40 bytes a block of 32): in the table of
    # types, computed by nobody's weights.
    q8_1 = np.zeros((4, 32, 64 // 32 * 40), np.uint8)
    refused(lambda w, t: t.update({"blk.0.ffn_gate_exps.weight": (q8_1, gguf.GGMLQuantizationType.Q8_1),
                                   "blk.0.ffn_up_exps.weight": (q8_1, gguf.GGMLQuantizationType.Q8_1)}),
            r"tensor blk\.0\.ffn_gate_exps\.weight is Q8_1, a type Colibri does not compute")
    # Not an MoE model, and an architecture without a router rule.
    def dense(w, t):
        t.clear()
        t["blk.0.ffn_gate.weight"] = np.zeros((32, 64), np.float32)
    refused(dense, "no block has expert tensors")


def test_open_progress_reports_and_cancels(tmp_path, capsys):
    """Model(progress=callable) sees 0 first and 1 last, rising; returning
    False cancels with COLIBRI_ERR_CANCELLED; an exception in the callable
    (KeyboardInterrupt included) cancels and comes back out; progress=True
    draws a tqdm bar on stderr, nothing on stdout; nothing stays open."""
    path = str(tmp_path / "m.gguf")
    gf.write_moe_gguf(path, n_blocks=3, n_experts=32, d_model=256, d_ff=256, dtype="q4_0", reference=False)
    seen = []
    with colibri.Model(path, threads=2, tune_kernels=False, progress=seen.append) as m:
        assert m.info.n_layers == 3
    assert seen[0] == 0.0 and seen[-1] == 1.0 and 3 <= len(seen) <= 202
    assert all(a < b for a, b in zip(seen, seen[1:]))

    stopped = []

    def stop_halfway(fraction):
        stopped.append(fraction)
        return fraction < 0.5

    with pytest.raises(colibri.ColibriError, match="cancelled by its progress callback") as e:
        colibri.Model(path, threads=2, tune_kernels=False, progress=stop_halfway)
    assert e.value.status == 8 and 0.5 <= stopped[-1] < 1.0

    def interrupted(fraction):
        if fraction > 0.2:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        colibri.Model(path, threads=2, tune_kernels=False, progress=interrupted)
    with pytest.raises(TypeError, match="progress"):
        colibri.Model(path, progress="yes")

    pytest.importorskip("tqdm")
    capsys.readouterr()
    with colibri.Model(path, threads=2, tune_kernels=False, progress=True) as m:
        assert m.info.n_experts == 32
    out, err = capsys.readouterr()
    assert out == "" and "opening m.gguf" in err


def test_local_expert_shares_of_a_gguf_sum_to_the_whole(tmp_path):
    """Model(local_experts=mask) opens only its share of a GGUF's experts;
    two disjoint shares covering every expert (the shared expert in one)
    add up to the whole model's built-in-routed output, each holding about
    half the expert bytes."""
    path = str(tmp_path / "m.gguf")
    gf.write_moe_gguf(path, arch="qwen2moe", n_blocks=2, n_experts=16, top_k=4, d_model=256, d_ff=256,
                      dtype="q4_k", shared_d_ff=256, reference=False, router_scale=25.0)
    rng = np.random.default_rng(4)
    share = rng.permutation(16)[:8]
    mask = np.zeros((2, 16), dtype=bool)
    mask[0, share] = True
    mask[1, :8] = True
    with colibri.Model(path, threads=2, tune_kernels=False) as whole, \
            colibri.Model(path, threads=2, local_experts=mask) as a, \
            colibri.Model(path, threads=2, local_experts=~mask, skip_shared_expert=True) as b:
        assert a.stats.bytes_mapped < 0.65 * whole.stats.bytes_mapped
        assert b.stats.bytes_mapped < a.stats.bytes_mapped
        for layer in (0, 1):
            for T in (1, 5, 64):
                x = rng.standard_normal((T, 256)).astype(np.float32)
                want = whole.infer(x, layer=layer)
                got = a.infer(x, layer=layer) + b.infer(x, layer=layer)
                assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5, (layer, T)
    with pytest.raises(ValueError, match="mask"):
        colibri.Model(path, local_experts=[0, 2, 5])
    with pytest.raises(colibri.ColibriError, match="local_experts_len is 15"):
        colibri.Model(path, local_experts=np.ones(15, dtype=bool))
