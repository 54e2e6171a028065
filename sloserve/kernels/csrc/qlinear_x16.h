// sloserve CPU kernels: products with 4- or 8-bit group-32 weights in the x16 layout (16 rows
// interleaved so that one integer dot-product instruction covers 16 rows), activations
// quantized to int8 (act_quant.h): the decode path's products (sl_qlinear_x16), the gate/up
// product with SwiGLU in its epilogue (sl_qlinear_x16_swiglu), and the repacking from the row
// layout (sl_repack_x16). Python: X16Weight, Kernels.pack_x16 / pack_x16_swiglu.
//
// Tile bodies per ISA: AVX-512 VNNI vpdpbusd with an embedded broadcast (16 activation rows per
// pass over a weight block), AVX2 pmaddubsw + pmaddwd in two 8-lane halves (8 rows per pass),
// and a scalar one (generic). Threads: x16_split's items of weight blocks x activation rows.
#pragma once

#include "act_quant.h"
#include "vec_math.h"

namespace {

// ------------------------------------------------------------------ the x16 layout
// Rows in blocks of 16 (N % 16 == 0). Block b, group g: 4 chunks of 64 bytes; 32-bit lane r of
// chunk c holds bytes 4c..4c+3 of row 16b + r's group g in the nibble layout (low nibbles: codes
// 4c..4c+3, high nibbles: codes 16+4c..16+4c+3). Scales and offsets: [N / 16, G, 16] float32.
// One dpbusd then multiplies 4 codes of 16 rows with 4 broadcast activations, so the 16 rows'
// group sums land in the 16 lanes (no horizontal sums, one scale multiply per group and block).

constexpr int kX16 = 16;

// x16_tile<MC, BR>: MC activation rows (ActQ) times BR 16-row blocks of a 4-bit weight, G
// groups -> y [MC, 16 BR] (row stride N). x16_tile8: the same for 8-bit codes (signed; 8
// chunks of 64 bytes per block and group), isum holding -128 times each group's integer
// activation sum (see its AVX-512 body). One definition of each per instruction set below.

constexpr int64_t kX16Prefetch = 2048;  // bytes ahead in a 4-bit weight stream (see x16_tile)

// ------------------------------------------------------------------ AVX-512 (VNNI)
#if SL_ISA == 2
// acc += dpbusd(w, x[0] broadcast to 16 lanes): the activations' 4 codes come from memory as an
// embedded broadcast ({1to16}), not a separate vpbroadcastd (which g++ does not fold into
// vpdpbusd from the intrinsic): one vector op per 64 multiply-adds instead of two.
inline __m512i dpbusd_b(__m512i acc, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}

// x16_tile's AVX-512 body; HAS_MN: the weights have per-group offsets (Q4_1). Every loop is
// unrolled so that the MC x BR accumulators stay in registers (g++ left the MC = 16 loop rolled,
// its accumulators on the stack, a load and a store per 8 dpbusd, and tested `mn` in it)
template <int MC, int BR, bool HAS_MN>
inline void x16_tile_avx512(const ActQ& a, int64_t K, const uint8_t* w, const float* d,
                            const float* mn, int64_t G, float* y, int64_t N) {
  __m512 acc[MC][BR];
#pragma GCC unroll 16
  for (int mi = 0; mi < MC; ++mi)
#pragma GCC unroll 2
    for (int br = 0; br < BR; ++br) acc[mi][br] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0F), m4h = _mm512_set1_epi8(static_cast<char>(0xF0));
  for (int64_t g = 0; g < G; ++g) {
    __m512i lo[BR][4], hi[BR][4];  // hi: 16 x the high nibbles' codes (no shift per chunk)
    __m512 dv[BR], mv[BR];
#pragma GCC unroll 2
    for (int br = 0; br < BR; ++br) {
      const uint8_t* wb = w + (br * G + g) * 256;
      // the weights stream from memory once per step: fetch a few groups ahead (the vector
      // work of a group's 16 rows fills the out-of-order window, which then holds too few
      // loads to keep the memory busy: 12 GB/s without this at 16 rows, 38 at 1)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(wb + kX16Prefetch + 64 * c), _MM_HINT_T0);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(wb + 64 * c);
        lo[br][c] = _mm512_and_si512(v, m4);
        hi[br][c] = _mm512_and_si512(v, m4h);
      }
      dv[br] = _mm512_loadu_ps(d + (br * G + g) * kX16);
      if constexpr (HAS_MN) mv[br] = _mm512_loadu_ps(mn + (br * G + g) * kX16);
    }
    const int8_t* xg = a.q + g * 32;
#pragma GCC unroll 16
    for (int mi = 0; mi < MC; ++mi) {
      const int32_t* xq = reinterpret_cast<const int32_t*>(xg + mi * K);
      // the integer sum below is 16 x the dot product: the scale takes the 1/16 (exact: a
      // power of two), so the result is the same float as scaling the plain sum
      const __m512 dx = _mm512_set1_ps(a.d[mi * G + g] * 0.0625f);
#pragma GCC unroll 2
      for (int br = 0; br < BR; ++br) {
        // two chains of 4 dpbusd (half the latency of one of 8), added
        __m512i i = _mm512_setzero_si512(), i2 = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) i = dpbusd_b(i, lo[br][c], xq + c);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) i2 = dpbusd_b(i2, hi[br][c], xq + 4 + c);
        i = _mm512_add_epi32(_mm512_slli_epi32(i, 4), i2);  // 16 x (low + high): |.| < 2^20
        acc[mi][br] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(dv[br], dx),
                                      acc[mi][br]);
        if constexpr (HAS_MN)
          acc[mi][br] = _mm512_fmadd_ps(mv[br], _mm512_set1_ps(a.s[mi * G + g]), acc[mi][br]);
      }
    }
  }
