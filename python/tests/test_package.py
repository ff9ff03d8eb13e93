"""The package as a user meets it: import without torch, offline install,
the library lookup, and the examples of docs/PYTORCH.md."""

import os
import re
import shutil
import subprocess
import sys

import pytest

import colibri
from helpers import find_cli
from colibri import _lib

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)
REPO = os.path.dirname(PYTHON_DIR)
DOC = os.path.join(REPO, "docs", "PYTORCH.md")


def run_python(code, cwd=None, env_extra=None, pythonpath=PYTHON_DIR):
    env = dict(os.environ)
    env["COLIBRI_LIBRARY"] = colibri.library_path()
    env["PYTHONPATH"] = pythonpath
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_import_does_not_import_torch():
    r = run_python("import sys, colibri, colibri.routing\n"
                   "assert 'torch' not in sys.modules, 'colibri imported torch'\n"
                   "import colibri.torch\nassert 'torch' in sys.modules\nprint('ok')")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_sanitized_builds_are_skipped(tmp_path):
    fake = tmp_path / "libcolibri.so"
    fake.write_bytes(b"\x7fELF....libasan.so.8\x00....")
    assert _lib._is_sanitized(str(fake))
    fake.write_bytes(b"\x7fELF....libc.so.6\x00....")
    assert not _lib._is_sanitized(str(fake))


def test_missing_library_message(tmp_path):
    r = run_python("import colibri\ncolibri.library_path()",
                   env_extra={"COLIBRI_LIBRARY": str(tmp_path / "nope.so")})
    assert r.returncode != 0
    assert "COLIBRI_LIBRARY" in r.stderr and "nope.so" in r.stderr


def test_offline_pip_install(tmp_path):
    import importlib.util

    for mod in ("pip", "setuptools"):  # looked up, not imported (setuptools' distutils shim)
        if importlib.util.find_spec(mod) is None:
            pytest.skip("%s is not installed (python3-%s)" % (mod, mod))
    # From a copy, so setuptools' build/ and egg-info land in tmp_path, not the source tree.
    src = tmp_path / "src"
    shutil.copytree(PYTHON_DIR, src, ignore=shutil.ignore_patterns("tests", "build", "*.egg-info", "__pycache__",
                                                                    "libcolibri.so*"))
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-index", "--no-cache-dir",
                        "--disable-pip-version-check", "-q", "--target", str(target), str(src)],
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, COLIBRI_BUNDLE_LIBRARY=colibri.library_path()))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (target / "colibri" / "libcolibri.so").exists()
    assert (target / "colibri" / "torch.py").exists()
    # the installed copy finds its bundled library, away from the source tree
    env = {k: v for k, v in os.environ.items() if k != "COLIBRI_LIBRARY"}
    env["PYTHONPATH"] = str(target)
    r = subprocess.run([sys.executable, "-c", "import colibri; print(colibri.library_path())"], cwd=str(tmp_path),
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(target / "colibri" / "libcolibri.so")


def doc_examples():
    text = open(DOC).read()
    return re.findall(r"```python\n(.*?)```", text, re.S)


@pytest.mark.parametrize("which", ["cli", "experts", "accelerate"])
def test_doc_examples_run(which, tmp_path):
    blocks = doc_examples()
    code = {"cli": blocks[1], "experts": blocks[2], "accelerate": blocks[3]}[which]
    assert {"cli": "export_routing", "experts": "ColibriExperts(", "accelerate": "accelerate("}[which] in code
    if which == "cli":
        c = find_cli()
        if c is None:
            pytest.skip("colibri CLI not found (set COLIBRI_CLI)")
        # Scratch paths first: the CLI path itself may lie under /tmp.
        code = code.replace("/tmp/", str(tmp_path) + "/").replace('"build/tools/colibri"', repr(c))
    r = run_python(code, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
