"""The ctypes mirrors of colibri.h's structs (colibri/_lib.py) against the C
compiler's own layout: every field at the same offset, the same fields, and
the same size (for structs that end in a reserved tail, the tail starts at
sizeof of the C struct). The layout comes from tests/abi_layout.c, built
with the library ($COLIBRI_ABI_LAYOUT; ctest sets it)."""

import ctypes
import json
import os
import subprocess

import pytest

import colibri
from colibri import _lib

MIRRORS = {
    "colibri_open_options_t": _lib.OpenOptions,
    "colibri_router_desc_t": _lib.RouterDesc,
    "colibri_expert_weights_t": _lib.ExpertWeights,
    "colibri_layer_weights_t": _lib.LayerWeights,
    "colibri_model_desc_t": _lib.ModelDesc,
    "colibri_infer_t": _lib.InferArgs,
    "colibri_linear_desc_t": _lib.LinearDesc,
    "colibri_attention_desc_t": _lib.AttentionDesc,
    "colibri_rope_desc_t": _lib.RopeDesc,
    "colibri_swap_source_t": _lib.SwapSource,
    "colibri_model_info_t": _lib.ModelInfo,
    "colibri_stats_t": _lib.Stats,
    "colibri_route_compile_options_t": _lib.RouteCompileOptions,
}


def abi_layout_program():
    p = os.environ.get("COLIBRI_ABI_LAYOUT")
    if p:
        assert os.path.exists(p), "COLIBRI_ABI_LAYOUT=%s does not exist" % p
        return p
    d = os.path.dirname(os.path.realpath(colibri.library_path()))
    c = os.path.join(d, "tests", "abi_layout")
    if not os.path.exists(c):
        pytest.skip("tests/abi_layout not found beside the library: set COLIBRI_ABI_LAYOUT")
    return c


@pytest.fixture(scope="module")
def c_layout():
    out = subprocess.run([abi_layout_program()], capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out)


def test_every_mirrored_struct_is_measured(c_layout):
    assert set(c_layout) == set(MIRRORS)


@pytest.mark.parametrize("name", sorted(MIRRORS))
def test_ctypes_layout_matches_c(c_layout, name):
    mirror = MIRRORS[name]
    c = c_layout[name]
    fields = {f[0]: getattr(mirror, f[0]).offset for f in mirror._fields_ if f[0] != "_reserved"}
    assert fields == c["fields"], "%s: ctypes offsets %s, C offsets %s" % (name, fields, c["fields"])
    if any(f[0] == "_reserved" for f in mirror._fields_):
        # The tail begins where the listed fields end; the C struct is that
        # rounded up to its alignment (its trailing padding falls in the
        # tail), so no C field is missing from the mirror, and the library's
        # sizeof(C struct) bytes fit in the ctypes memory.
        align = ctypes.alignment(mirror)
        fields_end = mirror._reserved.offset
        assert c["size"] == (fields_end + align - 1) // align * align, (name, fields_end, c["size"])
        assert ctypes.sizeof(mirror) >= c["size"], name
    else:
        assert ctypes.sizeof(mirror) == c["size"], name
