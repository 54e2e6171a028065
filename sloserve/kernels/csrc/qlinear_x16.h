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

// An x16 weight as the products take it (_SlX16 in sloserve/kernels/_lib.py): its records
// (layout below), code bits (4 or 8), whether they hold offsets and whether their scales and
// offsets are float16 (0/1), and its shape [N, K] (N = 2F for a gate/up weight packed for the
// SwiGLU epilogue).
struct SlX16 {
  const uint8_t* qw;
  int64_t bits, mins, sc16, N, K;
};

namespace {

// ------------------------------------------------------------------ the x16 layout
// Rows in blocks of 16 (N % 16 == 0); a block is G group records one after another, and a
// weight its N / 16 blocks. The record of block b, group g: the codes, then the 16 rows'
// scales, then their offsets (Q4_1-like weights only):
//   codes: `bits` chunks of 64 bytes; 32-bit lane r of chunk c holds bytes 4c..4c+3 of row
//          16b + r's group g in the row layout (4-bit: low nibbles codes 4c..4c+3, high
//          nibbles codes 16+4c..16+4c+3; 8-bit: signed codes 4c..4c+3);
//   scales, offsets: 16 float32, or 16 float16 where every value of the weight is exactly one
//          (GGUF's Q4_0 / Q4_1 / Q8_0 scales are float16: 320 bytes a record instead of 384).
// One dpbusd then multiplies 4 codes of 16 rows with 4 broadcast activations, so the 16 rows'
// group sums land in the 16 lanes (no horizontal sums, one scale multiply per group and block),
// and a decode step reads each weight as one sequential stream (separate arrays of codes,
// scales and offsets were three streams per thread: 8-13 % slower from DRAM at 1 row, Zen 4).

constexpr int kX16 = 16;

// An x16 weight's format (SlX16's bits, mins, sc16): record sizes.
struct X16Fmt {
  int bits;
  bool mn;  // has offsets
  bool h;   // scales and offsets are float16
  int64_t codes() const { return 64 * bits; }               // code bytes of a record
  int64_t scales() const { return kX16 * (h ? 2 : 4); }     // bytes of its 16 scales
  int64_t rec() const { return codes() + scales() * (mn ? 2 : 1); }
};
inline X16Fmt x16_fmt(const SlX16& w) { return X16Fmt{int(w.bits), w.mins != 0, w.sc16 != 0}; }

// 16 scales (or offsets) of a record as float32, and one of them
inline float f16_to_f32(uint16_t h) {  // IEEE binary16, subnormals and inf/NaN included
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ffu, u;
  if (e == 0x1f) u = sign | 0x7f800000u | (m << 13);
  else if (e) u = sign | ((e + 112) << 23) | (m << 13);
  else if (!m) u = sign;
  else {  // subnormal: normalize
    e = 113;
    while (!(m & 0x400u)) { m <<= 1; --e; }
    u = sign | (e << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float scale_at(const uint8_t* p, bool h, int i) {
  if (h) return f16_to_f32(reinterpret_cast<const uint16_t*>(p)[i]);
  return reinterpret_cast<const float*>(p)[i];
}
#if SL_ISA == 2
inline __m512 scales16(const uint8_t* p, bool h) {
  return h ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))
           : _mm512_loadu_ps(reinterpret_cast<const float*>(p));
}
#endif
#if SL_ISA >= 1
inline __m256 scales8(const uint8_t* p, bool h, int half) {  // lanes 8 half .. 8 half + 7
  return h ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * half)))
           : _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8 * half);
}
#endif

// x16_tile<MC>: MC activation rows (ActQ) times one 4-bit weight block `w` (its G records) ->
// y [MC, 16] (row stride N). x16_tile8: the same for 8-bit codes, isum holding -128 times each
// group's integer activation sum (see its AVX-512 body). One definition of each per instruction
// set below.

constexpr int64_t kX16Prefetch = 2048;  // bytes ahead in a 4-bit weight stream (see x16_tile)

