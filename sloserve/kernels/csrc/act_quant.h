// sloserve CPU kernels: activations quantized to int8 per group of 32, the input of the products
// with integer dot products (qlinear_rows.h's int8 path, qlinear_x16.h).
//
// Per row of x and group g of 32 inputs: d = max |x| / 127, q = round(x / d) (nearest even), and
// the exact float32 sum of the group (for weights with offsets). AVX-512 body, then the portable
// one (which the AVX2 and generic builds compile).
#pragma once

#include "parallel.h"

namespace {

// ------------------------------------------------------ int8 activations (the fast decode path)
// x is quantized per group of 32 to int8 (d_x = max |x| / 127, q_x = round(x / d_x)); the
// product of a group is then an integer dot product (AVX-512 VNNI vpdpbusd, or AVX2's
// pmaddubsw + pmaddwd) scaled once by d_w * d_x; the offsets use the exact float sums of x.
// 4-bit codes are unsigned (0..15): dpbusd(codes, q_x). int8 codes are signed: the sign trick
// dpbusd(|q_x|, sign(w, q_x)) = sum q_x * w.

struct ActQ {
  const int8_t* q;   // [M, K]
  const float* d;    // [M, G]
  const float* s;    // [M, G] exact float sums of x per group
};

// The group scale from the group's largest |x|: amax / 127, and 1 / that to multiply by. Two edge
// cases get all-zero codes (the caller writes them) so that every build gives the same numbers:
// a group too small for 1 / scale to be finite (|x| < 1e-30: its products are below float32's
// resolution of any other term) gets scale 0; a group holding inf or NaN gets scale NaN, so the
// products it enters are NaN. Returns false for those.
inline bool group_scale(float amax, float& dx, float& inv) {
  if (amax >= 1e-30f && amax <= 3.4e38f) {
    dx = amax / 127.f;
    inv = 1.f / dx;
    return true;
  }
  dx = amax < 1e-30f ? 0.f : NAN;
  inv = 0.f;
  return false;
}

// One row x [G * 32] -> its codes qr, scales d [G] and sums s [G].
#if SL_ISA == 2
inline void quantize_row(const float* xr, int64_t G, int8_t* qr, float* d, float* s) {
  for (int64_t g = 0; g < G; ++g, xr += 32, qr += 32) {
    float dx, inv;
    const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    s[g] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
    const bool ok = group_scale(std::isnan(s[g]) ? NAN : amax, dx, inv);  // max drops NaNs
    d[g] = dx;
    if (!ok) {
      std::memset(qr, 0, 32);
      continue;
    }
    const __m512 vi = _mm512_set1_ps(inv);
    // cvtps rounds to nearest even (the default MXCSR mode), as std::nearbyint does
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qr),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x0, vi))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + 16),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x1, vi))));
  }
}
#else
inline void quantize_row(const float* xr, int64_t G, int8_t* qr, float* d, float* s) {
  for (int64_t g = 0; g < G; ++g, xr += 32, qr += 32) {
    float dx, inv;
    float amax = 0.f, sum = 0.f;
    for (int j = 0; j < 32; ++j) {
      amax = std::max(amax, std::fabs(xr[j]));
      sum += xr[j];
    }
    s[g] = sum;
    const bool ok = group_scale(std::isnan(sum) ? NAN : amax, dx, inv);
    d[g] = dx;
    for (int j = 0; j < 32; ++j) qr[j] = ok ? static_cast<int8_t>(std::nearbyint(xr[j] * inv)) : 0;
  }
}
#endif

// x [M, K] -> int8 codes q [M, K], scales d [M, K / 32] (the group's largest |x| / 127) and the
// exact float sums s [M, K / 32] of each group (for the weights' offsets); rows split over the
// threads when there are many.
inline void quantize_act(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
  const int64_t G = K / 32;
  if (M * K < 65536 && !in_region()) {
    for (int64_t m = 0; m < M; ++m) quantize_row(x + m * K, G, q + m * K, d + m * G, s + m * G);
    return;
  }
  const int64_t rows = M * K < 65536 ? 4 : 16, items = (M + rows - 1) / rows;
  auto body = [&](int64_t i) {
    for (int64_t m = i * rows; m < std::min(M, (i + 1) * rows); ++m)
      quantize_row(x + m * K, G, q + m * K, d + m * G, s + m * G);
  };
  parallel_for(items, body);
}

}  // namespace