#pragma GCC unroll 16
  for (int mi = 0; mi < MC; ++mi)
#pragma GCC unroll 2
    for (int br = 0; br < BR; ++br) _mm512_storeu_ps(y + mi * N + br * kX16, acc[mi][br]);
}

template <int MC, int BR>
inline void x16_tile(const ActQ& a, int64_t K, const uint8_t* w, const float* d, const float* mn,
                     int64_t G, float* y, int64_t N) {
  // per group: the BR blocks' codes unpacked once (8 registers each), then for each of the MC
  // activation rows 8 dpbusd (two chains of 4), their int32 sums scaled into the float
  // accumulator
  if (mn) x16_tile_avx512<MC, BR, true>(a, K, w, d, mn, G, y, N);
  else x16_tile_avx512<MC, BR, false>(a, K, w, d, mn, G, y, N);
}

// x16_tile8's AVX-512 body, unrolled as x16_tile_avx512 is (and for the same reason)
template <int MC, int BR, bool HAS_MN>
inline void x16_tile8_avx512(const ActQ& a, const int32_t* isum, int64_t K, const uint8_t* w,
                             const float* d, const float* mn, int64_t G, float* y, int64_t N) {
  __m512 acc[MC][BR];
#pragma GCC unroll 16
  for (int mi = 0; mi < MC; ++mi)
#pragma GCC unroll 2
    for (int br = 0; br < BR; ++br) acc[mi][br] = _mm512_setzero_ps();
  const __m512i off = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = 0; g < G; ++g) {
    __m512i wv[BR][8];
    __m512 dv[BR], mv[BR];
#pragma GCC unroll 2
    for (int br = 0; br < BR; ++br) {
      const uint8_t* wb = w + (br * G + g) * 512;
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) _mm_prefetch(reinterpret_cast<const char*>(wb + 2 * kX16Prefetch + 64 * c), _MM_HINT_T0);
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) wv[br][c] = _mm512_xor_si512(_mm512_loadu_si512(wb + 64 * c), off);
      dv[br] = _mm512_loadu_ps(d + (br * G + g) * kX16);
      if constexpr (HAS_MN) mv[br] = _mm512_loadu_ps(mn + (br * G + g) * kX16);
    }
#pragma GCC unroll 16
    for (int mi = 0; mi < MC; ++mi) {
      const int32_t* xq = reinterpret_cast<const int32_t*>(a.q + mi * K + g * 32);
      const __m512 dx = _mm512_set1_ps(a.d[mi * G + g]);
      const __m512i corr = _mm512_set1_epi32(isum[mi * G + g]);  // a broadcast load
#pragma GCC unroll 2
      for (int br = 0; br < BR; ++br) {
        __m512i i = corr, i2 = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) i = dpbusd_b(i, wv[br][c], xq + c);
#pragma GCC unroll 4
        for (int c = 4; c < 8; ++c) i2 = dpbusd_b(i2, wv[br][c], xq + c);
        i = _mm512_add_epi32(i, i2);
        acc[mi][br] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i),
                                      _mm512_mul_ps(dv[br], dx), acc[mi][br]);
        if constexpr (HAS_MN)
          acc[mi][br] = _mm512_fmadd_ps(mv[br], _mm512_set1_ps(a.s[mi * G + g]), acc[mi][br]);
      }
    }
  }