// the record's lines kX16Prefetch (4-bit) or twice that (8-bit) bytes ahead, into L2 (T1: more
// misses in flight than L1 takes; 1-row products of 210 MB of weights read 24.6 -> 28.4 GB/s
// against T0, 16 rows unchanged, Zen 4)
inline void x16_prefetch(const uint8_t* rec, int64_t R, int64_t ahead) {
#if SL_ISA > 0
  for (int64_t o = 0; o < R; o += 64) _mm_prefetch(reinterpret_cast<const char*>(rec + ahead + o), _MM_HINT_T1);
#else
  (void)rec, (void)R, (void)ahead;
#endif
}

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
// unrolled so that the MC accumulators stay in registers (g++ left the MC = 16 loop rolled,
// its accumulators on the stack, a load and a store per 8 dpbusd, and tested `mn` in it)
template <int MC, bool HAS_MN>
inline void x16_tile_avx512(const ActQ& a, int64_t K, const uint8_t* w, const X16Fmt& f,
                            int64_t G, float* y, int64_t N) {
  __m512 acc[MC];
#pragma GCC unroll 16
  for (int mi = 0; mi < MC; ++mi) acc[mi] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const int64_t R = f.rec();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec = w + g * R;
    // the weights stream from memory once per step: fetch a few groups ahead (the vector work
    // of a group's 16 rows fills the out-of-order window, which then holds too few loads to
    // keep the memory busy: 12 GB/s without this at 16 rows, 38 at 1)
    x16_prefetch(rec, R, kX16Prefetch);
    // the high nibbles shifted down once per group (4 shifts shared by the MC rows), so that a
    // row's 8 dpbusd run in one chain into one sum: per row and group 8 dpbusd and 4 other
    // vector ops, against 6 when the high nibbles stayed 16x and the row's two sums were scaled
    // and added (512-row products +5-8 %, 16 rows +2-6 %, 1 row from DRAM unchanged: interleaved
    // A/B, Zen 4; the same floats: 16 S x (d / 16) is S x d)
    __m512i lo[4], hi[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(rec + 64 * c);
      lo[c] = _mm512_and_si512(v, m4);
      hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    const __m512 dv = scales16(rec + 256, f.h);
    __m512 mv;
    if constexpr (HAS_MN) mv = scales16(rec + 256 + f.scales(), f.h);
    const int8_t* xg = a.q + g * 32;
#pragma GCC unroll 16
    for (int mi = 0; mi < MC; ++mi) {
      const int32_t* xq = reinterpret_cast<const int32_t*>(xg + mi * K);
      const __m512 dx = _mm512_set1_ps(a.d[mi * G + g]);
      __m512i i = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) i = dpbusd_b(i, lo[c], xq + c);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) i = dpbusd_b(i, hi[c], xq + 4 + c);
      acc[mi] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(dv, dx), acc[mi]);
      if constexpr (HAS_MN) acc[mi] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.s[mi * G + g]), acc[mi]);
    }
  }
#pragma GCC unroll 16
  for (int mi = 0; mi < MC; ++mi) _mm512_storeu_ps(y + mi * N, acc[mi]);
}

template <int MC>
inline void x16_tile(const ActQ& a, int64_t K, const uint8_t* w, const X16Fmt& f, int64_t G,
                     float* y, int64_t N) {
  // per group: the block's codes unpacked once (8 registers), then for each of the MC
  // activation rows 8 dpbusd (one chain), their int32 sum scaled into the float accumulator
  if (f.mn) x16_tile_avx512<MC, true>(a, K, w, f, G, y, N);
  else x16_tile_avx512<MC, false>(a, K, w, f, G, y, N);
}

// x16_tile8's AVX-512 body, unrolled as x16_tile_avx512 is (and for the same reason)
template <int MC, bool HAS_MN>
inline void x16_tile8_avx512(const ActQ& a, const int32_t* isum, int64_t K, const uint8_t* w,
                             const X16Fmt& f, int64_t G, float* y, int64_t N) {
  __m512 acc[MC];
#pragma GCC unroll 16
  for (int mi = 0; mi < MC; ++mi) acc[mi] = _mm512_setzero_ps();
  const __m512i off = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t R = f.rec();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec = w + g * R;
    x16_prefetch(rec, R, 2 * kX16Prefetch);
    __m512i wv[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) wv[c] = _mm512_xor_si512(_mm512_loadu_si512(rec + 64 * c), off);
    const __m512 dv = scales16(rec + 512, f.h);
    __m512 mv;
    if constexpr (HAS_MN) mv = scales16(rec + 512 + f.scales(), f.h);
#pragma GCC unroll 16
    for (int mi = 0; mi < MC; ++mi) {
      const int32_t* xq = reinterpret_cast<const int32_t*>(a.q + mi * K + g * 32);
      const __m512 dx = _mm512_set1_ps(a.d[mi * G + g]);
      __m512i i = _mm512_set1_epi32(isum[mi * G + g]), i2 = _mm512_setzero_si512();  // a broadcast load
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) i = dpbusd_b(i, wv[c], xq + c);
#pragma GCC unroll 4
      for (int c = 4; c < 8; ++c) i2 = dpbusd_b(i2, wv[c], xq + c);
      i = _mm512_add_epi32(i, i2);
      acc[mi] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(dv, dx), acc[mi]);
      if constexpr (HAS_MN) acc[mi] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.s[mi * G + g]), acc[mi]);
    }
  }
