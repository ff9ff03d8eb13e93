"""Test set-up: makes `colibri` importable from the source tree, and ends
the whole run with exit code 77 (which ctest reports as skipped) when this
Python lacks NumPy or PyTorch.

With COLIBRI_TEST_INSTALLED=1 (scripts/test.sh's wheel stage) the tests run
against the colibri installed in this interpreter instead: the source tree's
python/ is not put on sys.path, and the run stops at once unless colibri was
imported from this environment's site-packages and loaded the libcolibri.so
bundled in it (so COLIBRI_LIBRARY must be unset)."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.dirname(HERE)  # python/ of the source tree
INSTALLED = os.environ.get("COLIBRI_TEST_INSTALLED", "") not in ("", "0")
sys.path.insert(0, HERE)  # helpers, reference_moe
if not INSTALLED:
    sys.path.insert(0, PYTHON_DIR)  # for `import colibri`

try:
    import numpy as np
    import torch  # noqa: F401  (only checked for)
    MISSING = None
except ImportError as e:  # pragma: no cover
    MISSING = str(e)


def installed_package_problem():
    """Why the imported colibri is not the installed package with its
    bundled library (None if it is); for COLIBRI_TEST_INSTALLED runs."""
    import colibri

    pkg = os.path.dirname(os.path.realpath(colibri.__file__))
    prefix = os.path.realpath(sys.prefix)
    if os.environ.get("COLIBRI_LIBRARY"):
        return "COLIBRI_LIBRARY is set (%s): unset it to test the bundled library" % os.environ["COLIBRI_LIBRARY"]
    if not pkg.startswith(prefix + os.sep):
        return "colibri was imported from %s, not from this environment (%s)" % (pkg, prefix)
    if pkg.startswith(os.path.realpath(PYTHON_DIR) + os.sep):
        return "colibri was imported from the source tree (%s)" % pkg
    bundled = os.path.join(pkg, "libcolibri.so")
    loaded = os.path.realpath(colibri.library_path())
    if loaded != bundled:
        return "colibri loaded %s, not the library bundled in the package (%s)" % (loaded, bundled)
    return None


def pytest_configure(config):
    if MISSING:  # before collection: the test modules import both
        pytest.exit("skipping the colibri Python tests: %s (run scripts/setup.sh and use .venv/bin/python)" % MISSING,
                    returncode=77)
    if INSTALLED:
        why = installed_package_problem()
        if why:
            pytest.exit("COLIBRI_TEST_INSTALLED: " + why, returncode=3)


if not MISSING:
    import colibri
    from helpers import random_experts

    def pytest_report_header(config):
        return "colibri: %s%s; libcolibri: %s (version %s, v2 ABI: %s)" % (
            os.path.dirname(colibri.__file__), " (installed)" if INSTALLED else "",
            colibri.library_path(), colibri.library_version(), colibri.has_open_memory())

    @pytest.fixture(scope="session")
    def small_dir(tmp_path_factory):
        """A 2-layer f32 model directory (4 experts, d_model 32, d_ff 24) and its weights."""
        rng = np.random.default_rng(7)
        layers = [random_experts(rng, 4, 32, 24) for _ in range(2)]
        path = tmp_path_factory.mktemp("model") / "m"
        colibri.save_model(path, [{"experts": ex} for ex in layers], dtype="f32")
        return str(path), layers

    @pytest.fixture
    def small_model(small_dir):
        path, layers = small_dir
        m = colibri.Model(path, threads=2)
        yield m, layers
        m.close()