#pragma GCC unroll 16
  for (int mi = 0; mi < MC; ++mi)
#pragma GCC unroll 2
    for (int br = 0; br < BR; ++br) _mm512_storeu_ps(y + mi * N + br * kX16, acc[mi][br]);
}

// 8-bit codes: AVX-512 dpbusd wants unsigned x signed: the codes are offset by 128 at load
// (xor 0x80) and 128 times the group's integer activation sum (isum holds -128 times it) is
// taken off again, so the dot product stays exact.
template <int MC, int BR>
inline void x16_tile8(const ActQ& a, const int32_t* isum, int64_t K, const uint8_t* w,
                      const float* d, const float* mn, int64_t G, float* y, int64_t N) {
  if (mn) x16_tile8_avx512<MC, BR, true>(a, isum, K, w, d, mn, G, y, N);
  else x16_tile8_avx512<MC, BR, false>(a, isum, K, w, d, mn, G, y, N);
}
#endif  // SL_ISA == 2

// ------------------------------------------------------------------ AVX2
#if SL_ISA == 1
template <int MC, int BR>
inline void x16_tile(const ActQ& a, int64_t K, const uint8_t* w, const float* d, const float* mn,
                     int64_t G, float* y, int64_t N) {
  // two 8-lane halves per block; pmaddubsw (u8 codes x s8 activations, |sum of 2| <= 3810)
  __m256 acc[MC][BR][2];
  for (int mi = 0; mi < MC; ++mi)
    for (int br = 0; br < BR; ++br) acc[mi][br][0] = acc[mi][br][1] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < G; ++g)
    for (int br = 0; br < BR; ++br)
      for (int h = 0; h < 2; ++h) {
        __m256i lo[4], hi[4];
        const uint8_t* wb = w + (br * G + g) * 256 + 32 * h;
        for (int c = 0; c < 4; ++c) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * c));
          lo[c] = _mm256_and_si256(v, m4);
          hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        }
        const __m256 dv = _mm256_loadu_ps(d + (br * G + g) * kX16 + 8 * h);
        const __m256 mv = mn ? _mm256_loadu_ps(mn + (br * G + g) * kX16 + 8 * h) : dv;
        for (int mi = 0; mi < MC; ++mi) {
          const int32_t* xq = reinterpret_cast<const int32_t*>(a.q + mi * K + g * 32);
          __m256i p = _mm256_setzero_si256();
          for (int c = 0; c < 4; ++c) {
            p = _mm256_add_epi16(p, _mm256_maddubs_epi16(lo[c], _mm256_set1_epi32(xq[c])));
            p = _mm256_add_epi16(p, _mm256_maddubs_epi16(hi[c], _mm256_set1_epi32(xq[4 + c])));
          }  // 8 pair sums of |.| <= 3810: |p| <= 30480 fits int16
          const __m256i dp = _mm256_madd_epi16(p, ones);
          acc[mi][br][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp),
                                           _mm256_mul_ps(dv, _mm256_set1_ps(a.d[mi * G + g])),
                                           acc[mi][br][h]);
          if (mn) acc[mi][br][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a.s[mi * G + g]), acc[mi][br][h]);
        }
      }
  for (int mi = 0; mi < MC; ++mi)
    for (int br = 0; br < BR; ++br)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + mi * N + br * kX16 + 8 * h, acc[mi][br][h]);
}

