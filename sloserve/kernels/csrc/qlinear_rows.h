// sloserve CPU kernels: products with weight-only quantized weights in GGUF's row layout
// (sl_qlinear, sl_qlinear_i8) and the quantized embedding lookup (sl_qembed).
//
// Weight format (QuantizedWeight in sloserve/model/quant.py): W[n, k] = d[n, g] * q[n, k] +
// m[n, g], g = k / gs, per group of gs consecutive inputs; scales d and offsets m (Q4_1-like;
// null without) float32 [N, K / gs]:
//   bits 4, gs 32: q in 0..15, packed 16 bytes per group, byte j = q[j] | q[j + 16] << 4
//                  (GGUF's Q4_0/Q4_1 order; Q4_K is repacked into it at load);
//   bits 8, gs 32 or 16: q int8, one byte each.
// Two products, y [M, N] = x [M, K] @ W^T, float32 out:
//   qlinear_t     float32 activations, float32 accumulation (the weights' exact dequantized
//                 values; the activations are not requantized). Bodies: Group<BITS, GS> per ISA.
//   qlinear_i8_t  activations quantized to int8 (act_quant.h) and integer dot products: AVX-512
//                 VNNI vpdpbusd, AVX2 pmaddubsw + pmaddwd, or scalar (tile_i8's bodies);
//                 4-bit or int8 weights in groups of 32.
// Threads: chunks of 8-64 weight rows, claimed one at a time (parallel_for).
#pragma once

#include "act_quant.h"

namespace {

// ------------------------------------------------------------------ one weight group
// Group<BITS, GS>::load(w) unpacks one group of GS codes to float vectors; dot(wv, x) is the
// vector of partial products with GS activations (summed later). Acc is the float vector.

template <int BITS, int GS>
struct Group;

#if SL_ISA == 2
using Acc = __m512;
inline Acc acc_zero() { return _mm512_setzero_ps(); }
inline Acc fmad(Acc t, float d, Acc acc) { return _mm512_fmadd_ps(t, _mm512_set1_ps(d), acc); }
template <>
struct Group<4, 32> {
  struct W { __m512 lo, hi; };
  static inline W load(const uint8_t* w) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    return {_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))),
            _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4))};
  }
  static inline Acc dot(const W& v, const float* x) {
    return _mm512_fmadd_ps(v.hi, _mm512_loadu_ps(x + 16), _mm512_mul_ps(v.lo, _mm512_loadu_ps(x)));
  }
};
template <>
struct Group<8, 32> {
  struct W { __m512 a, b; };
  static inline W load(const uint8_t* w) {
    const __m128i* p = reinterpret_cast<const __m128i*>(w);
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)))};
  }
  static inline Acc dot(const W& v, const float* x) {
    return _mm512_fmadd_ps(v.b, _mm512_loadu_ps(x + 16), _mm512_mul_ps(v.a, _mm512_loadu_ps(x)));
  }
};
template <>
struct Group<8, 16> {
  struct W { __m512 a; };
  static inline W load(const uint8_t* w) {
    return {_mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))))};
  }
  static inline Acc dot(const W& v, const float* x) { return _mm512_mul_ps(v.a, _mm512_loadu_ps(x)); }
};
#elif SL_ISA == 1
using Acc = __m256;
inline Acc acc_zero() { return _mm256_setzero_ps(); }
inline Acc fmad(Acc t, float d, Acc acc) { return _mm256_fmadd_ps(t, _mm256_set1_ps(d), acc); }
inline __m256i u8x8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
template <>
struct Group<4, 32> {
  struct W { __m256 lo0, lo1, hi0, hi1; };  // weights 0..7, 8..15, 16..23, 24..31
  static inline W load(const uint8_t* w) {
    const __m256i mask = _mm256_set1_epi32(15);
    __m256i b0 = u8x8(w), b1 = u8x8(w + 8);
    return {_mm256_cvtepi32_ps(_mm256_and_si256(b0, mask)),
            _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask)),
            _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)),
            _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4))};
  }
  static inline Acc dot(const W& v, const float* x) {
    __m256 t = _mm256_mul_ps(v.lo0, _mm256_loadu_ps(x));
    t = _mm256_fmadd_ps(v.lo1, _mm256_loadu_ps(x + 8), t);
    t = _mm256_fmadd_ps(v.hi0, _mm256_loadu_ps(x + 16), t);
    return _mm256_fmadd_ps(v.hi1, _mm256_loadu_ps(x + 24), t);
  }
};
template <>
struct Group<8, 32> {
  struct W { __m256 a, b, c, d; };
  static inline W load(const uint8_t* w) { return {i8x8(w), i8x8(w + 8), i8x8(w + 16), i8x8(w + 24)}; }
  static inline Acc dot(const W& v, const float* x) {
    __m256 t = _mm256_mul_ps(v.a, _mm256_loadu_ps(x));
    t = _mm256_fmadd_ps(v.b, _mm256_loadu_ps(x + 8), t);
    t = _mm256_fmadd_ps(v.c, _mm256_loadu_ps(x + 16), t);
    return _mm256_fmadd_ps(v.d, _mm256_loadu_ps(x + 24), t);
  }
};
template <>
struct Group<8, 16> {
  struct W { __m256 a, b; };
  static inline W load(const uint8_t* w) { return {i8x8(w), i8x8(w + 8)}; }
  static inline Acc dot(const W& v, const float* x) {
    return _mm256_fmadd_ps(v.b, _mm256_loadu_ps(x + 8), _mm256_mul_ps(v.a, _mm256_loadu_ps(x)));
  }
};
#else
struct Acc { float v; };
inline Acc acc_zero() { return Acc{0.f}; }
inline Acc fmad(Acc t, float d, Acc acc) { return Acc{acc.v + d * t.v}; }
inline float hsum(Acc a) { return a.v; }
template <>
struct Group<4, 32> {
  struct W { float q[32]; };
  static inline W load(const uint8_t* w) {
    W v;
    for (int j = 0; j < 16; ++j) { v.q[j] = float(w[j] & 15); v.q[j + 16] = float(w[j] >> 4); }
    return v;
  }
  static inline Acc dot(const W& v, const float* x) {
    float t = 0.f;
    for (int j = 0; j < 32; ++j) t += v.q[j] * x[j];
    return Acc{t};
  }
};
template <int GS>
struct Group8 {
  struct W { float q[GS]; };
  static inline W load(const uint8_t* w) {
    W v;
    for (int j = 0; j < GS; ++j) v.q[j] = float(static_cast<int8_t>(w[j]));
    return v;
  }
  static inline Acc dot(const W& v, const float* x) {
    float t = 0.f;
    for (int j = 0; j < GS; ++j) t += v.q[j] * x[j];
    return Acc{t};
  }
};
template <>
struct Group<8, 32> : Group8<32> {};
template <>
struct Group<8, 16> : Group8<16> {};
#endif