#pragma GCC unroll 16
  for (int mi = 0; mi < MC; ++mi) _mm512_storeu_ps(y + mi * N, acc[mi]);
}

// 8-bit codes: AVX-512 dpbusd wants unsigned x signed: the codes are offset by 128 at load
// (xor 0x80) and 128 times the group's integer activation sum (isum holds -128 times it) is
// taken off again, so the dot product stays exact.
template <int MC>
inline void x16_tile8(const ActQ& a, const int32_t* isum, int64_t K, const uint8_t* w,
                      const X16Fmt& f, int64_t G, float* y, int64_t N) {
  if (f.mn) x16_tile8_avx512<MC, true>(a, isum, K, w, f, G, y, N);
  else x16_tile8_avx512<MC, false>(a, isum, K, w, f, G, y, N);
}
#endif  // SL_ISA == 2

// ------------------------------------------------------------------ AVX2
#if SL_ISA == 1
// one group's 8 lanes into the accumulator: the integer sums dp times the scales dv and the
// activations' scale dx, plus the offsets mv times the activations' group sum s (mn: it has them)
inline __m256 x16_acc8(__m256 acc, __m256i dp, __m256 dv, __m256 mv, float dx, float s, bool mn) {
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dp), _mm256_mul_ps(dv, _mm256_set1_ps(dx)), acc);
  return mn ? _mm256_fmadd_ps(mv, _mm256_set1_ps(s), acc) : acc;
}

template <int MC>
inline void x16_tile(const ActQ& a, int64_t K, const uint8_t* w, const X16Fmt& f, int64_t G,
                     float* y, int64_t N) {
  // two 8-lane halves per block; pmaddubsw (u8 codes x s8 activations, |sum of 2| <= 3810)
  __m256 acc[MC][2];
  for (int mi = 0; mi < MC; ++mi) acc[mi][0] = acc[mi][1] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t R = f.rec();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec = w + g * R;
    x16_prefetch(rec, R, kX16Prefetch);
    for (int h = 0; h < 2; ++h) {
      __m256i lo[4], hi[4];
      const uint8_t* wb = rec + 32 * h;
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * c));
        lo[c] = _mm256_and_si256(v, m4);
        hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      }
      const __m256 dv = scales8(rec + 256, f.h, h);
      const __m256 mv = f.mn ? scales8(rec + 256 + f.scales(), f.h, h) : dv;
      for (int mi = 0; mi < MC; ++mi) {
        const int32_t* xq = reinterpret_cast<const int32_t*>(a.q + mi * K + g * 32);
        __m256i p = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
          p = _mm256_add_epi16(p, _mm256_maddubs_epi16(lo[c], _mm256_set1_epi32(xq[c])));
          p = _mm256_add_epi16(p, _mm256_maddubs_epi16(hi[c], _mm256_set1_epi32(xq[4 + c])));
        }  // 8 pair sums of |.| <= 3810: |p| <= 30480 fits int16
        acc[mi][h] = x16_acc8(acc[mi][h], _mm256_madd_epi16(p, ones), dv, mv, a.d[mi * G + g],
                              a.s[mi * G + g], f.mn);
      }
    }
  }
  for (int mi = 0; mi < MC; ++mi)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + mi * N + 8 * h, acc[mi][h]);
}

