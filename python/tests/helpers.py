"""Helpers shared by the tests (plain functions; fixtures are in conftest.py)."""

import os

import numpy as np
import pytest

import colibri

HERE = os.path.dirname(os.path.abspath(__file__))
# COLIBRI_TEST_INSTALLED=1: testing the installed package (conftest.py), not python/.
INSTALLED = os.environ.get("COLIBRI_TEST_INSTALLED", "") not in ("", "0")


def import_paths():
    """What a child Python needs on sys.path to import what these tests do:
    this folder (helpers, reference_moe), and python/ unless the tests run
    against the installed package."""
    return [HERE] if INSTALLED else [HERE, os.path.dirname(HERE)]


needs_v2 = pytest.mark.skipif(not colibri.has_open_memory(),
                              reason="the loaded libcolibri predates colibri_open_memory (v2 ABI)")


def swiglu_reference(x, experts, ids, weights):
    """float64 NumPy reference of one MoE layer: experts [(gate, up, down)]."""
    x = np.asarray(x, dtype=np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            g, u, d = (np.asarray(a, dtype=np.float64) for a in experts[e])
            h = g @ x[t]
            h = h / (1.0 + np.exp(-h)) * (u @ x[t])
            out[t] += float(weights[t, j]) * (d @ h)
    return out


def random_experts(rng, E, D, F, dtype=np.float32):
    return [tuple((rng.standard_normal(s) / np.sqrt(s[1])).astype(dtype) for s in ((F, D), (F, D), (D, F)))
            for _ in range(E)]



def rel_err(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def find_cli():
    """The colibri CLI: $COLIBRI_CLI, else tools/colibri beside (or one level
    above) the loaded library's directory; None if neither exists."""
    p = os.environ.get("COLIBRI_CLI")
    if p and os.path.exists(p):
        return p
    d = os.path.dirname(os.path.realpath(colibri.library_path()))
    for c in (os.path.join(d, "tools", "colibri"), os.path.join(d, "..", "tools", "colibri")):
        if os.path.exists(c):
            return c
    return None
