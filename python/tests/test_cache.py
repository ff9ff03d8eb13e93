"""Models under a memory budget (max_resident=, docs/CACHE.md) from Python,
the CLI and accelerate(): GGUF files (one file and a split set, with and
without gpt-oss's biases) and model directories give the same output bits
as the fully resident model, and the stats add up."""

import subprocess

import numpy as np
import pytest

import colibri
import gguf_fixtures as gf
from helpers import find_cli


def _calls(rng, n_experts, d_model, n_layers, k):
    out = []
    for i in range(24):
        T = 16 if i % 8 == 7 else 1
        x = rng.standard_normal((T, d_model)).astype(np.float32)
        ids = np.stack([rng.choice(n_experts, size=k, replace=False) for _ in range(T)]).astype(np.int32)
        w = rng.uniform(0.1, 1.0, size=(T, k)).astype(np.float32)
        out.append((i % n_layers, x, ids, w))
    return out


@pytest.mark.parametrize("arch,kw", [("qwen3moe", dict(dtype="q4_k", down_dtype="q6_k")),
                                     ("gpt-oss", dict(dtype="mxfp4", top_k=4)),
                                     ("llama", dict(dtype="q8_0", split=5))])
@pytest.mark.parametrize("engine", ["pread", "io_uring"])
def test_gguf_under_budgets_is_bit_identical(tmp_path, arch, kw, engine):
    path = str(tmp_path / "m.gguf")
    fix = gf.write_moe_gguf(path, arch, n_blocks=3, n_experts=8, d_model=256, d_ff=256, seed=3, **kw)
    if engine == "io_uring":
        try:
            colibri.Model(fix.path, lock=False, huge_pages=False, max_resident="50%", io_engine=engine).close()
        except colibri.ColibriError as e:
            if e.status != 6:  # COLIBRI_ERR_UNSUPPORTED: no liburing, or a kernel that refuses it
                raise
            pytest.skip("io_uring not usable here: %s" % e)
    rng = np.random.default_rng(5)
    with colibri.Model(fix.path, threads=2, lock=False, huge_pages=False) as ref:
        info = ref.info
        calls = _calls(rng, info.n_experts, info.d_model, info.n_layers, 2)
        want = [ref.infer(x, ids, w, layer=l) for l, x, ids, w in calls]
        xs = [rng.standard_normal((1 if i % 3 else 8, info.d_model)).astype(np.float32) for i in range(6)]
        want_router = [[ref.infer(x, layer=l) for l in range(info.n_layers)] for x in xs]
        assert ref.stats.cache_slots == 0
    for budget in ("5%", "20%", "60%", 1):
        m = colibri.Model(fix.path, threads=2, lock=False, huge_pages=False,
                          max_resident=budget if budget != 1 else None, io_engine=engine)
        if budget == 1:  # one expert's bytes exactly
            per = m.stats.bytes_mapped  # resident model: routers + every expert
            m.close()
            probe = colibri.Model(fix.path, lock=False, huge_pages=False, max_resident="50%")
            s = probe.stats
            one = s.resident_bytes // s.cache_slots
            probe.close()
            assert per > one
            m = colibri.Model(fix.path, threads=2, lock=False, huge_pages=False, max_resident=one, io_engine=engine)
            assert m.stats.cache_slots == 1
        with m:
            s0 = m.stats
            assert 0 < s0.cache_slots < info.n_layers * info.n_experts
            assert s0.resident_bytes <= s0.experts_bytes
            for (l, x, ids, w), y0 in zip(calls, want):
                assert np.array_equal(m.infer(x, ids, w, layer=l), y0), (budget, l)
            for x, ys in zip(xs, want_router):
                for l in range(info.n_layers):
                    assert np.array_equal(m.infer(x, layer=l), ys[l]), (budget, "router", l)
            s = m.stats
            assert s.cache_misses > 0 and s.expert_reads >= s.cache_misses
            assert s.expert_read_failures == 0
            assert s.uring_reads == (s.expert_reads if engine == "io_uring" else 0)
            assert 0.0 <= s.hit_rate < 1.0