// A tile: MC activation rows x R weight rows, accumulators in registers (the bounds are
// compile-time, so the loops unroll and no accumulator round-trips through memory).
template <int BITS, int GS, int MC, int R>
inline void tile(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes,
                 const float* d, const float* mn, const float* xsum, int64_t G, float* y,
                 int64_t N) {
  constexpr int64_t gb = GS * BITS / 8;
  Acc acc[MC][R];
  for (int mi = 0; mi < MC; ++mi)
    for (int r = 0; r < R; ++r) acc[mi][r] = acc_zero();
  for (int64_t g = 0; g < G; ++g) {
    typename Group<BITS, GS>::W wv[R];
    for (int r = 0; r < R; ++r) wv[r] = Group<BITS, GS>::load(w + r * row_bytes + g * gb);
    for (int mi = 0; mi < MC; ++mi) {
      const float* xg = x + mi * K + g * GS;
      for (int r = 0; r < R; ++r)
        acc[mi][r] = fmad(Group<BITS, GS>::dot(wv[r], xg), d[r * G + g], acc[mi][r]);
    }
  }
  for (int mi = 0; mi < MC; ++mi)
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[mi][r]);
      if (mn) {  // the offsets: sum_g m[n, g] * sum_{k in g} x[m, k]
        const float* mr = mn + r * G;
        const float* xs = xsum + mi * G;
        float t = 0.f;
#pragma omp simd reduction(+ : t)
        for (int64_t g = 0; g < G; ++g) t += mr[g] * xs[g];
        s += t;
      }
      y[mi * N + r] = s;
    }
}

