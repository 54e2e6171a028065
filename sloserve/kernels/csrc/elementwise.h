// sloserve CPU kernels: the elementwise ops: RMSNorm (sl_rms_norm), the residual add with
// RMSNorm (sl_add_rms_norm), SiLU-and-mul (sl_silu_mul) and RoPE (sl_rope), and the row helpers
// the fused layer (x16_layer.h) shares with them.
//
// Inputs and outputs float32, or bfloat16 where the flags say so (a 16-bit dense step feeds its
// GEMMs bf16 and gets bf16 back, with no conversion by torch in between); arithmetic float32,
// bf16 rounded to nearest even. Rows split over the threads (static) above a size threshold.
// SiLU-and-mul has an AVX-512 row body; the rest is plain C++ under `omp simd`.
#pragma once

#include "parallel.h"
#include "vec_math.h"

namespace {

#if SL_ISA == 2
inline __m512 load16(const char* p, int64_t i, __mmask16 m, int bf16) {
  if (!bf16) return _mm512_maskz_loadu_ps(m, reinterpret_cast<const float*>(p) + i);
  const __m256i b = _mm256_maskz_loadu_epi16(m, reinterpret_cast<const uint16_t*>(p) + i);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// f2bf for 16 floats: round to nearest even, NaN kept NaN.
inline void store16(char* p, int64_t i, __mmask16 m, __m512 v, int bf16) {
  if (!bf16) return _mm512_mask_storeu_ps(reinterpret_cast<float*>(p) + i, m, v);
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                 lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(p) + i, m, _mm512_cvtepi32_epi16(r));
}

// One row of sl_silu_mul: gate [F] then up [F] at gu, float32 or bf16; out [F] likewise.
// Rounds as the scalar path's silu(g) * u up to the exp polynomial's evaluation order.
inline void silu_mul_row16(const char* gu, int64_t F, char* out, int bf16) {
  const char* up = gu + F * (bf16 ? 2 : 4);
  for (int64_t i = 0; i < F; i += 16) {
    const __mmask16 m = F - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (F - i)) - 1);
    store16(out, i, m, silu_mul16(load16(gu, i, m, bf16), load16(up, i, m, bf16)), bf16);
  }
}
#endif

// out[at + i] = x[i] * r * w[i] for i < D, out float32 or (out_bf16) bfloat16: a norm's last step.
inline void store_scaled(const float* x, float r, const float* w, int64_t D, void* out,
                         int64_t at, int out_bf16) {
  if (out_bf16) {
    uint16_t* o = static_cast<uint16_t*>(out) + at;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) o[i] = f2bf(x[i] * r * w[i]);
  } else {
    float* o = static_cast<float*>(out) + at;
    for (int64_t i = 0; i < D; ++i) o[i] = x[i] * r * w[i];
  }
}

// out = rmsnorm(x) * w; see sl_rms_norm.
void rms_norm(const float* x, const float* w, int64_t T, int64_t D, float eps, void* out,
              int out_bf16) {
#ifdef SL_USE_OMP
#pragma omp parallel for schedule(static) if (T * D >= 32768)
#endif
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * D;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < D; ++i) ss += xr[i] * xr[i];
    store_scaled(xr, 1.f / std::sqrt(ss / float(D) + eps), w, D, out, t * D, out_bf16);
  }
}

// hr += dr (float32, D values); returns the sum of squares of the new hr.
inline float add_sumsq(float* hr, const float* dr, int64_t D) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < D; ++i) {
    hr[i] += dr[i];
    ss += hr[i] * hr[i];
  }
  return ss;
}

// h += delta, then out = rmsnorm(h) * w; see sl_add_rms_norm.
void add_rms_norm(float* h, const void* delta, const float* w, int64_t T, int64_t D,
                  float eps, void* out, int delta_bf16, int out_bf16) {
#ifdef SL_USE_OMP
#pragma omp parallel for schedule(static) if (T * D >= 32768)
#endif
  for (int64_t t = 0; t < T; ++t) {
    float* hr = h + t * D;
    float ss = 0.f;
    if (delta_bf16) {
      const uint16_t* dr = static_cast<const uint16_t*>(delta) + t * D;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < D; ++i) {
        hr[i] += bf2f(dr[i]);
        ss += hr[i] * hr[i];
      }
    } else {
      ss = add_sumsq(hr, static_cast<const float*>(delta) + t * D, D);
    }
    store_scaled(hr, 1.f / std::sqrt(ss / float(D) + eps), w, D, out, t * D, out_bf16);
  }
}

// out [T, F] = silu(gate) * up; see sl_silu_mul.
void silu_mul(const void* gu, int64_t T, int64_t F, void* out, int bf16) {
#ifdef SL_USE_OMP
#pragma omp parallel for schedule(static) if (T * F * 4 >= 32768)
#endif
  for (int64_t t = 0; t < T; ++t) {
#if SL_ISA == 2
    silu_mul_row16(static_cast<const char*>(gu) + t * 2 * F * (bf16 ? 2 : 4), F,
                   static_cast<char*>(out) + t * F * (bf16 ? 2 : 4), bf16);
#else
    if (bf16) {
      const uint16_t* g = static_cast<const uint16_t*>(gu) + t * 2 * F;
      const uint16_t* u = g + F;
      uint16_t* o = static_cast<uint16_t*>(out) + t * F;
#pragma omp simd
      for (int64_t i = 0; i < F; ++i) o[i] = f2bf(silu(bf2f(g[i])) * bf2f(u[i]));
    } else {
      const float* g = static_cast<const float*>(gu) + t * 2 * F;
      const float* u = g + F;
      float* o = static_cast<float*>(out) + t * F;
#pragma omp simd
      for (int64_t i = 0; i < F; ++i) o[i] = silu(g[i]) * u[i];
    }
#endif
  }
}

// RoPE of one token's Hq query heads q and Hk key heads k (D values each, in place).
inline void rope_row(float* q, float* k, const float* c, const float* s, int64_t Hq, int64_t Hk,
                     int64_t D) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < Hq + Hk; ++h) {
    float* v = h < Hq ? q + h * D : k + (h - Hq) * D;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x0 = v[i], x1 = v[i + half];
      v[i] = x0 * c[i] - x1 * s[i];
      v[i + half] = x1 * c[i] + x0 * s[i];
    }
  }
}

// RoPE in place; see sl_rope.
void rope(float* q, int64_t q_stride, float* k, int64_t k_stride, const float* cos_t,
          const float* sin_t, int64_t T, int64_t Hq, int64_t Hk, int64_t D) {
  const int64_t half = D / 2;
#ifdef SL_USE_OMP
#pragma omp parallel for schedule(static) if (T * (Hq + Hk) * D * 4 >= 32768)
#endif
  for (int64_t t = 0; t < T; ++t)
    rope_row(q + t * q_stride, k + t * k_stride, cos_t + t * half, sin_t + t * half, Hq, Hk, D);
}

}  // namespace