def test_directory_budget_prefetch_and_cli(tmp_path):
    cli = find_cli()
    d = str(tmp_path / "model")
    r = subprocess.run([cli, "gen", "--out", d, "--layers", "2", "--experts", "8", "--d-model", "128", "--d-ff",
                        "256", "--dtype", "q4_0", "--router", "mixtral", "--top-k", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    x = np.random.default_rng(1).standard_normal((4, 128)).astype(np.float32)
    with colibri.Model(d, threads=2) as ref:
        want = ref.infer(x, layer=1)
    with colibri.Model(d, threads=2, max_resident="25%", eviction="lru", io_threads=2) as m:
        assert m.stats.cache_slots == 4
        assert m.prefetch(1, [0, 1, -1]) == 2
        assert np.array_equal(m.infer(x, layer=1), want)
        s = m.stats
        assert s.prefetch_reads >= 2
        with pytest.raises(ValueError, match="experts must be in"):
            m.prefetch(0, [8])
    with pytest.raises(ValueError, match="eviction"):
        colibri.Model(d, max_resident="25%", eviction="mru")
    with pytest.raises(ValueError, match="io_engine"):
        colibri.Model(d, max_resident="25%", io_engine="aio")
    with pytest.raises(colibri.ColibriError, match="holds no expert"):
        colibri.Model(d, max_resident=1000)
    with pytest.raises(TypeError, match="max_resident"):
        colibri.Model(d, max_resident=0.5)

    x.astype("<f4").tofile(tmp_path / "x.bin")
    r = subprocess.run([cli, "infer", "--model", d, "--input", str(tmp_path / "x.bin"), "--output",
                        str(tmp_path / "y.bin"), "--layer", "1", "--max-resident", "25%"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert np.array_equal(np.fromfile(tmp_path / "y.bin", dtype="<f4").reshape(4, 128), want)
    r = subprocess.run([cli, "infer", "--model", d, "--input", str(tmp_path / "x.bin"), "--output",
                        str(tmp_path / "y.bin"), "--layer", "1", "--max-resident", "25%", "--io-engine", "mmap"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "--io-engine" in r.stderr, r.stdout + r.stderr
    r = subprocess.run([cli, "info", "--model", d, "--max-resident", "40%"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "for 6 experts" in r.stdout, r.stdout
    r = subprocess.run([cli, "bench", "--model", d, "--tokens", "1", "--top-k", "2", "--iters", "20",
                        "--max-resident", "300K", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    import json
    doc = json.loads(r.stdout)
    assert doc["cache"]["slots"] > 0 and doc["cache"]["misses"] > 0
    r = subprocess.run([cli, "info", "--model", d, "--max-resident", "lots"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0 and "--max-resident: 'lots' is not a size" in r.stderr, r.stderr


def test_accelerate_gguf_under_a_budget(tmp_path):
    """accelerate(gguf=, max_resident=) gives the same model outputs as
    without a budget; a budget without gguf= is refused."""
    import torch
    from reference_moe import make_model
    import colibri.torch as ct

    path = str(tmp_path / "m.gguf")
    model = make_model("qwen3_moe", seed=7, n_layers=2, D=256, F_=256)
    gf.gguf_from_torch(model, path, "qwen3_moe", "q4_k", "q6_k")
    x = torch.randn(2, 9, 256, generator=torch.Generator().manual_seed(8))
    outs = []
    for budget in (None, "25%"):
        m = make_model("qwen3_moe", seed=7, n_layers=2, D=256, F_=256)
        report = ct.accelerate(m, gguf=path, threads=2, max_resident=budget)
        if budget is not None:
            assert report.models[0].stats.cache_slots > 0
        with torch.no_grad():
            outs.append(m(x))
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="max_resident needs gguf="):
        ct.accelerate(make_model("qwen3_moe", seed=7, n_layers=1, D=256, F_=256), max_resident="25%")


def test_bench_replays_a_trace(tmp_path):
    """colibri bench --trace reads what colibri.routing writes, runs every
    step, counts decode tokens, and names the step of a bad trace."""
    import json
    from colibri import routing

    cli = find_cli()
    d = str(tmp_path / "model")
    r = subprocess.run([cli, "gen", "--out", d, "--layers", "3", "--experts", "8", "--d-model", "64", "--d-ff",
                        "64", "--dtype", "f32"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    t = routing.synthetic_trace(3, 8, 2, 5, prefill_tokens=7, seed=3)
    path = str(tmp_path / "t.ctrace")
    t.save(path)
    r = subprocess.run([cli, "bench", "--model", d, "--trace", path, "--warmup", "0", "--max-resident", "25%",
                        "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["steps"] == len(t) == 3 + 5 * 3
    assert doc["decode"]["tokens"] == 5 and doc["prefill"]["tokens"] == 7
    assert doc["timed"]["hits"] + doc["timed"]["misses"] == t.total_lookups()
    bad = routing.RoutingTrace(4, 8, 2)
    bad.append(3, np.array([[0, 1]], dtype=np.int32))
    bad.save(path)
    r = subprocess.run([cli, "bench", "--model", d, "--trace", path], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "the model 3 of 8" in r.stderr, r.stderr
    with open(path, "r+b") as f:
        f.truncate(40)
    r = subprocess.run([cli, "bench", "--model", d, "--trace", path], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and path + ": step 0: truncated ids" in r.stderr, r.stderr