template <int BITS, int GS, int MC>
inline void rows_mc(const float* x, int64_t K, const uint8_t* qw, const float* d,
                    const float* mn, const float* xsum, int64_t G, int64_t N, int64_t n0,
                    int64_t n1, float* y) {
  constexpr int R = MC <= 2 ? 4 : 2;  // keep MC * R accumulators (+ the weights) in registers
  const int64_t rb = G * GS * BITS / 8;
  int64_t n = n0;
  for (; n + R <= n1; n += R)
    tile<BITS, GS, MC, R>(x, K, qw + n * rb, rb, d + n * G, mn ? mn + n * G : nullptr, xsum, G,
                          y + n, N);
  for (; n < n1; ++n)
    tile<BITS, GS, MC, 1>(x, K, qw + n * rb, rb, d + n * G, mn ? mn + n * G : nullptr, xsum, G,
                          y + n, N);
}

// y[m, n] = sum_k x[m, k] W[n, k] for rows n in [n0, n1) and all M rows of x.
template <int BITS, int GS>
void qlinear_rows(const float* x, int64_t M, int64_t K, const uint8_t* qw, const float* d,
                  const float* mn, const float* xsum, int64_t N, int64_t n0, int64_t n1,
                  float* y) {
  const int64_t G = K / GS;
  int64_t m = 0;
  for (; m + 4 <= M; m += 4)
    rows_mc<BITS, GS, 4>(x + m * K, K, qw, d, mn, mn ? xsum + m * G : nullptr, G, N, n0, n1,
                         y + m * N);
  const int64_t rest = M - m;
  const float* xr = x + m * K;
  const float* xs = mn ? xsum + m * G : nullptr;
  float* yr = y + m * N;
  if (rest == 3) rows_mc<BITS, GS, 3>(xr, K, qw, d, mn, xs, G, N, n0, n1, yr);
  else if (rest == 2) rows_mc<BITS, GS, 2>(xr, K, qw, d, mn, xs, G, N, n0, n1, yr);
  else if (rest == 1) rows_mc<BITS, GS, 1>(xr, K, qw, d, mn, xs, G, N, n0, n1, yr);
}

template <int BITS, int GS>
void qlinear_t(const float* x, int64_t M, int64_t K, const uint8_t* qw, const float* d,
               const float* mn, int64_t N, float* y, float* xsum) {
  const int64_t G = K / GS;
  if (mn) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g) {
        const float* xr = x + m * K + g * GS;
        float s = 0.f;
        for (int j = 0; j < GS; ++j) s += xr[j];
        xsum[m * G + g] = s;
      }
  }
  // chunks of rows claimed one at a time; ~8 per thread at least
  const int64_t nt = nthreads();
  const int64_t chunk = std::max<int64_t>(8, std::min<int64_t>(64, N / (8 * nt)));
  const int64_t nchunks = (N + chunk - 1) / chunk;
  auto body = [&](int64_t c) {
    const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk);
    qlinear_rows<BITS, GS>(x, M, K, qw, d, mn, xsum, N, n0, n1, y);
  };
  parallel_for(nchunks, body);
}

#if SL_ISA == 2
// the int32 dot products of one weight row's group pair with one activation row's group pair:
// lanes 0..7 group g, lanes 8..15 group g + 1
inline __m512i unpack4_pair(const uint8_t* w) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i m = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(b, m);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
  const __m512i idx = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  return _mm512_permutex2var_epi64(_mm512_castsi256_si512(lo), idx, _mm512_castsi256_si512(hi));
}
inline __m512 expand_pair(const float* p) {  // [p0 x8, p1 x8]
  const __m128 v = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)));
  const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v));
}
#endif

