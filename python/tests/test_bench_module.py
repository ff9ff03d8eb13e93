"""colibri.bench: whole-model pp / tg in llama-bench's conventions, on a tiny
GGUF file (never a timing threshold: only that each test ran and how the
records and tables are laid out)."""

import csv
import io
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from gguf_fixtures import write_model_gguf  # noqa: E402

import colibri.bench as cb  # noqa: E402
from gguf import GGUFReader  # noqa: E402


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("bench") / "qwen3moe.gguf")
    write_model_gguf(path, "qwen3moe", n_blocks=2, d_model=256, n_experts=8, top_k=2, d_ff=256, n_heads=4,
                     n_kv_heads=2, head_dim=64, vocab=320, seed=1, reference=False)
    return path


def test_records_and_tables(tiny_gguf):
    records = cb.run(tiny_gguf, prompt=(8, 16), gen=(4,), repetitions=2, threads=2)
    assert [(r["n_prompt"], r["n_gen"]) for r in records] == [(8, 0), (16, 0), (0, 4)]
    for r in records:
        assert r["model_type"] == "qwen3_moe" and r["backends"] == "Colibri" and r["n_threads"] == 2
        assert r["model_size"] == os.path.getsize(tiny_gguf)
        assert r["model_n_params"] == sum(int(t.n_elements) for t in GGUFReader(tiny_gguf).tensors)
        assert len(r["samples_ts"]) == 2 and all(s > 0 for s in r["samples_ts"])
        assert r["avg_ts"] == pytest.approx(sum(r["samples_ts"]) / 2)
        assert r["stddev_ts"] >= 0
    md = cb.format_records(records).splitlines()
    assert md[0] == "| model | size | params | backend | threads | test | t/s |"
    assert [line.split("|")[6].strip() for line in md[2:]] == ["pp8", "pp16", "tg4"]
    assert all(" ± " in line for line in md[2:])
    assert json.loads(cb.format_records(records, "json"))[2]["n_gen"] == 4
    rows = list(csv.DictReader(io.StringIO(cb.format_records(records, "csv"))))
    assert [int(r["n_prompt"]) for r in rows] == [8, 16, 0] and rows[0]["samples_ts"].count(";") == 1
    with pytest.raises(ValueError, match="output"):
        cb.format_records(records, "xml")
    with pytest.raises(ValueError, match="repetitions"):
        cb.run(tiny_gguf, repetitions=0)


def test_module_runs(tiny_gguf):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    out = subprocess.run([sys.executable, "-m", "colibri.bench", tiny_gguf, "-p", "8", "-n", "2", "-r", "1", "-t", "2",
                          "-o", "json"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert [r["n_gen"] for r in json.loads(out.stdout)] == [0, 2]
    bad = subprocess.run([sys.executable, "-m", "colibri.bench", tiny_gguf, "-p", "", "-n", ""], capture_output=True,
                         text=True, env=env, timeout=300)
    assert bad.returncode != 0 and "nothing to run" in bad.stderr
