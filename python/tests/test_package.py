"""The package as a user meets it: import without torch, the library
lookup, the wheel (`pip install .` / `pip wheel .` from the repository root,
pyproject.toml) and the examples of docs/PYTORCH.md.

With COLIBRI_TEST_INSTALLED=1 (conftest.py) these tests check the installed
package and its bundled library instead of python/."""

import importlib.metadata
import os
import re
import subprocess
import sys
import zipfile

import pytest

import colibri
from helpers import INSTALLED, find_cli
from colibri import _lib

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)
REPO = os.path.dirname(PYTHON_DIR)
DOC = os.path.join(REPO, "docs", "PYTORCH.md")


def run_python(code, cwd=None, env_extra=None):
    """`python -c code` importing the colibri these tests use: python/ with
    the loaded library, or (INSTALLED) the installed package, left to find
    its own library."""
    env = dict(os.environ)
    if INSTALLED:
        env.pop("PYTHONPATH", None)
        env.pop("COLIBRI_LIBRARY", None)
    else:
        env["COLIBRI_LIBRARY"] = colibri.library_path()
        env["PYTHONPATH"] = PYTHON_DIR
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("COLIBRI_LIBRARY", "PYTHONPATH")}
    env.update(extra)
    return env


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


def test_library_found(tmp_path):
    path = colibri.library_path()
    assert os.path.isfile(path)
    assert colibri.library_version() == colibri.__version__
    origins = [o for o, p in _lib.candidate_paths() if (p if o == "system" else os.path.abspath(p)) == path]
    assert origins, (path, _lib.candidate_paths())
    pkg = os.path.dirname(os.path.realpath(colibri.__file__))
    if not INSTALLED:
        assert pkg == os.path.join(os.path.realpath(PYTHON_DIR), "colibri")
        if os.environ.get("COLIBRI_LIBRARY"):  # ctest sets it
            assert origins == ["COLIBRI_LIBRARY"]
        return
    # The installed package with its own library, nothing set; also in a
    # child started elsewhere.
    assert "COLIBRI_LIBRARY" not in os.environ and origins == ["package"]
    assert pkg.startswith(os.path.realpath(sys.prefix) + os.sep), (pkg, sys.prefix)
    assert not pkg.startswith(os.path.realpath(PYTHON_DIR) + os.sep), pkg
    bundled = os.path.join(pkg, "libcolibri.so")
    assert os.path.realpath(path) == bundled
    assert _lib.candidate_paths()[0] == ("package", os.path.join(_lib._PKG_DIR, "libcolibri.so"))
    r = subprocess.run([sys.executable, "-c", "import colibri; print(colibri.__file__); print(colibri.library_path())"],
                       cwd=str(tmp_path), env=clean_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got_file, got_lib = r.stdout.split()
    assert os.path.dirname(os.path.realpath(got_file)) == pkg
    assert os.path.realpath(got_lib) == bundled


@pytest.mark.skipif(not INSTALLED, reason="checks the installed package (COLIBRI_TEST_INSTALLED=1, scripts/test.sh)")
def test_installed_distribution():
    dist = importlib.metadata.distribution("colibri")
    assert dist.version == colibri.__version__
    reqs = dist.requires or []
    assert any(re.match(r"numpy\b", r) for r in reqs), reqs
    for r in reqs:  # torch only as the extra, and unpinned (no CUDA build pulled in)
        if r.startswith("torch"):
            assert "extra ==" in r and re.fullmatch(r"torch\s*;.*", r), r
    files = {str(f) for f in dist.files}
    assert "colibri/libcolibri.so" in files and "colibri/torch.py" in files, sorted(files)
    # Versioned libraries only where auditwheel copies them in (colibri.libs/).
    assert not any((".so." in f and not f.startswith("colibri.libs/")) or f.startswith("colibri/tests")
                   for f in files), sorted(files)
    wheel = dist.read_text("WHEEL")
    tags = re.findall(r"^Tag: (\S+)$", wheel, re.M)
    assert tags and all(t.startswith("py3-none-") and not t.endswith("-any") for t in tags), wheel
    assert "Root-Is-Purelib: false" in wheel


def read_pyproject():
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        pytest.skip("tomllib needs Python 3.11")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_pyproject_builds_the_library_with_cmake():
    """The root pyproject.toml: scikit-build-core, the version CMake and the
    package carry, numpy required, torch optional and unpinned, the library
    alone and portable."""
    meta = read_pyproject()
    assert meta["build-system"]["build-backend"] == "scikit_build_core.build"
    proj = meta["project"]
    cmake_version = re.search(r"project\(colibri VERSION ([0-9.]+)",
                              open(os.path.join(REPO, "CMakeLists.txt")).read()).group(1)
    assert proj["name"] == "colibri"
    assert proj["version"] == cmake_version == colibri.__version__
    assert proj["dependencies"] == ["numpy"]
    assert proj["optional-dependencies"]["torch"] == ["torch"]
    skb = meta["tool"]["scikit-build"]
    assert skb["wheel"]["packages"] == ["python/colibri"] and skb["wheel"]["py-api"] == "py3"
    assert skb["install"]["components"] == ["python"]
    assert skb["cmake"]["build-type"] == "Release"
    defines = skb["cmake"]["define"]
    for opt in ("TESTS", "TOOLS", "BENCHMARKS", "FUZZERS"):
        assert defines["COLIBRI_BUILD_" + opt] == "OFF"
    assert defines["COLIBRI_NATIVE"] == "OFF"
    assert not os.path.exists(os.path.join(PYTHON_DIR, "setup.py"))
    assert not os.path.exists(os.path.join(PYTHON_DIR, "pyproject.toml"))


@pytest.mark.skipif(not os.environ.get("COLIBRI_WHEEL"),
                    reason="no wheel given (COLIBRI_WHEEL; scripts/test.sh builds one with pip wheel .)")
def test_wheel_installs_and_finds_its_library(tmp_path):
    """The wheel scripts/test.sh built: what it holds, and an offline install
    of it into a folder that works from anywhere with nothing set."""
    whl = os.environ["COLIBRI_WHEEL"]
    # auditwheel's repaired wheel: a manylinux tag (or several, dot-joined).
    assert re.fullmatch(r"colibri-%s-py3-none-(manylinux_\d+_\d+_x86_64\.?)+\.whl" % re.escape(colibri.__version__),
                        os.path.basename(whl)), whl
    with zipfile.ZipFile(whl) as z:
        names = {n for n in z.namelist() if not n.endswith("/")}  # auditwheel adds folder entries
        lib = z.getinfo("colibri/libcolibri.so")
        assert z.read("colibri/libcolibri.so")[:4] == b"\x7fELF"
    assert lib.file_size > 100000
    py = {n for n in names if n.startswith("colibri/") and n.endswith(".py")}
    assert py == {"colibri/" + f for f in os.listdir(os.path.join(PYTHON_DIR, "colibri")) if f.endswith(".py")}
    # Shared libraries auditwheel copied in (liburing where the build found it).
    grafted = {n for n in names if n.startswith("colibri.libs/")}
    assert all(re.fullmatch(r"colibri\.libs/lib[a-z_]+-[0-9a-f]{8}\.so(\.\d+)*", n) for n in grafted), grafted
    # auditwheel's software bill of materials of what it copied in.
    sbom = {n for n in names if n.startswith("colibri-%s.dist-info/sboms/" % colibri.__version__)}
    assert names - py - grafted - sbom - {"colibri/libcolibri.so"} == {
        "colibri-%s.dist-info/%s" % (colibri.__version__, f) for f in ("METADATA", "WHEEL", "RECORD")}, sorted(names)
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-cache-dir",
                        "--disable-pip-version-check", "-q", "--target", str(target), whl],
                       capture_output=True, text=True, timeout=600, env=clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-c", "import colibri; print(colibri.library_path())"], cwd=str(tmp_path),
                       env=clean_env(PYTHONPATH=str(target)), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(target / "colibri" / "libcolibri.so")


def section_example(number):
    """The first python block of the section headed "## <number>. ..."."""
    text = open(DOC).read()
    for section in text.split("\n## ")[1:]:
        if section.startswith("%d. " % number):
            blocks = re.findall(r"```python\n(.*?)```", section, re.S)
            assert blocks, "section %d of %s has no python example" % (number, DOC)
            return blocks[0]
    raise AssertionError("%s has no section %d" % (DOC, number))


@pytest.mark.parametrize("which", ["cli", "experts", "accelerate"])
def test_doc_examples_run(which, tmp_path):
    code = section_example({"cli": 1, "experts": 2, "accelerate": 3}[which])
    assert {"cli": "export_routing", "experts": "ColibriExperts(", "accelerate": "accelerate("}[which] in code
    if which == "cli":
        c = find_cli()
        if c is None:
            pytest.skip("colibri CLI not found (set COLIBRI_CLI)")
        # Scratch paths first: the CLI path itself may lie under /tmp.
        code = code.replace("/tmp/", str(tmp_path) + "/").replace('"build/tools/colibri"', repr(c))
    r = run_python(code, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
