// ISA selection and kernel tables. Compiled without ISA flags: the per-ISA
// tables are only touched after detect_isa() says the level is usable, so no
// code from an AVX translation unit ever runs on a CPU that lacks it.
#include <cstdlib>

#include "kernels/kernels.h"


namespace colibri::kernels {
namespace {

char ascii_lower(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }

bool equals_ignore_case(const char* a, const char* b) {
  for (; *a != '\0' && *b != '\0'; ++a, ++b) {
    if (ascii_lower(*a) != ascii_lower(*b)) return false;
  }
  return *a == *b;
}

Isa compute_default_isa() {
  const Isa detected = detect_isa();
  Isa requested = detected;
  // An unknown value is ignored rather than fatal: this runs lazily from hot
  // setup paths that have no way to report it, and the detected level is
  // always a safe answer.
  if (!parse_isa(std::getenv("COLIBRI_ISA"), &requested)) return detected;
  return requested < detected ? requested : detected;
}

}  // namespace

KernelScratch::~KernelScratch() {
  for (void* p : data_) std::free(p);
}

void* KernelScratch::get(int slot, size_t bytes) {
  if (bytes > size_[slot]) {
    std::free(data_[slot]);
    // aligned_alloc wants a size that is a multiple of the alignment.
    data_[slot] = bytes <= limit_ ? std::aligned_alloc(64, (bytes + 63) / 64 * 64) : nullptr;
    size_[slot] = data_[slot] != nullptr ? bytes : 0;
  }
  return data_[slot];
}

void* scratch_buffer(KernelScratch* scratch, int slot, size_t bytes) {
  return scratch != nullptr ? scratch->get(slot, bytes) : nullptr;
}

Isa default_isa() {
  // Cached so every engine in the process agrees even if the environment is
  // modified later (getenv is also not safe against concurrent setenv).
  static const Isa isa = compute_default_isa();
  return isa;
}

bool isa_supported(Isa isa) { return isa <= detect_isa(); }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAmx:
      return "amx";
  }
  return "unknown";
}

bool parse_isa(const char* text, Isa* out) {
  if (text == nullptr || out == nullptr) return false;
  static constexpr Isa kAll[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAmx};
  for (Isa isa : kAll) {
    if (equals_ignore_case(text, isa_name(isa))) {
      *out = isa;
      return true;
    }
  }
  return false;
}

const KernelTable& kernel_table(Isa isa) {
  // Levels are cumulative (detection only reports AVX-512 when AVX2 is also
  // usable), so the highest supported level <= isa is min(isa, detected).
  const Isa detected = detect_isa();
  const Isa level = isa < detected ? isa : detected;
#if defined(COLIBRI_HAVE_X86_KERNELS)
  switch (level) {
    case Isa::kAmx:  // the tiles only serve prefill (plan_kernels)
    case Isa::kAvx512:
      return avx512_kernels();
    case Isa::kAvx2:
      return avx2_kernels();
    case Isa::kScalar:
      break;
  }
#else
  (void)level;
#endif
  return scalar_kernels();
}

void glu_pairs_scalar(const Epilogue& e, int32_t f0, const float* o, int32_t fn, float* h) {
  for (int32_t f = 0; f < fn; ++f) h[f] = apply_glu(e, f0 + f, o[2 * f], o[2 * f + 1]);
}

GluPairsFn glu_pairs(Isa isa) {
#if defined(COLIBRI_HAVE_X86_KERNELS)
  const Isa detected = detect_isa();
  const Isa level = isa < detected ? isa : detected;
  if (level >= Isa::kAvx512) return glu_pairs_avx512;
  if (level >= Isa::kAvx2) return glu_pairs_avx2;
#else
  (void)isa;
#endif
  return glu_pairs_scalar;
}

bool bf16_compute_available(Isa isa) {
#if defined(COLIBRI_HAVE_X86_KERNELS)
  // cpu_has_avx512_bf16() implies detect_isa() >= kAvx512, so the level
  // check is what lets COLIBRI_ISA=avx2/scalar select the lower kernels.
  return isa >= Isa::kAvx512 && cpu_has_avx512_bf16();
#else
  (void)isa;
  return false;
#endif
}

}  // namespace colibri::kernels
