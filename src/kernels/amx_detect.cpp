// AMX detection and the Linux permission request. Compiled without ISA flags
// (like cpu_features.cpp): it decides whether the AMX kernels may run, so it
// must itself run on any x86-64.
#include "kernels/amx.h"

#if defined(COLIBRI_HAVE_X86_KERNELS) && defined(__x86_64__) && defined(__linux__)
#define COLIBRI_AMX_DETECT 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <cstdint>

namespace colibri::kernels {
namespace {

#if defined(COLIBRI_AMX_DETECT)

constexpr long kArchReqXcompPerm = 0x1023;  // <asm/prctl.h>, Linux >= 5.16
constexpr long kXfeatureXtiledata = 18;

// Inline asm, not _xgetbv() (which needs -mxsave). Only called once CPUID
// reported OSXSAVE; otherwise xgetbv itself faults.
uint64_t read_xcr0() {
  uint32_t eax = 0;
  uint32_t edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0u));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

bool bit(uint32_t reg, int b) { return ((reg >> b) & 1u) != 0; }

bool probe() {
  // The kernels also use AVX-512 (F/BW/VL/DQ) and AVX512_BF16 for packing
  // and epilogues; cpu_features.cpp has already checked CPUID + XCR0 for
  // those (cpu_has_avx512_bf16() implies the AVX-512 level). Not
  // detect_isa(): that one asks this function whether to report kAmx.
  if (!cpu_has_avx512_bf16()) return false;
  uint32_t eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !bit(ecx, 27)) return false;  // OSXSAVE
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = bit(edx, 22);
  const bool amx_tile = bit(edx, 24);
  if (!amx_bf16 || !amx_tile) return false;
  const uint64_t xcr0 = read_xcr0();
  const uint64_t tile_bits = (1ull << 17) | (1ull << 18);  // XTILECFG, XTILEDATA
  if ((xcr0 & tile_bits) != tile_bits) return false;
  // Linux (>= 5.16) enables the 8 KiB tile data state per process, on
  // request; without it the first tile instruction gets SIGILL. The grant
  // covers all threads of the process, present and future. Fails with ENOSPC
  // when an existing sigaltstack is too small for the larger signal frame.
  return ::syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

bool probe_int8() {
  if (!amx_available()) return false;
  uint32_t eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && bit(edx, 25);  // AMX-INT8
}

#else

bool probe() { return false; }
bool probe_int8() { return false; }

#endif

}  // namespace

bool amx_available() {
  static const bool ok = probe();
  return ok;
}

bool amx_int8_available() {
  static const bool ok = probe_int8();
  return ok;
}

}  // namespace colibri::kernels