template <int MC, int BR>
inline void x16_tile8(const ActQ& a, const int32_t* isum, int64_t K, const uint8_t* w,
                      const float* d, const float* mn, int64_t G, float* y, int64_t N) {
  // |x| * sign(w, x) keeps pmaddubsw's pair sums <= 2 * 127 * 127 (no int16 saturation)
  __m256 acc[MC][BR][2];
  for (int mi = 0; mi < MC; ++mi)
    for (int br = 0; br < BR; ++br) acc[mi][br][0] = acc[mi][br][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < G; ++g)
    for (int br = 0; br < BR; ++br)
      for (int h = 0; h < 2; ++h) {
        __m256i wv[8];
        const uint8_t* wb = w + (br * G + g) * 512 + 32 * h;
        for (int c = 0; c < 8; ++c) wv[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * c));
        const __m256 dv = _mm256_loadu_ps(d + (br * G + g) * kX16 + 8 * h);
        const __m256 mv = mn ? _mm256_loadu_ps(mn + (br * G + g) * kX16 + 8 * h) : dv;
        for (int mi = 0; mi < MC; ++mi) {
          const int32_t* xq = reinterpret_cast<const int32_t*>(a.q + mi * K + g * 32);
          __m256i dp = _mm256_setzero_si256();
          for (int c = 0; c < 8; ++c) {
            const __m256i xb = _mm256_set1_epi32(xq[c]);
            dp = _mm256_add_epi32(dp, _mm256_madd_epi16(
                _mm256_maddubs_epi16(_mm256_abs_epi8(xb), _mm256_sign_epi8(wv[c], xb)), ones));
          }
          acc[mi][br][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp),
                                           _mm256_mul_ps(dv, _mm256_set1_ps(a.d[mi * G + g])),
                                           acc[mi][br][h]);
          if (mn) acc[mi][br][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a.s[mi * G + g]), acc[mi][br][h]);
        }
      }
  for (int mi = 0; mi < MC; ++mi)
    for (int br = 0; br < BR; ++br)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + mi * N + br * kX16 + 8 * h, acc[mi][br][h]);
}
#endif  // SL_ISA == 1

// ------------------------------------------------------------------ generic
#if SL_ISA == 0
// The generic build's x16 product (both bit widths): lane r of 64-byte chunk c holds bytes
// 4c..4c+3 of row r's group; 4-bit: low nibbles are codes 4c+i, high nibbles codes 16+4c+i;
// 8-bit: signed codes 4c+i.
template <int BITS, int MC, int BR>
inline void x16_tile_scalar(const ActQ& a, int64_t K, const uint8_t* w, const float* d,
                            const float* mn, int64_t G, float* y, int64_t N) {
  constexpr int chunks = BITS;  // 64-byte chunks per block and group
  for (int mi = 0; mi < MC; ++mi)
    for (int br = 0; br < BR; ++br)
      for (int r = 0; r < kX16; ++r) {
        float t = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          const uint8_t* wb = w + (br * G + g) * 64 * chunks;
          const int8_t* xg = a.q + mi * K + g * 32;
          int32_t s = 0;
          for (int c = 0; c < chunks; ++c)
            for (int i = 0; i < 4; ++i) {
              const uint8_t b = wb[64 * c + 4 * r + i];
              if constexpr (BITS == 4) s += (b & 15) * xg[4 * c + i] + (b >> 4) * xg[16 + 4 * c + i];
              else s += static_cast<int8_t>(b) * xg[4 * c + i];
            }
          const int64_t o = (br * G + g) * kX16 + r;
          t += float(s) * d[o] * a.d[mi * G + g];
          if (mn) t += mn[o] * a.s[mi * G + g];
        }
        y[mi * N + br * kX16 + r] = t;
      }
}

template <int MC, int BR>
inline void x16_tile(const ActQ& a, int64_t K, const uint8_t* w, const float* d, const float* mn,
                     int64_t G, float* y, int64_t N) {
  x16_tile_scalar<4, MC, BR>(a, K, w, d, mn, G, y, N);
}

template <int MC, int BR>
inline void x16_tile8(const ActQ& a, const int32_t* isum, int64_t K, const uint8_t* w,
                      const float* d, const float* mn, int64_t G, float* y, int64_t N) {
  (void)isum;
  x16_tile_scalar<8, MC, BR>(a, K, w, d, mn, G, y, N);
}
#endif  // SL_ISA == 0