template <int MC>
inline void x16_tile8(const ActQ& a, const int32_t* isum, int64_t K, const uint8_t* w,
                      const X16Fmt& f, int64_t G, float* y, int64_t N) {
  (void)isum;
  // |x| * sign(w, x) keeps pmaddubsw's pair sums <= 2 * 127 * 127 (no int16 saturation)
  __m256 acc[MC][2];
  for (int mi = 0; mi < MC; ++mi) acc[mi][0] = acc[mi][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t R = f.rec();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec = w + g * R;
    x16_prefetch(rec, R, 2 * kX16Prefetch);
    for (int h = 0; h < 2; ++h) {
      __m256i wv[8];
      const uint8_t* wb = rec + 32 * h;
      for (int c = 0; c < 8; ++c) wv[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * c));
      const __m256 dv = scales8(rec + 512, f.h, h);
      const __m256 mv = f.mn ? scales8(rec + 512 + f.scales(), f.h, h) : dv;
      for (int mi = 0; mi < MC; ++mi) {
        const int32_t* xq = reinterpret_cast<const int32_t*>(a.q + mi * K + g * 32);
        __m256i dp = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) {
          const __m256i xb = _mm256_set1_epi32(xq[c]);
          dp = _mm256_add_epi32(dp, _mm256_madd_epi16(
              _mm256_maddubs_epi16(_mm256_abs_epi8(xb), _mm256_sign_epi8(wv[c], xb)), ones));
        }
        acc[mi][h] = x16_acc8(acc[mi][h], dp, dv, mv, a.d[mi * G + g], a.s[mi * G + g], f.mn);
      }
    }
  }
  for (int mi = 0; mi < MC; ++mi)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + mi * N + 8 * h, acc[mi][h]);
}
#endif  // SL_ISA == 1

// ------------------------------------------------------------------ generic
#if SL_ISA == 0
// The generic build's x16 product (both bit widths), from the layout's description above.
template <int BITS, int MC>
inline void x16_tile_scalar(const ActQ& a, int64_t K, const uint8_t* w, const X16Fmt& f,
                            int64_t G, float* y, int64_t N) {
  constexpr int chunks = BITS;  // 64-byte chunks per record
  const int64_t R = f.rec();
  for (int mi = 0; mi < MC; ++mi)
    for (int r = 0; r < kX16; ++r) {
      float t = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* rec = w + g * R;
        const int8_t* xg = a.q + mi * K + g * 32;
        int32_t s = 0;
        for (int c = 0; c < chunks; ++c)
          for (int i = 0; i < 4; ++i) {
            const uint8_t b = rec[64 * c + 4 * r + i];
            if constexpr (BITS == 4) s += (b & 15) * xg[4 * c + i] + (b >> 4) * xg[16 + 4 * c + i];
            else s += static_cast<int8_t>(b) * xg[4 * c + i];
          }
        t += float(s) * scale_at(rec + f.codes(), f.h, r) * a.d[mi * G + g];
        if (f.mn) t += scale_at(rec + f.codes() + f.scales(), f.h, r) * a.s[mi * G + g];
      }
      y[mi * N + r] = t;
    }
}

template <int MC>
inline void x16_tile(const ActQ& a, int64_t K, const uint8_t* w, const X16Fmt& f, int64_t G,
                     float* y, int64_t N) {
  x16_tile_scalar<4, MC>(a, K, w, f, G, y, N);
}

template <int MC>
inline void x16_tile8(const ActQ& a, const int32_t* isum, int64_t K, const uint8_t* w,
                      const X16Fmt& f, int64_t G, float* y, int64_t N) {
  (void)isum;
  x16_tile_scalar<8, MC>(a, K, w, f, G, y, N);
}
#endif  // SL_ISA == 0

// ------------------------------------------------------------------ the product
// One 16-row block per pass at every row count: passes over two blocks at once (two code
// streams and four of scales per thread, before the records) read a 1b-shape decode step's
// weights from DRAM 13 % slower at 1 and 2 rows (Zen 4, 2026-12-06).
template <int MC>
inline void x16_blocks(const ActQ& a, const int32_t* isum, int64_t K, const uint8_t* qw,
                       const X16Fmt& f, int64_t G, int64_t N, int64_t b0, int64_t b1, float* y) {
  const int64_t bw = G * f.rec();
  for (int64_t b = b0; b < b1; ++b) {
    if (f.bits == 4) x16_tile<MC>(a, K, qw + b * bw, f, G, y + b * kX16, N);
    else x16_tile8<MC>(a, isum, K, qw + b * bw, f, G, y + b * kX16, N);
  }
}

// activation rows per pass over a weight block (AVX-512: 16 accumulators + 8 unpacked chunks
// in 32 registers, 1.2-1.3 TOP/s at 64-512 rows where 8 rows per pass gave 0.8-0.85; the AVX2
// build keeps 8: its 16 registers hold two 8-lane halves per block) and per work item
constexpr int kX16Rows = SL_ISA == 2 ? 16 : 8;
constexpr int64_t kX16MRows = 64;

