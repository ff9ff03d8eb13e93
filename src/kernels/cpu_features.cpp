// CPU feature detection. Compiled without ISA flags: this code decides which
// kernels may run, so it must itself run on any x86-64.
//
// A feature is usable only when the CPU has it (CPUID) AND the OS saves the
// matching register state on context switches (XCR0). A CPU with AVX-512 under
// an OS or hypervisor that does not enable ZMM state would fault (#UD) on the
// first AVX-512 instruction, so CPUID alone is not enough.
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/amx.h"
#include "kernels/kernels.h"
#include "kernels/quant_dot.h"

#if defined(COLIBRI_HAVE_X86_KERNELS) && (defined(__x86_64__) || defined(__i386__))
#define COLIBRI_DETECT_X86 1
#include <cpuid.h>
#endif

namespace colibri::kernels {
namespace {

struct CpuFeatures {
  Isa level = Isa::kScalar;
  bool amd = false;
  uint32_t family = 0;  // CPUID's display family (base + extended)
  bool avx512_bf16 = false;
  bool avx512_vnni = false;
  bool avx_vnni = false;  // the VEX form, ymm only
};

#if defined(COLIBRI_DETECT_X86)

// Inline asm rather than _xgetbv(): the intrinsic needs -mxsave, and this file
// is deliberately built without ISA flags. Only called once OSXSAVE is known
// to be set, otherwise xgetbv itself is #UD.
uint64_t read_xcr0() {
  uint32_t eax = 0;
  uint32_t edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0u));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

bool bit(uint32_t reg, int b) { return ((reg >> b) & 1u) != 0; }

CpuFeatures probe() {
  CpuFeatures out;
  uint32_t eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return out;
  // "AuthenticAMD" / "HygonGenuine" in ebx, edx, ecx: the first four bytes tell.
  out.amd = ebx == 0x68747541u /* "Auth" */ || ebx == 0x6f677948u /* "Hygo" */;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return out;
  const uint32_t base_family = (eax >> 8) & 0xfu;
  out.family = base_family + (base_family == 0xfu ? (eax >> 20) & 0xffu : 0u);
  const bool osxsave = bit(ecx, 27);
  const bool avx = bit(ecx, 28);
  const bool fma = bit(ecx, 12);
  const bool f16c = bit(ecx, 29);
  if (!osxsave || !avx) return out;

  const uint64_t xcr0 = read_xcr0();
  const bool os_avx = (xcr0 & 0x6u) == 0x6u;             // XMM (bit 1) + YMM (bit 2)
  const bool os_avx512 = os_avx && (xcr0 & 0xe0u) == 0xe0u;  // opmask, ZMM_Hi256, Hi16_ZMM
  if (!os_avx) return out;

  // __get_cpuid_count checks the maximum leaf itself and fails if 7 is absent.
  uint32_t max_subleaf = 0;
  if (!__get_cpuid_count(7, 0, &max_subleaf, &ebx, &ecx, &edx)) return out;
  const bool avx2 = bit(ebx, 5);
  const bool avx512f = bit(ebx, 16);
  const bool avx512dq = bit(ebx, 17);
  const bool avx512bw = bit(ebx, 30);
  const bool avx512vl = bit(ebx, 31);
  const bool avx512_vnni = bit(ecx, 11);
  bool avx512_bf16 = false;
  bool avx_vnni = false;
  if (max_subleaf >= 1) {
    uint32_t a1 = 0, b1 = 0, c1 = 0, d1 = 0;
    if (__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) {
      avx_vnni = bit(a1, 4);
      avx512_bf16 = bit(a1, 5);
    }
  }

  // The AVX2 kernels also use FMA and F16C (f16 weights), so all three gate
  // the level; no shipping CPU has AVX2 without them, but VMs can mask bits.
  if (!(avx2 && fma && f16c)) return out;
  out.level = Isa::kAvx2;
  // Its kernels are the AVX2 ones with vpdpbusd on ymm, so it needs that
  // level (YMM state is already checked above).
  out.avx_vnni = avx_vnni;
  if (os_avx512 && avx512f && avx512bw && avx512vl && avx512dq) {
    out.level = Isa::kAvx512;
    out.avx512_bf16 = avx512_bf16;
    out.avx512_vnni = avx512_vnni;
  }
  return out;
}

#else

CpuFeatures probe() { return CpuFeatures{}; }

#endif

const CpuFeatures& features() {
  static const CpuFeatures f = probe();
  return f;
}

}  // namespace

Isa detect_isa() {
  // amx_available() checks only AMX itself on top of cpu_has_avx512_bf16(),
  // never detect_isa(), so this initialisation does not recurse.
  static const Isa isa = features().level == Isa::kAvx512 && amx_available() ? Isa::kAmx : features().level;
  return isa;
}

bool cpu_has_avx512_bf16() { return features().avx512_bf16; }

bool cpu_has_avx512_vnni() { return features().avx512_vnni; }

bool cpu_has_avx_vnni() { return features().avx_vnni; }

bool cpu_is_amd() { return features().amd; }

uint32_t cpu_family() { return features().family; }

std::string cpu_signature() {
  static const std::string signature = [] {
    std::string s;
#if defined(__x86_64__) || defined(__i386__)
    uint32_t regs[12] = {};
    uint32_t max_ext = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(0x80000000u, &max_ext, &b, &c, &d) && max_ext >= 0x80000004u) {
      for (uint32_t leaf = 0; leaf < 3; ++leaf) {
        __get_cpuid(0x80000002u + leaf, &regs[leaf * 4], &regs[leaf * 4 + 1], &regs[leaf * 4 + 2], &regs[leaf * 4 + 3]);
      }
      char brand[49] = {};
      std::memcpy(brand, regs, 48);
      s = brand;
      // Trim the padding some CPUs put around the brand.
      while (!s.empty() && (s.back() == ' ' || s.back() == '\0')) s.pop_back();
      s.erase(0, s.find_first_not_of(' '));
    }
    uint32_t eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(1, &eax, &ebx, &ecx, &edx)) {
      const uint32_t family = ((eax >> 8) & 0xfu) + (((eax >> 8) & 0xfu) == 0xfu ? ((eax >> 20) & 0xffu) : 0u);
      const uint32_t model = ((eax >> 4) & 0xfu) | ((((eax >> 8) & 0xfu) == 6u || ((eax >> 8) & 0xfu) == 0xfu ? (eax >> 16) & 0xfu : 0u) << 4);
      s += " (family " + std::to_string(family) + " model " + std::to_string(model) + " stepping " +
           std::to_string(eax & 0xfu) + ")";
    }
#endif
    if (s.empty()) s = "unknown CPU";
    return s;
  }();
  return signature;
}

// AMD family 26 (0x1A) is Zen 5, where the non-temporal far prefetch won;
// Zen 3 and Zen 4 are family 25, where it lost (kernels.h).
constexpr uint32_t kFirstNtaFamily = 26;

bool far_prefetch_nta() {
  // Cached, as default_isa(): every model in the process agrees.
  static const bool nta = [] {
    const char* forced = std::getenv("COLIBRI_PREFETCH");
    if (forced != nullptr && std::strcmp(forced, "nta") == 0) return true;
    if (forced != nullptr && std::strcmp(forced, "l2") == 0) return false;
    return cpu_is_amd() && cpu_family() >= kFirstNtaFamily;
  }();
  return nta;
}

}  // namespace colibri::kernels
