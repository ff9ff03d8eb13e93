// Codebooks of the grid i-quant formats (quant_blocks.h): each grid index
// names 8 (IQ3_XXS: 4) magnitudes, which the block's sign bits then negate
// one by one, or (IQ1) 8 values from {-1, 0, 1} that a shift then offsets.
// One aggregate of plain arrays, defined out of line (iq_grids.cpp), so the
// instruction-set files read the tables without emitting symbols of their
// own (tests/isa_linkage.sh).
#pragma once

#include <cstdint>

namespace colibri {

struct IqTables {
  // IQ2_XXS: 256 grid points of 8 values from {8, 25, 43}, 8 bytes each
  // (byte j = value j), as ggml's iq2xxs_grid.
  uint64_t iq2xxs_grid[256];
  // The sign bytes of the IQ2 formats: 7 stored bits and an eighth that
  // makes the count of set bits even (bit j set: value j is negative), as
  // ggml's ksigns_iq2xs.
  uint8_t iq2_signs[128];
  // The same signs as 8 bytes of +1 or -1 (byte j: -1 where bit j is set),
  // for the kernels that put them on the activations (vpsignb).
  uint64_t iq2_sign_bytes[128];
  // IQ1_S and IQ1_M: 2048 grid points of 8 values from {-1, 0, 1}, 8 bytes
  // each (byte j = value j as int8), as ggml's iq1s_grid.
  uint64_t iq1s_grid[2048];
  // IQ3_XXS: 256 grid points of 4 values from {4, 12, .., 52, 62}, 4 bytes
  // each, as ggml's iq3xxs_grid.
  uint32_t iq3xxs_grid[256];
  // IQ2_XS and IQ2_S: 512 and 1024 grid points as IQ2_XXS's (the first 256
  // of neither are IQ2_XXS's), as ggml's iq2xs_grid and iq2s_grid.
  uint64_t iq2xs_grid[512];
  uint64_t iq2s_grid[1024];
  // IQ3_S: 512 grid points of 4 values from {1, 3, .., 15}, as ggml's iq3s_grid.
  uint32_t iq3s_grid[512];
};

extern const IqTables kIqTables;

}  // namespace colibri
