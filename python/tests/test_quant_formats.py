"""colibri.quantize / colibri.dequantize (the reference block quantisers of
src/util/quant_ref.cpp) against the gguf package's gguf.quants, the NumPy
port of ggml's reference code that writes and reads GGUF files:

- what colibri.quantize writes, gguf dequantises to the same float32 bits
  as colibri.dequantize, for every format;
- for the block formats gguf can quantise (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
  MXFP4, TQ1_0, TQ2_0), colibri's bytes are gguf's bytes;
- random blocks (every f16 scale finite) dequantise bit for bit alike.

The K quantisers' agreement with ggml itself is pinned in
tests/test_quant_ref.cpp (byte hashes from ggml's quantize_row_*_ref)."""

import zlib

import numpy as np
import pytest

import colibri
from helpers import rel_err

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402  (after the skip)
from gguf.quants import dequantize as gguf_dequantize, quantize as gguf_quantize  # noqa: E402

# dtype: (gguf type, elements per block, bytes per block, byte offsets of
# the f16 scale fields in a block)
FORMATS = {
    "q8_0": (GGMLQuantizationType.Q8_0, 32, 34, (0,)),
    "q4_0": (GGMLQuantizationType.Q4_0, 32, 18, (0,)),
    "q4_k": (GGMLQuantizationType.Q4_K, 256, 144, (0, 2)),
    "q5_k": (GGMLQuantizationType.Q5_K, 256, 176, (0, 2)),
    "q6_k": (GGMLQuantizationType.Q6_K, 256, 210, (208,)),
    "mxfp4": (GGMLQuantizationType.MXFP4, 32, 17, ()),
    "q4_1": (GGMLQuantizationType.Q4_1, 32, 20, (0, 2)),
    "q5_0": (GGMLQuantizationType.Q5_0, 32, 22, (0,)),
    "q5_1": (GGMLQuantizationType.Q5_1, 32, 24, (0, 2)),
    "iq4_nl": (GGMLQuantizationType.IQ4_NL, 32, 18, (0,)),
    "iq4_xs": (GGMLQuantizationType.IQ4_XS, 256, 136, (0,)),
    "q2_k": (GGMLQuantizationType.Q2_K, 256, 84, (80, 82)),
    "q3_k": (GGMLQuantizationType.Q3_K, 256, 110, (108,)),
    "tq1_0": (GGMLQuantizationType.TQ1_0, 256, 54, (52,)),
    "tq2_0": (GGMLQuantizationType.TQ2_0, 256, 66, (64,)),
}
GGUF_QUANTIZES = ("q8_0", "q4_0", "mxfp4", "q4_1", "q5_0", "q5_1", "tq1_0", "tq2_0")
# Formats read as stored, never made (their quantisers need an importance
# matrix): only their random blocks are compared, and quantising is refused.
READ_ONLY = {
    "iq2_xxs": (GGMLQuantizationType.IQ2_XXS, 256, 66, (0,)),
    "iq3_xxs": (GGMLQuantizationType.IQ3_XXS, 256, 98, (0,)),
    "iq1_s": (GGMLQuantizationType.IQ1_S, 256, 50, (0,)),
    # IQ1_M's f16 d lies in the top nibbles of its four scale words (48 .. 55).
    "iq1_m": (GGMLQuantizationType.IQ1_M, 256, 56, ()),
    "iq2_xs": (GGMLQuantizationType.IQ2_XS, 256, 74, (0,)),
    "iq2_s": (GGMLQuantizationType.IQ2_S, 256, 82, (0,)),
    "iq3_s": (GGMLQuantizationType.IQ3_S, 256, 110, (0,)),
}
# Loose round-trip bounds on normal data, a sanity check on the bindings
# (test_quant_ref.cpp holds the tight ones).
ROUND_TRIP_BOUND = {"q8_0": 0.01, "q4_0": 0.15, "q4_k": 0.12, "q5_k": 0.06, "q6_k": 0.03, "mxfp4": 0.2,
                    "q4_1": 0.15, "q5_0": 0.08, "q5_1": 0.08, "iq4_nl": 0.12, "iq4_xs": 0.12, "q2_k": 0.45,
                    "q3_k": 0.22, "tq1_0": 0.85, "tq2_0": 0.85}

KINDS = ("normal", "uniform", "heavy", "negative", "outliers", "small", "large", "sparse", "zeros")


def sample(kind, rows, n, seed):
    """rows x n float32 of one distribution. "sparse" keeps the -0.0s that
    multiplying by a mask leaves (gguf's Q4_0 takes the sign of its zero
    scale from the first element), and has all-zero blocks."""
    rng = np.random.default_rng(seed)
    shape = (rows, n)
    if kind == "normal":
        x = rng.standard_normal(shape)
    elif kind == "uniform":
        x = rng.uniform(-1, 1, shape)
    elif kind == "heavy":
        x = rng.standard_t(3, shape)
    elif kind == "negative":
        x = -np.abs(rng.standard_normal(shape)) - 0.1
    elif kind == "outliers":
        x = 0.02 * rng.standard_normal(shape)
        x[:, 77::256] = 1.0
        x[:, 5::97] = -3.0
    elif kind == "small":
        x = 1e-3 * rng.standard_normal(shape)
    elif kind == "large":
        x = 1e3 * rng.standard_normal(shape)
    elif kind == "sparse":
        x = rng.standard_normal(shape) * (rng.random(shape) < 0.05)
    else:
        x = np.zeros(shape)
    return np.ascontiguousarray(x, dtype=np.float32)


def seed_of(*parts):
    """A seed that is the same in every run (str hashes are salted)."""
    return zlib.crc32(repr(parts).encode())