// ------------------------------------------------------------------ the product
// one 16-row block per pass at every row count (the tile bodies take BR blocks): passes over
// two blocks at once (two code streams and four of scales per thread) read a 1b-shape decode
// step's weights from DRAM 13 % slower at 1 and 2 rows (Zen 4, 2026-12-06)
template <int BITS, int MC>
inline void x16_blocks(const ActQ& a, const int32_t* isum, int64_t K, const uint8_t* qw,
                       const float* d, const float* mn, int64_t G, int64_t N, int64_t b0,
                       int64_t b1, float* y) {
  const int64_t bw = G * 16 * BITS * 4, bs = G * kX16;
  for (int64_t b = b0; b < b1; ++b) {
    if constexpr (BITS == 4)
      x16_tile<MC, 1>(a, K, qw + b * bw, d + b * bs, mn ? mn + b * bs : nullptr, G, y + b * kX16, N);
    else
      x16_tile8<MC, 1>(a, isum, K, qw + b * bw, d + b * bs, mn ? mn + b * bs : nullptr, G,
                       y + b * kX16, N);
  }
}

// activation rows per pass over a weight block (AVX-512: 16 accumulators + 8 unpacked chunks
// in 32 registers, 1.2-1.3 TOP/s at 64-512 rows where 8 rows per pass gave 0.8-0.85; the AVX2
// build keeps 8: its 16 registers hold two 8-lane halves per block) and per work item
constexpr int kX16Rows = SL_ISA == 2 ? 16 : 8;
constexpr int64_t kX16MRows = 64;

// x16_blocks for the last `rest` (< kX16Rows) activation rows
template <int BITS, int MC>
inline void x16_rest(int64_t rest, const ActQ& a, const int32_t* isum, int64_t K,
                     const uint8_t* qw, const float* d, const float* mn, int64_t G, int64_t N,
                     int64_t b0, int64_t b1, float* y) {
  if constexpr (MC > 0) {
    if (rest == MC) x16_blocks<BITS, MC>(a, isum, K, qw, d, mn, G, N, b0, b1, y);
    else x16_rest<BITS, MC - 1>(rest, a, isum, K, qw, d, mn, G, N, b0, b1, y);
  }
}

// The activations of an x16 product, quantized (see quantize_act) in its scratch.
struct X16In {
  const int8_t* xq;
  const float *xd, *xs;
  const int32_t* isum;  // -128 x the codes' sum per group (8-bit weights only, see x16_tile8)
  int64_t K, G;
  ActQ at(int64_t m) const { return ActQ{xq + m * K, xd + m * G, xs + m * G}; }
};

template <int BITS>
X16In x16_quantize(const float* x, int64_t M, int64_t K, void* scratch) {
  const int64_t G = K / 32;
  int8_t* xq = static_cast<int8_t*>(scratch);
  float* xd = reinterpret_cast<float*>(xq + ((M * K + 63) / 64) * 64);
  float* xs = xd + M * G;
  int32_t* isum = reinterpret_cast<int32_t*>(xs + M * G);
  quantize_act(x, M, K, xq, xd, xs);
  if (BITS == 8) {
    auto sums = [&](int64_t m) {
      for (int64_t i = m * G; i < (m + 1) * G; ++i) {
        int32_t t = 0;
        for (int j = 0; j < 32; ++j) t += xq[i * 32 + j];
        isum[i] = -128 * t;
      }
    };
    if (in_region()) parallel_for(M, sums);
    else for (int64_t m = 0; m < M; ++m) sums(m);
  }
  return X16In{xq, xd, xs, isum, K, G};
}

// One pass: rows [m, m + rows) (rows <= kX16Rows) times blocks [b0, b1) -> y (row stride ldy):
// each unpacked weight group serves all the rows (the accumulators and one block's 8 unpacked
// chunks fit the 32 vector registers).
template <int BITS>
inline void x16_pass(const X16In& in, int64_t m, int64_t rows, const uint8_t* qw, const float* d,
                     const float* mn, int64_t ldy, int64_t b0, int64_t b1, float* y) {
  const ActQ a = in.at(m);
  const int32_t* is = in.isum + m * in.G;
  if (rows == kX16Rows) x16_blocks<BITS, kX16Rows>(a, is, in.K, qw, d, mn, in.G, ldy, b0, b1, y);
  else x16_rest<BITS, kX16Rows - 1>(rows, a, is, in.K, qw, d, mn, in.G, ldy, b0, b1, y);
}