template <int BITS, int MC, int R>
inline void tile_i8(const ActQ& a, int64_t K, const uint8_t* w, int64_t row_bytes,
                    const float* d, const float* mn, int64_t G, float* y, int64_t N) {
  float out[MC][R];
#if SL_ISA == 2
  if constexpr (BITS == 4) {
    __m512 acc[MC][R];
    for (int mi = 0; mi < MC; ++mi)
      for (int r = 0; r < R; ++r) acc[mi][r] = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) {
      __m512i wv[R];
      __m512 dw[R];
      for (int r = 0; r < R; ++r) {
        wv[r] = unpack4_pair(w + r * row_bytes + g * 16);
        dw[r] = expand_pair(d + r * G + g);
      }
      for (int mi = 0; mi < MC; ++mi) {
        const __m512i xv = _mm512_loadu_si512(a.q + mi * K + g * 32);
        const __m512 dx = expand_pair(a.d + mi * G + g);
        for (int r = 0; r < R; ++r) {
          const __m512i dp = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[r], xv);
          acc[mi][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dp), _mm512_mul_ps(dw[r], dx),
                                       acc[mi][r]);
        }
      }
    }
    for (int mi = 0; mi < MC; ++mi)
      for (int r = 0; r < R; ++r) out[mi][r] = _mm512_reduce_add_ps(acc[mi][r]);
    for (; g < G; ++g)  // an odd last group, scalar
      for (int mi = 0; mi < MC; ++mi)
        for (int r = 0; r < R; ++r) {
          const uint8_t* wg = w + r * row_bytes + g * 16;
          const int8_t* xg = a.q + mi * K + g * 32;
          int32_t s = 0;
          for (int j = 0; j < 16; ++j) s += (wg[j] & 15) * xg[j] + (wg[j] >> 4) * xg[j + 16];
          out[mi][r] += float(s) * d[r * G + g] * a.d[mi * G + g];
        }
  } else {
    __m256 acc[MC][R];
    for (int mi = 0; mi < MC; ++mi)
      for (int r = 0; r < R; ++r) acc[mi][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m256i wv[R];
      for (int r = 0; r < R; ++r)
        wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * row_bytes + g * 32));
      for (int mi = 0; mi < MC; ++mi) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + mi * K + g * 32));
        const __m256i xa = _mm256_abs_epi8(xv);
        const float dx = a.d[mi * G + g];
        for (int r = 0; r < R; ++r) {
          const __m256i dp = _mm256_dpbusd_epi32(_mm256_setzero_si256(), xa,
                                                 _mm256_sign_epi8(wv[r], xv));
          acc[mi][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), _mm256_set1_ps(d[r * G + g] * dx),
                                       acc[mi][r]);
        }
      }
    }
    for (int mi = 0; mi < MC; ++mi)
      for (int r = 0; r < R; ++r) out[mi][r] = hsum(acc[mi][r]);
  }
#elif SL_ISA == 1
  __m256 acc[MC][R];
  for (int mi = 0; mi < MC; ++mi)
    for (int r = 0; r < R; ++r) acc[mi][r] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < G; ++g) {
    __m256i wv[R];
    for (int r = 0; r < R; ++r) {
      if constexpr (BITS == 4) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * row_bytes + g * 16));
        const __m128i m = _mm_set1_epi8(0x0F);
        wv[r] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
      } else {
        wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * row_bytes + g * 32));
      }
    }
    for (int mi = 0; mi < MC; ++mi) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + mi * K + g * 32));
      const float dx = a.d[mi * G + g];
      const __m256i xa = _mm256_abs_epi8(xv);
      for (int r = 0; r < R; ++r) {
        __m256i p16;
        if constexpr (BITS == 4) p16 = _mm256_maddubs_epi16(wv[r], xv);            // <= 3810
        else p16 = _mm256_maddubs_epi16(xa, _mm256_sign_epi8(wv[r], xv));          // <= 32258
        const __m256i dp = _mm256_madd_epi16(p16, ones);
        acc[mi][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), _mm256_set1_ps(d[r * G + g] * dx),
                                     acc[mi][r]);
      }
    }
  }
  for (int mi = 0; mi < MC; ++mi)
    for (int r = 0; r < R; ++r) out[mi][r] = hsum(acc[mi][r]);
#else
  for (int mi = 0; mi < MC; ++mi)
    for (int r = 0; r < R; ++r) {
      float t = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const int8_t* xg = a.q + mi * K + g * 32;
        int32_t s = 0;
        if (BITS == 4) {
          const uint8_t* wg = w + r * row_bytes + g * 16;
          for (int j = 0; j < 16; ++j) s += (wg[j] & 15) * xg[j] + (wg[j] >> 4) * xg[j + 16];
        } else {
          const int8_t* wg = reinterpret_cast<const int8_t*>(w + r * row_bytes + g * 32);
          for (int j = 0; j < 32; ++j) s += wg[j] * xg[j];
        }
        t += float(s) * d[r * G + g] * a.d[mi * G + g];
      }
      out[mi][r] = t;
    }
