"""Block-scaled FP8 weights as Hugging Face checkpoints store them
(DeepSeek-V3/R1, Qwen3 FP8, GLM FP8: `quantization_config.quant_method =
"fp8"`): a float8_e4m3fn matrix and its `weight_scale_inv`, one float per
tile of `weight_block_size` (128 x 128), the weight being codes * scale.

Colibri's fp8_e4m3 rows hold the same codes in blocks of 128 along a row,
each under its tile's scale (docs/FORMAT.md), so a checkpoint's FP8 tensor
becomes Colibri's rows by interleaving scales and codes: no value changes.
"""

import math

BLOCK = 128  # codes per fp8_e4m3 block (one float scale each)
_BLOCK_BYTES = 4 + BLOCK


def _torch():
    import torch

    return torch


def checkpoint_block_size(quant, where):
    """(rows, columns) of a checkpoint's scale tiles from its
    quantization_config (a dict or transformers' config object); ValueError
    for FP8 flavours Colibri does not read."""
    get = quant.get if isinstance(quant, dict) else (lambda k, d=None: getattr(quant, k, d))
    fmt = get("fmt", "e4m3") or "e4m3"
    if fmt != "e4m3":
        raise ValueError("%s: quantization_config.fmt = %r; Colibri reads e4m3 FP8 checkpoints" % (where, fmt))
    scheme = get("activation_scheme", "dynamic") or "dynamic"
    if scheme != "dynamic":
        raise ValueError("%s: quantization_config.activation_scheme = %r; Colibri reads FP8 weights with dynamic "
                         "(unquantised) activations" % (where, scheme))
    block = get("weight_block_size", None)
    if block is None or len(block) != 2 or int(block[0]) < 1 or int(block[1]) < 1:
        raise ValueError("%s: quantization_config.weight_block_size = %r; Colibri reads block-scaled FP8 "
                         "checkpoints ([rows, columns], e.g. [128, 128])" % (where, block))
    if int(block[1]) % BLOCK:
        raise ValueError("%s: quantization_config.weight_block_size = %r: the column block must be a multiple of %d "
                         "(one fp8_e4m3 block's scale)" % (where, block, BLOCK))
    return int(block[0]), int(block[1])


class Fp8Weight:
    """A checkpoint's FP8 matrix [rows, columns] (torch.float8_e4m3fn) and its
    scales [ceil(rows / block_rows), ceil(columns / block_cols)]."""

    dtype_name = "fp8_e4m3"

    def __init__(self, codes, scale_inv, block, name):
        torch = _torch()
        self.name = name
        if codes.dtype != torch.float8_e4m3fn or codes.dim() != 2:
            raise ValueError("%s: expected a 2-D float8_e4m3fn tensor, got %s %s"
                             % (name, codes.dtype, list(codes.shape)))
        rows, cols = codes.shape
        br, bc = block
        want = (math.ceil(rows / br), math.ceil(cols / bc))
        if scale_inv.dim() != 2 or tuple(scale_inv.shape) != want:
            raise ValueError("%s_scale_inv has shape %s; a [%d, %d] weight in %d x %d blocks needs %s"
                             % (name, list(scale_inv.shape), rows, cols, br, bc, list(want)))
        if not scale_inv.is_floating_point():
            raise ValueError("%s_scale_inv has dtype %s, expected a float type" % (name, scale_inv.dtype))
        self.codes, self.scale_inv, self.block = codes, scale_inv, (br, bc)
        self.shape = (rows, cols)

    @property
    def dtype(self):
        return _torch().float8_e4m3fn

    def _row_scales(self):
        """float32 [rows, ceil(cols / 128)]: each 128-code block's scale."""
        torch = _torch()
        rows, cols = self.shape
        br, bc = self.block
        s = self.scale_inv.to(torch.float32)
        s = s.repeat_interleave(br, dim=0)[:rows]
        per_block = torch.arange(math.ceil(cols / BLOCK)) * BLOCK // bc
        return s[:, per_block].contiguous()

    def rows(self, begin, end):
        """Rows [begin, end) as an Fp8Weight (begin on a tile boundary)."""
        br = self.block[0]
        if begin % br:
            raise ValueError("%s: rows from %d do not start a %d-row scale tile" % (self.name, begin, br))
        return Fp8Weight(self.codes[begin:end], self.scale_inv[begin // br:math.ceil(end / br)], self.block,
                         self.name)

    def packed(self):
        """Colibri's fp8_e4m3 rows: uint8 [rows, ceil(cols / 128) * 132]
        (per block the float32 scale, then the 128 codes, the last block
        padded with zero codes)."""
        torch = _torch()
        rows, cols = self.shape
        nb = math.ceil(cols / BLOCK)
        codes = self.codes.contiguous().view(torch.uint8)
        if nb * BLOCK != cols:
            codes = torch.nn.functional.pad(codes, (0, nb * BLOCK - cols))
        scales = self._row_scales().view(torch.uint8).reshape(rows, nb, 4)
        out = torch.cat((scales, codes.reshape(rows, nb, BLOCK)), dim=2)
        return out.reshape(rows, nb * _BLOCK_BYTES).numpy()

    def dequantize(self):
        """float32 [rows, cols]: each code's value times its block's scale,
        rounded once to float32 (Colibri's reference dequantiser's bits)."""
        torch = _torch()
        rows, cols = self.shape
        s = self._row_scales().repeat_interleave(BLOCK, dim=1)[:, :cols]
        return self.codes.to(torch.float32) * s

    def __repr__(self):
        return "Fp8Weight(%s, %s, block=%s)" % (self.name, list(self.shape), list(self.block))
