// <immintrin.h> for the ISA-flagged kernel translation units.
//
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own
// _mm512_undefined_*() placeholders (GCC PR105593); the warnings point into
// the headers, so silencing them around the include keeps ours visible.
#pragma once

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
