// sloserve CPU kernels, the header every part includes: the instruction set this build targets
// (SL_ISA), the standard and intrinsic includes, and scalar helpers (bf16 <-> float32,
// horizontal sums).
//
// The kernels are one shared library per instruction set, compiled by sloserve/kernels/build.py
// from kernels.cpp, the library's only translation unit, which includes every part once (see
// its header). SL_ISA says which vector bodies the parts compile:
//   2  AVX-512 (F/BW/VL/DQ, VNNI, FMA, F16C): 16-lane float vectors
//   1  AVX2 + FMA + F16C: 8-lane float vectors
//   0  generic: plain C++ (the compiler's own vectorization)
// The AMX and AVX512-BF16 code (amx_gemm.h, prefill_attn.h) is compiled into the AVX-512 library
// only, with those instructions enabled for its own functions alone (SL_AMX); the library asks
// the CPU at run time whether it may use them.
//
// Per-ISA code: where a family has a body per instruction set, the bodies sit in sections of
// their own (SL_ISA == 2, then 1, then the generic build), each defining the same function
// (Group, quantize_row, x16_tile / x16_tile8, dot / axpy); a few functions pick their body with
// one #if inside (tile_i8, the decode kernel's head_dim-64 path, SiLU-and-mul rows), or vectorize
// a loop and share its scalar tail (load_row).
// Everything but the C API (kernels.cpp) is in the anonymous namespace: the library exports the
// sl_* functions only.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <cpuid.h>
#include <immintrin.h>
#define SL_ISA 2
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SL_ISA 1
#else
#define SL_ISA 0
#endif

namespace {

// ------------------------------------------------------------------------------------ helpers
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

#if SL_ISA == 2
inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }
#endif
#if SL_ISA >= 1
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
#endif

}  // namespace