#endif
  for (int mi = 0; mi < MC; ++mi)
    for (int r = 0; r < R; ++r) {
      float s = out[mi][r];
      if (mn) {
        const float* mr = mn + r * G;
        const float* xs = a.s + mi * G;
        float t = 0.f;
#pragma omp simd reduction(+ : t)
        for (int64_t g = 0; g < G; ++g) t += mr[g] * xs[g];
        s += t;
      }
      y[mi * N + r] = s;
    }
}

template <int BITS, int MC>
inline void rows_i8(const ActQ& a, int64_t K, const uint8_t* qw, const float* d, const float* mn,
                    int64_t G, int64_t N, int64_t n0, int64_t n1, float* y) {
  constexpr int R = MC <= 2 ? 4 : 2;
  const int64_t rb = K * BITS / 8;
  int64_t n = n0;
  for (; n + R <= n1; n += R)
    tile_i8<BITS, MC, R>(a, K, qw + n * rb, rb, d + n * G, mn ? mn + n * G : nullptr, G, y + n, N);
  for (; n < n1; ++n)
    tile_i8<BITS, MC, 1>(a, K, qw + n * rb, rb, d + n * G, mn ? mn + n * G : nullptr, G, y + n, N);
}

template <int BITS>
void qlinear_i8_t(const float* x, int64_t M, int64_t K, const uint8_t* qw, const float* d,
                  const float* mn, int64_t N, float* y, void* scratch) {
  const int64_t G = K / 32;
  int8_t* xq = static_cast<int8_t*>(scratch);
  float* xd = reinterpret_cast<float*>(xq + ((M * K + 63) / 64) * 64);
  float* xs = xd + M * G;
  quantize_act(x, M, K, xq, xd, xs);
  const int64_t nt = nthreads();
  const int64_t chunk = std::max<int64_t>(8, std::min<int64_t>(64, N / (8 * nt)));
  const int64_t nchunks = (N + chunk - 1) / chunk;
  auto body = [&](int64_t c) {
    const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      ActQ a{xq + m * K, xd + m * G, xs + m * G};
      rows_i8<BITS, 4>(a, K, qw, d, mn, G, N, n0, n1, y + m * N);
    }
    ActQ a{xq + m * K, xd + m * G, xs + m * G};
    const int64_t rest = M - m;
    if (rest == 3) rows_i8<BITS, 3>(a, K, qw, d, mn, G, N, n0, n1, y + m * N);
    else if (rest == 2) rows_i8<BITS, 2>(a, K, qw, d, mn, G, N, n0, n1, y + m * N);
    else if (rest == 1) rows_i8<BITS, 1>(a, K, qw, d, mn, G, N, n0, n1, y + m * N);
  };
  parallel_for(nchunks, body);
}

// out [T, K] = rows ids[0..T) of the quantized matrix, dequantized (an embedding lookup);
// (bits, gs) one of the formats above.
void qembed(const int64_t* ids, int64_t T, const uint8_t* qw, const float* d, const float* mn,
            int bits, int gs, int64_t K, float* out) {
  const int64_t G = K / gs, row_bytes = K * bits / 8;
#ifdef SL_USE_OMP
#pragma omp parallel for schedule(static) if (T * K >= 32768)
#endif
  for (int64_t t = 0; t < T; ++t) {
    const uint8_t* wr = qw + ids[t] * row_bytes;
    const float* dr = d + ids[t] * G;
    const float* mr = mn ? mn + ids[t] * G : nullptr;
    float* o = out + t * K;
    for (int64_t g = 0; g < G; ++g) {
      const float dg = dr[g], mg = mr ? mr[g] : 0.f;
      if (bits == 4) {
        const uint8_t* w = wr + g * 16;
        for (int j = 0; j < 16; ++j) {
          o[g * 32 + j] = dg * float(w[j] & 15) + mg;
          o[g * 32 + j + 16] = dg * float(w[j] >> 4) + mg;
        }
      } else {
        const int8_t* w = reinterpret_cast<const int8_t*>(wr + g * gs);
        for (int j = 0; j < gs; ++j) o[g * gs + j] = dg * float(w[j]) + mg;
      }
    }
  }
}

}  // namespace