// The threads' work items: a range of `units` (row blocks, or gate/up block pairs) times a
// range of activation rows (kX16MRows: many tokens would leave too few items over the units
// alone, e.g. 9 for a 576-row weight); fn(u0, u1, m0, m1) for each.
template <class F>
inline void x16_split(int64_t M, int64_t units, F& fn) {
  const int64_t nt = nthreads();
  // at least 2 items per thread and at most 16 units per item, their count a multiple of the
  // threads', the units spread evenly (chunks of a fixed size left e.g. 9 items of 4 of a
  // 576-row weight's 36 blocks: 5 on one thread, 4 on the other; 3-5 % slower at 16 rows)
  int64_t nchunks = std::max<int64_t>(2 * nt, (units + 15) / 16);
  nchunks = std::min<int64_t>(units, (nchunks + nt - 1) / nt * nt);
  const int64_t mrows = M <= kX16MRows ? M : kX16MRows, mparts = (M + mrows - 1) / mrows;
  auto body = [&](int64_t item) {
    const int64_t c = item % nchunks, m0 = (item / nchunks) * mrows;
    fn(c * units / nchunks, (c + 1) * units / nchunks, m0, std::min(M, m0 + mrows));
  };
  parallel_for(nchunks * mparts, body);
}

template <int BITS>
void qlinear_x16(const float* x, int64_t M, int64_t K, const uint8_t* qw, const float* d,
                 const float* mn, int64_t N, float* y, void* scratch) {
  if (M <= 0) return;
  const X16In in = x16_quantize<BITS>(x, M, K, scratch);
  auto body = [&](int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m += kX16Rows)
      x16_pass<BITS>(in, m, std::min<int64_t>(kX16Rows, m1 - m), qw, d, mn, N, b0, b1, y + m * N);
  };
  x16_split(M, N / kX16, body);
}

// out [M, F] = silu(x W_gate^T) * (x W_up^T) in one x16 product, the activation in its
// epilogue: W's 16-row blocks alternate gate block j, up block j (Kernels.pack_x16_swiglu), so
// a pair of blocks gives 16 outputs; the gate/up products never leave the thread's buffer.
// Same numbers as sl_qlinear_x16 then sl_silu_mul.
template <int BITS>
void qlinear_x16_swiglu(const float* x, int64_t M, int64_t K, const uint8_t* qw, const float* d,
                        const float* mn, int64_t F, float* out, void* scratch) {
  if (M <= 0) return;
  const X16In in = x16_quantize<BITS>(x, M, K, scratch);
  const int64_t bw = in.G * 16 * BITS * 4, bs = in.G * kX16;  // one block's code bytes, scales
  auto body = [&](int64_t p0, int64_t p1, int64_t m0, int64_t m1) {
    alignas(64) float gu[kX16Rows * 2 * kX16];  // rows x [gate 16 | up 16]
    for (int64_t m = m0; m < m1; m += kX16Rows) {
      const int64_t rows = std::min<int64_t>(kX16Rows, m1 - m);
      for (int64_t p = p0; p < p1; ++p) {
        x16_pass<BITS>(in, m, rows, qw + 2 * p * bw, d + 2 * p * bs, mn ? mn + 2 * p * bs : nullptr,
                       2 * kX16, 0, 2, gu);
        for (int64_t r = 0; r < rows; ++r) {
          const float* g = gu + r * 2 * kX16;
          float* o = out + (m + r) * F + p * kX16;
#if SL_ISA == 2
          _mm512_storeu_ps(o, silu_mul16(_mm512_load_ps(g), _mm512_load_ps(g + kX16)));
#else
          for (int i = 0; i < kX16; ++i) o[i] = silu(g[i]) * g[kX16 + i];
#endif
        }
      }
    }
  };
  x16_split(M, F / kX16, body);
}

// The x16 layout of a row-layout weight (see sl_repack_x16).
void repack_x16(const uint8_t* qw, const float* d, const float* mn, int64_t N, int64_t K,
                int bits, uint8_t* ow, float* od, float* om) {
  const int64_t G = K / 32, gb = 4 * bits, chunks = bits;  // bytes per row group; 64-byte chunks
  for (int64_t b = 0; b < N / kX16; ++b)
    for (int64_t g = 0; g < G; ++g)
      for (int r = 0; r < kX16; ++r) {
        const int64_t row = b * kX16 + r;
        for (int c = 0; c < chunks; ++c)
          std::memcpy(ow + ((b * G + g) * chunks + c) * 64 + 4 * r,
                      qw + row * (K * bits / 8) + g * gb + 4 * c, 4);
        od[(b * G + g) * kX16 + r] = d[row * G + g];
        if (mn) om[(b * G + g) * kX16 + r] = mn[row * G + g];
      }
}

}  // namespace
