// AMX-BF16 peak of colibri_probe (compiled with -mamx-tile -mamx-bf16; only
// called after CPUID, XCR0 and the kernel said yes). Not a limit Colibri's
// kernels aim at today, but oneDNN (so PyTorch bf16) uses it on CPUs that
// have it, and a bf16 figure above the vdpbf16ps peak needs explaining.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include "probe_kernels.h"

namespace colibri_probe {

namespace {

constexpr long kArchReqXcompPerm = 0x1023;  // <asm/prctl.h>, Linux >= 5.16
constexpr long kXfeatureXtiledata = 18;

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

}  // namespace

bool amx_enable() {
  // Linux hands out the 8 KiB tile state only to processes that ask.
  return ::syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

float amx_bf16_dot(uint64_t iters) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) uint16_t a[16 * 32], b[16 * 32];
  for (int i = 0; i < 16 * 32; ++i) {
    a[i] = 0x3f80;  // 1.0
    b[i] = 0x3400;  // 2^-23
  }
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b, 64);
  // Four independent accumulator tiles from two A and two B tiles: the
  // classic 2x2 register blocking of an AMX GEMM, with no memory traffic.
  for (uint64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float c[4][16 * 16];
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
  _tile_release();
  return c[0][0] + c[1][17] + c[2][34] + c[3][255];
}

}  // namespace colibri_probe
