// sloserve CPU kernels: math shared by several parts: bf16 <-> float32 of one value (bf16 rounded
// to nearest even), exp for the softmax (fast_exp; exp16 for 16 lanes on AVX-512, the same
// polynomial), SiLU and, on AVX-512, SiLU-and-mul of 16 lanes (a reciprocal estimate and one
// Newton step, ~1 ulp), and dot / axpy (a body per instruction set).
#pragma once

#include "common.h"

namespace {

inline float bf2f(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f2bf(float f) {  // round to nearest even, as torch's .to(torch.bfloat16)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// exp for the softmax, vectorizable: exp(x) = 2^k * P(r), |r| <= ln2/2, P a degree-6
// polynomial (relative error ~2e-7 on the range used, x <= 0); x below -87 gives 0.
inline float fast_exp(float x) {
  if (x < -87.f) return 0.f;
  x = std::min(x, 88.f);
  const float k = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t e = (static_cast<int32_t>(k) + 127) << 23;
  float two_k;
  std::memcpy(&two_k, &e, 4);
  return p * two_k;
}

inline float exp_sub_sum(float* v, int64_t n, float m) {  // v[j] = exp(v[j] - m); sum
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) {
    v[j] = fast_exp(v[j] - m);
    s += v[j];
  }
  return s;
}

inline float silu(float v) { return v / (1.f + fast_exp(std::max(-v, -87.f))); }

// dot(a, b, n) = sum a[i] b[i] and axpy: y += p * x, over n floats: vector lanes, then the
// rest one by one (the generic build: all of them).
#if SL_ISA == 2
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  s = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float p, const float* x, float* y, int64_t n) {  // y += p * x
  int64_t i = 0;
  const __m512 pv = _mm512_set1_ps(p);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(pv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += p * x[i];
}
#elif SL_ISA == 1
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float p, const float* x, float* y, int64_t n) {  // y += p * x
  int64_t i = 0;
  const __m256 pv = _mm256_set1_ps(p);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += p * x[i];
}
#else
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float p, const float* x, float* y, int64_t n) {  // y += p * x
  int64_t i = 0;
  for (; i < n; ++i) y[i] += p * x[i];
}
#endif

#if SL_ISA == 2
// exp(x) for 16 floats: Cephes' range reduction and polynomial (as fast_exp), the 2^k scaling by
// vscalefps (no exponent-field arithmetic to overflow). x is clamped to [-100, 88] first (a NaN
// becomes 88: callers that must keep NaN multiply by their input after).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-100.f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.3981999507e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, k);
}

// silu(g) * u for 16 floats: g / (1 + exp(-g)) as g * 1 / d, 1 / d by vrcp14ps and one Newton
// step (~1 ulp; vdivps cost more than the rest of the loop).
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
  __m512 y = _mm512_rcp14_ps(d);
  y = _mm512_mul_ps(y, _mm512_fnmadd_ps(d, y, _mm512_set1_ps(2.f)));
  return _mm512_mul_ps(_mm512_mul_ps(g, y), u);
}
#endif

}  // namespace