// x16_blocks for the last `rest` (< kX16Rows) activation rows
template <int MC>
inline void x16_rest(int64_t rest, const ActQ& a, const int32_t* isum, int64_t K,
                     const uint8_t* qw, const X16Fmt& f, int64_t G, int64_t N, int64_t b0,
                     int64_t b1, float* y) {
  if constexpr (MC > 0) {
    if (rest == MC) x16_blocks<MC>(a, isum, K, qw, f, G, N, b0, b1, y);
    else x16_rest<MC - 1>(rest, a, isum, K, qw, f, G, N, b0, b1, y);
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

inline X16In x16_quantize(const float* x, int64_t M, int64_t K, int bits, void* scratch) {
  const int64_t G = K / 32;
  int8_t* xq = static_cast<int8_t*>(scratch);
  float* xd = reinterpret_cast<float*>(xq + ((M * K + 63) / 64) * 64);
  float* xs = xd + M * G;
  int32_t* isum = reinterpret_cast<int32_t*>(xs + M * G);
  quantize_act(x, M, K, xq, xd, xs);
  if (bits == 8) {
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
inline void x16_pass(const X16In& in, int64_t m, int64_t rows, const uint8_t* qw,
                     const X16Fmt& f, int64_t ldy, int64_t b0, int64_t b1, float* y) {
  const ActQ a = in.at(m);
  const int32_t* is = in.isum + m * in.G;
  if (rows == kX16Rows) x16_blocks<kX16Rows>(a, is, in.K, qw, f, in.G, ldy, b0, b1, y);
  else x16_rest<kX16Rows - 1>(rows, a, is, in.K, qw, f, in.G, ldy, b0, b1, y);
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

// y [M, w.N] = x [M, w.K] @ W^T
void qlinear_x16(const float* x, int64_t M, const SlX16& w, float* y, void* scratch) {
  if (M <= 0) return;
  const X16Fmt f = x16_fmt(w);
  const X16In in = x16_quantize(x, M, w.K, f.bits, scratch);
  auto body = [&](int64_t b0, int64_t b1, int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m += kX16Rows)
      x16_pass(in, m, std::min<int64_t>(kX16Rows, m1 - m), w.qw, f, w.N, b0, b1, y + m * w.N);
  };
  x16_split(M, w.N / kX16, body);
}

// out [M, F] = silu(x W_gate^T) * (x W_up^T) (F = w.N / 2) in one x16 product, the activation
// in its epilogue: W's 16-row blocks alternate gate block j, up block j
// (Kernels.pack_x16_swiglu), so a pair of blocks gives 16 outputs; the gate/up products never
// leave the thread's buffer. Same numbers as sl_qlinear_x16 then sl_silu_mul.
void qlinear_x16_swiglu(const float* x, int64_t M, const SlX16& w, float* out, void* scratch) {
  if (M <= 0) return;
  const X16Fmt f = x16_fmt(w);
  const int64_t F = w.N / 2;
  const X16In in = x16_quantize(x, M, w.K, f.bits, scratch);
  const int64_t bw = in.G * f.rec();  // one block's bytes
  auto body = [&](int64_t p0, int64_t p1, int64_t m0, int64_t m1) {
    alignas(64) float gu[kX16Rows * 2 * kX16];  // rows x [gate 16 | up 16]
    for (int64_t m = m0; m < m1; m += kX16Rows) {
      const int64_t rows = std::min<int64_t>(kX16Rows, m1 - m);
      for (int64_t p = p0; p < p1; ++p) {
        x16_pass(in, m, rows, w.qw + 2 * p * bw, f, 2 * kX16, 0, 2, gu);
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

// The x16 layout of a row-layout weight (see sl_repack_x16): scales and offsets [N, G] of
// `ss` bytes each (4: float32, 2: float16, copied as they are).
void repack_x16(const uint8_t* qw, const uint8_t* d, const uint8_t* mn, int64_t N, int64_t K,
                int bits, int ss, uint8_t* out) {
  const X16Fmt f{bits, mn != nullptr, ss == 2};
  const int64_t G = K / 32, gb = 4 * bits, R = f.rec();  // bytes per row group; per record
  for (int64_t b = 0; b < N / kX16; ++b)
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* rec = out + (b * G + g) * R;
      for (int r = 0; r < kX16; ++r) {
        const int64_t row = b * kX16 + r;
        for (int c = 0; c < bits; ++c)
          std::memcpy(rec + c * 64 + 4 * r, qw + row * (K * bits / 8) + g * gb + 4 * c, 4);
        std::memcpy(rec + f.codes() + ss * r, d + (row * G + g) * ss, ss);
        if (mn) std::memcpy(rec + f.codes() + f.scales() + ss * r, mn + (row * G + g) * ss, ss);
      }
    }
}

}  // namespace