def f32_bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_same_floats(ours, theirs, what):
    assert ours.shape == theirs.shape, what
    diff = f32_bits(ours) != f32_bits(theirs)
    if diff.any():
        i = tuple(int(v) for v in np.argwhere(diff)[0])
        pytest.fail("%s: %d values differ, first at %s: %r (colibri) vs %r (gguf)"
                    % (what, int(diff.sum()), i, ours[i], theirs[i]))


def row_sizes(dtype):
    """Row lengths to test: a few blocks, and for the 32-element formats a
    length that is not a multiple of 256."""
    block = FORMATS[dtype][1]
    return (512, 96) if block == 32 else (512,)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", list(FORMATS))
def test_dequantize_matches_gguf(dtype, kind):
    qtype, block, block_bytes, _ = FORMATS[dtype]
    for n in row_sizes(dtype):
        x = sample(kind, 6, n, seed=seed_of(dtype, kind, n))
        q = colibri.quantize(x, dtype)
        assert q.dtype == np.uint8
        assert q.shape == (6, n // block * block_bytes)
        ours = colibri.dequantize(q, dtype, n)
        assert ours.dtype == np.float32
        assert ours.shape == (6, n)
        assert_same_floats(ours, gguf_dequantize(q, qtype), "%s %s n=%d" % (dtype, kind, n))
        assert np.isfinite(ours).all()
        if kind == "zeros":
            assert (ours == 0).all()
        elif kind == "normal":
            assert rel_err(ours, x) < ROUND_TRIP_BOUND[dtype]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", GGUF_QUANTIZES)
def test_quantize_matches_gguf(dtype, kind):
    qtype, _, block_bytes, _ = FORMATS[dtype]
    for n in row_sizes(dtype):
        x = sample(kind, 6, n, seed=seed_of(dtype, kind, n, "quantize"))
        ours = colibri.quantize(x, dtype)
        theirs = gguf_quantize(x, qtype)
        assert ours.shape == theirs.shape
        if dtype in ("q4_1", "q5_1"):
            # A block whose minimum is a zero: ggml's loop keeps the first
            # zero's sign, as colibri does; NumPy's min reduction picks
            # either. Both decode to the same values; the sign bit of a zero
            # m (f16 0x0000 / 0x8000 at bytes 2-3) is left out of the comparison.
            ours, theirs = (clear_zero_sign(a, block_bytes, 2) for a in (ours, theirs))
        if not np.array_equal(ours, theirs):
            blocks = (ours.reshape(-1, block_bytes) != theirs.reshape(-1, block_bytes)).any(axis=1)
            b = int(np.argmax(blocks))
            pytest.fail("%s %s n=%d: %d blocks differ, first block %d: %s (colibri) vs %s (gguf)"
                        % (dtype, kind, n, int(blocks.sum()), b, ours.reshape(-1, block_bytes)[b].tolist(),
                           theirs.reshape(-1, block_bytes)[b].tolist()))


def clear_zero_sign(q, block_bytes, offset):
    """q with the f16 at `offset` of every block turned from -0 into +0."""
    blocks = q.reshape(-1, block_bytes).copy()
    field = blocks[:, offset:offset + 2].copy().view("<u2")
    field[field == 0x8000] = 0
    blocks[:, offset:offset + 2] = field.view(np.uint8)
    return blocks.reshape(q.shape)


def random_blocks(dtype, rows, blocks_per_row, seed):
    """Random bytes, every f16 scale field a random finite value (subnormals,
    zeros and negatives included: an all-ones exponent loses its top bit)."""
    _, _, block_bytes, fields = {**FORMATS, **READ_ONLY}[dtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * blocks_per_row, block_bytes), dtype=np.uint8)
    for off in fields:
        h = rng.integers(0, 1 << 16, rows * blocks_per_row, dtype=np.uint16)
        h = np.where((h & 0x7C00) == 0x7C00, h ^ 0x4000, h).astype("<u2")
        raw[:, off:off + 2] = h.view(np.uint8).reshape(-1, 2)
    if dtype == "iq1_m":
        words = raw[:, 48:56].copy().view("<u2")
        d = (words[:, 0] >> 12) | ((words[:, 1] >> 8) & 0xF0) | ((words[:, 2] >> 4) & 0xF00) | (words[:, 3] & 0xF000)
        d = np.where((d & 0x7C00) == 0x7C00, d ^ 0x4000, d).astype("<u2")
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        raw[:, 48:56] = words.view(np.uint8)
    if dtype == "mxfp4":
        # Exponents past 252 overflow float32 (2^125 * 12), in gguf's
        # dequantiser as in ours; the quantiser writes at most 252.
        raw[:, 0] %= 253
    return raw.reshape(rows, blocks_per_row * block_bytes)


@pytest.mark.parametrize("dtype", list(FORMATS) + list(READ_ONLY))
def test_random_blocks_dequantize_like_gguf(dtype):
    qtype, block, _, _ = {**FORMATS, **READ_ONLY}[dtype]
    for seed in range(3):
        raw = random_blocks(dtype, 4, 4096 // block, seed)
        ours = colibri.dequantize(raw, dtype, 4096)
        assert_same_floats(ours, gguf_dequantize(raw, qtype), "%s random blocks, seed %d" % (dtype, seed))
        assert np.isfinite(ours).all()


@pytest.mark.parametrize("dtype", list(READ_ONLY))
def test_read_only_formats_refuse_to_quantize(dtype):
    with pytest.raises(colibri.ColibriError, match="importance matrix"):
        colibri.quantize(np.ones((1, 256), np.float32), dtype)
