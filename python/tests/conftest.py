"""Test set-up: makes `colibri` importable from the source tree, and ends
the whole run with exit code 77 (which ctest reports as skipped) when this
Python lacks NumPy or PyTorch."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # python/, for `import colibri`

try:
    import numpy as np
    import torch  # noqa: F401  (only checked for)
    MISSING = None
except ImportError as e:  # pragma: no cover
    MISSING = str(e)


def pytest_configure(config):
    if MISSING:  # before collection: the test modules import both
        pytest.exit("skipping the colibri Python tests: %s (run scripts/setup.sh and use .venv/bin/python)" % MISSING,
                    returncode=77)


if not MISSING:
    import colibri
    from helpers import random_experts

    def pytest_report_header(config):
        return "libcolibri: %s (version %s, v2 ABI: %s)" % (
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
