"""colibri.doctor: colibri_doctor's report from Python, and
`python -m colibri.doctor` (the CLI's `colibri doctor` is tested in
tests/test_cli.cpp)."""

import json
import os
import subprocess
import sys

import pytest

import colibri
import colibri.doctor as cd


def test_report_without_a_model():
    r = cd.report()
    assert r["cpu"]["level"] == colibri.cpu_isa()
    assert set(r) >= {"cpu", "cores", "memory", "huge_pages", "memlock", "numa", "environment", "model", "problems"}
    assert r["model"] is None
    assert 1 <= r["cores"]["physical"] <= r["cores"]["allowed"]
    assert all(set(p) == {"problem", "fix"} for p in r["problems"])
    # Twice as many threads as allowed CPUs is a problem the report names with its fix.
    many = 2 * r["cores"]["allowed"]
    fixes = [p["fix"] for p in cd.report(threads=many)["problems"] if p["problem"].startswith("%d threads" % many)]
    assert fixes and "threads=%d" % r["cores"]["physical"] in fixes[0]
    with pytest.raises(ValueError, match="threads"):
        cd.report(threads=-1)


def test_report_on_a_model(small_dir, tmp_path):
    path, layers = small_dir
    r = cd.report(path, threads=1)
    m = r["model"]
    assert (m["layers"], m["experts"], m["d_model"], m["d_ff"]) == (2, 4, 32, 24)
    assert m["experts_bytes"] == 2 * 4 * 3 * 32 * 24 * 4  # f32
    assert [k["types"] for k in m["kernels"]] == ["f32/f32"]
    assert m["kernels"][0]["registry"].startswith("decode ")
    with pytest.raises(colibri.ColibriError, match="missing"):
        cd.report(str(tmp_path / "missing"))
    text = cd.format_report(r)
    assert "kernels      f32/f32: decode " in text and text.startswith("cpu ")


def test_module_runs(small_dir):
    path, _ = small_dir
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    out = subprocess.run([sys.executable, "-m", "colibri.doctor", path, "--json"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"]["experts"] == 4
    bad = subprocess.run([sys.executable, "-m", "colibri.doctor", path + "-missing"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert bad.returncode == 1 and "colibri doctor:" in bad.stderr
