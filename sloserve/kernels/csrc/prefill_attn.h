// sloserve CPU kernels: causal attention of one request's prefill chunk over its bf16 paged
// cache in place (sl_prefill_attn), FlashAttention-2's loop with bf16 Q, K, V and
// probabilities and float32 accumulation, on the AMX tiles or on AVX512-BF16's vdpbf16ps
// (prefill_attn<AMX>: same packing, same online softmax, same roundings; the two agree to
// float32 summation order). AVX-512 library only (SL_AMX, amx_gemm.h), those instructions
// enabled for these functions alone; the caller picks the body from sl_amx_init /
// sl_avx512_bf16.
//
// Threads: one OpenMP region; phase 1 packs each KV head's context (static), phase 2 takes
// (query head, 16 query tokens) items one at a time.
#pragma once

#include "amx_gemm.h"

namespace {

#if SL_AMX
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512bf16")

// 16 x 16 32-bit transpose: dst[c * ld_dst + r] = src[r * ld_src + c].
inline void tr16x16(const uint32_t* src, int64_t ld_src, uint32_t* dst, int64_t ld_dst) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * ld_src);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4j + c], 128-bit lane L: rows 4j..4j+3 of column 4L + c. Two rounds of lane shuffles
  // gather column 4L + c's four lanes (j = 0..3) into one register: r[i] is then row i of dst.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * ld_dst, r[i]);
}

// ---- AMX flash attention for prefill chunks (several query tokens of one request).
// out [n, H, D] = softmax(q K^T * scale + causal mask) V over the request's whole context in
// the paged cache (its cached positions 0..P-1 and the chunk's own P..P+n-1, already written),
// K/V bf16, D % 32 == 0. FlashAttention-2's loop (Dao 2023, algorithm 1) per tile of 16 query
// tokens of one head, over blocks of 64 context tokens (blocks past the tile's last position
// skipped), in transposed form so that the softmax needs no horizontal reductions:
//   S^T [64 tokens][16 queries] = K Q^T        (K rows as the tiles' left operand, as cached)
//   m, l per query = one vector each; P^T = exp2(S^T - m) (log2 e folded into the scale)
//   O^T [D][16 queries] = O^T * exp2(m_old - m) + V^T P^T   (float32, in memory)
// with m raised only when a block's max passes it by more than 8 (log2 units; FlashAttention-4's
// conditional rescaling), so that most blocks skip the rescaling pass over O^T.
// Phase 1 packs each KV head's context once for its G query heads: K rows contiguous, V^T as
// tiles [16 d][32 tokens]; zeros past the context.
inline __m512 exp2_ps(__m512 x) {  // 2^x for x <= 0; rel. error ~2e-7; below -126: ~1e-38
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, k);  // [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, k);
}

struct PrefillAttnArgs {
  const float* q;
  int64_t q_stride, n, P;  // q row stride (floats) per token; query tokens; cached positions
  const uint16_t* cache;   // [2, num_blocks, block_size, Hkv, D] bf16
  const int64_t* blocks;   // the request's block table, ceil((P + n) / block_size) entries
  int64_t block_size, num_blocks, H, Hkv, D;
  float scale;
  float* out;              // [n, H, D]
};

inline int64_t prefill_attn_thread_bytes(int64_t D) {
  // Q rows, Q^T tiles, S^T, P^T tiles (2), O^T, P V, m / l / alpha
  return 16 * D * 2 + 16 * D * 2 + 64 * 16 * 4 + 2048 + 2 * D * 16 * 4 + 256;
}

// S^T [64 tokens][16 q] of one 64-token block on the AMX tiles: 4 accumulator tiles of 16
// tokens, K rows (tile A, row stride D) times the Q^T pair tiles (B). kb: K rows [64][D];
// qt_t: [D / 32][16 pairs][16 q][2].
inline void amx_scores(const uint16_t* kb, const uint16_t* qt_t, int64_t D, float* st) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < D / 32; ++c) {
    _tile_loadd(4, qt_t + c * 512, 64);
    _tile_loadd(6, kb + 32 * c, D * 2);
    _tile_dpbf16ps(0, 6, 4);
    _tile_loadd(7, kb + 16 * D + 32 * c, D * 2);
    _tile_dpbf16ps(1, 7, 4);
    _tile_loadd(6, kb + 32 * D + 32 * c, D * 2);
    _tile_dpbf16ps(2, 6, 4);
    _tile_loadd(7, kb + 48 * D + 32 * c, D * 2);
    _tile_dpbf16ps(3, 7, 4);
  }
  _tile_stored(0, st, 64);
  _tile_stored(1, st + 256, 64);
  _tile_stored(2, st + 512, 64);
  _tile_stored(3, st + 768, 64);
}

// O^T [D][16 q] += V^T P^T for one 64-token block on the AMX tiles, 4 d-chunks at a time (the
// accumulators loaded from O^T and stored back). vt0 / vt1: the block's two 32-token V^T halves
// ([DE][16 d][32 t]); pt: P^T pairs [32][16][2] (tokens 0-31, then 32-63).
inline void amx_pv(const uint16_t* vt0, const uint16_t* vt1, const uint16_t* pt, int64_t DE,
                   float* ot) {
  _tile_loadd(4, pt, 64);          // P^T tokens 0-31
  _tile_loadd(5, pt + 512, 64);    // 32-63
  for (int64_t e0 = 0; e0 < DE; e0 += 4) {
    const int64_t ne = std::min<int64_t>(4, DE - e0);
    const uint16_t* v0 = vt0 + e0 * 512;
    const uint16_t* v1 = vt1 + e0 * 512;
    float* dst = ot + e0 * 256;
    // accumulator T: d-chunk e0 + T over both 32-token halves (tile numbers are immediates)
#define SL_PV(T)                                   \
  if (ne > T) {                                    \
    _tile_loadd(T, dst + 256 * (T), 64);           \
    _tile_loadd(6, v0 + 512 * (T), 64);            \
    _tile_dpbf16ps(T, 6, 4);                       \
    _tile_loadd(7, v1 + 512 * (T), 64);            \
    _tile_dpbf16ps(T, 7, 5);                       \
    _tile_stored(T, dst + 256 * (T), 64);          \
  }
    SL_PV(0)
    SL_PV(1)
    SL_PV(2)
    SL_PV(3)
#undef SL_PV
  }
}

// acc += the bf16 pair products of a with the pair at x broadcast to all 16 lanes, the pair read
// by the instruction itself ({1to16}: g++ emits a separate vpbroadcastd for the intrinsic, one
// more vector op per dot product, as for vpdpbusd above)
inline __m512 dpbf16_b(__m512 acc, __m512bh a, const uint16_t* x) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}

// S^T rows [t0 + r] for the 16 query lanes, without AMX: per context token r, the dot products
// of its K row (bf16 pairs, broadcast) with the Q^T pair rows, 8 tokens per pass (AVX512-BF16
// vdpbf16ps: 16 lanes x 2 products per instruction). kb: K rows [64][D]; qt_t: [D / 2][16][2].
inline void bf16_scores(const uint16_t* kb, const uint16_t* qt_t, int64_t D, float* st) {
  for (int r0 = 0; r0 < 64; r0 += 8) {
    __m512 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; ++p) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(qt_t + 32 * p);
      for (int i = 0; i < 8; ++i) acc[i] = dpbf16_b(acc[i], qv, kb + (r0 + i) * D + 2 * p);
    }
    for (int i = 0; i < 8; ++i) _mm512_storeu_ps(st + 16 * (r0 + i), acc[i]);
  }
}

// O^T [D][16 q] += V^T P^T for one 64-token block without AMX: per 16 rows d, the accumulators
// stay in registers over the 32 token pairs (V^T pair broadcast, P^T pair row loaded once).
// vt0: the block's first 32-token V^T half ([DE][16 d][32 t]); vt1: its second; pt: [32][16][2].
inline void bf16_pv(const uint16_t* vt0, const uint16_t* vt1, const uint16_t* pt, int64_t DE,
                    float* ot) {
  for (int64_t e = 0; e < DE; ++e) {
    __m512 acc[16];
    float* o = ot + 256 * e;
    for (int dd = 0; dd < 16; ++dd) acc[dd] = _mm512_loadu_ps(o + 16 * dd);
    for (int p = 0; p < 32; ++p) {
      const __m512bh pv = (__m512bh)_mm512_loadu_si512(pt + 32 * p);
      const uint16_t* v = (p < 16 ? vt0 : vt1) + 512 * e + 2 * (p % 16);
      for (int dd = 0; dd < 16; ++dd) acc[dd] = dpbf16_b(acc[dd], pv, v + 32 * dd);
    }
    for (int dd = 0; dd < 16; ++dd) _mm512_storeu_ps(o + 16 * dd, acc[dd]);
  }
}

// AMX: the products on the tiles; else on AVX512-BF16's vdpbf16ps (same packing, same online
// softmax, the same bf16 roundings: the two agree to float32 summation order).
// INV (--batch-invariant): every query lane's arithmetic depends on its own scores alone, so
// that a query token's output is the same in any tile, i.e. whatever chunk it came in: a lane's
// reference m is raised only when its own block max passes it (not when another lane's does),
// and masked tokens get a probability of exactly 0 (not exp2(-126)), so that the context blocks
// a tile walks past a lane's own position (its later tile-mates') add nothing to that lane.
// Each lane walks the context in the same 64-token blocks from position 0 in every tile.
template <bool AMX, bool INV>
void prefill_attn(const PrefillAttnArgs& a, uint8_t* scratch) {
  const int64_t ctx = a.P + a.n, G = a.H / a.Hkv, D = a.D, DC = D / 32, DE = D / 16;
  const int64_t NJ = (ctx + 63) / 64;                 // 64-token context blocks
  const int64_t kv_elems = NJ * 64 * D * 2;          // K rows + V^T tiles, per KV head (bf16)
  uint16_t* packed = reinterpret_cast<uint16_t*>(scratch);
  uint8_t* thread_mem = scratch + a.Hkv * kv_elems * 2;
  const int64_t row = a.Hkv * D;                      // elements per token in a plane
  const uint16_t* vplane = a.cache + a.num_blocks * a.block_size * row;
  const int64_t QT = (a.n + 15) / 16;
  const float qscale = a.scale * 1.4426950408889634f;  // exp(x) = exp2(x log2 e)
  auto slot_of = [&](int64_t t) {
    return a.blocks[t / a.block_size] * a.block_size + t % a.block_size;
  };
#pragma omp parallel
  {
    if constexpr (AMX) amx_config();
    uint8_t* mem = thread_mem + prefill_attn_thread_bytes(D) * omp_get_thread_num();
    uint16_t* qb = reinterpret_cast<uint16_t*>(mem);      // [16][D] bf16 (also phase 1 temp)
    uint16_t* qt_t = qb + 16 * D;                         // [DC][16 pairs][16 q][2]
    float* st = reinterpret_cast<float*>(qt_t + 16 * D);  // S^T, then P^T: [64][16]
    uint16_t* pt = reinterpret_cast<uint16_t*>(st + 64 * 16);  // [2][16 pairs][16 q][2]
    float* ot = reinterpret_cast<float*>(pt + 1024);      // O^T [DE][16 d][16 q]
    float* pv = ot + D * 16;                              // O^T transposed, per d-chunk
    float* mla = pv + D * 16;                             // m[16] l[16]
    // phase 1: per (KV head, 32 context tokens): K rows, and V^T as a 32-bit transpose of
    // the pairs (V[2p, d], V[2p + 1, d]) (unit [p][d] -> [d][p]: row d = V[0.., d])
#pragma omp for schedule(static)
    for (int64_t it = 0; it < a.Hkv * NJ * 2; ++it) {
      const int64_t h = it / (NJ * 2), j2 = it % (NJ * 2);
      uint16_t* kr = packed + h * kv_elems;              // [NJ * 64][D]
      uint16_t* vt = kr + NJ * 64 * D;                   // [NJ * 2][DE][16 d][32 t]
      for (int64_t r = 0; r < 32; ++r) {
        const int64_t t = 32 * j2 + r;
        uint16_t* dst = kr + t * D;
        if (t >= ctx) std::memset(dst, 0, D * 2);
        else std::memcpy(dst, a.cache + slot_of(t) * row + h * D, D * 2);
      }
      uint32_t* units = reinterpret_cast<uint32_t*>(qb);  // [16 p][16 d] for one d-chunk
      for (int64_t e = 0; e < DE; ++e) {
        for (int p = 0; p < 16; ++p) {
          const int64_t t0 = 32 * j2 + 2 * p;
          __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
          if (t0 < ctx)
            lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                vplane + slot_of(t0) * row + h * D + 16 * e)));
          if (t0 + 1 < ctx)
            hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                vplane + slot_of(t0 + 1) * row + h * D + 16 * e)));
          _mm512_storeu_si512(units + 16 * p, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
        tr16x16(units, 16, reinterpret_cast<uint32_t*>(vt + (j2 * DE + e) * 512), 16);
      }
    }  // implicit barrier: every KV head packed
    // phase 2: (query head, 16 query tokens) items
    const __m512i pair_idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                              25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                              18, 2, 17, 1, 16, 0);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < a.H * QT; ++it) {
      const int64_t hq = it / QT, qt = it % QT, h = hq / G, i0 = 16 * qt;
      const int64_t rows_q = std::min<int64_t>(16, a.n - i0);
      const uint16_t* kr = packed + h * kv_elems;
      const uint16_t* vt = kr + NJ * 64 * D;
      const __m512 sc = _mm512_set1_ps(qscale);
      for (int64_t r = 0; r < 16; ++r) {  // Q rows, scaled, bf16
        uint16_t* o = qb + r * D;
        if (r >= rows_q) {
          std::memset(o, 0, D * 2);
          continue;
        }
        const float* src = a.q + (i0 + r) * a.q_stride + hq * D;
        for (int64_t d = 0; d < D; d += 32)
          _mm512_storeu_si512(o + d, (__m512i)_mm512_cvtne2ps_pbh(
              _mm512_mul_ps(_mm512_loadu_ps(src + d + 16), sc),
              _mm512_mul_ps(_mm512_loadu_ps(src + d), sc)));
      }
      for (int64_t c = 0; c < DC; ++c)  // Q^T tiles: units (q, p) -> (p, q)
        tr16x16(reinterpret_cast<const uint32_t*>(qb + 32 * c), D / 2,
                reinterpret_cast<uint32_t*>(qt_t + c * 512), 16);
      std::memset(ot, 0, D * 16 * 4);
      __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
      const int64_t last = a.P + i0 + rows_q - 1;  // the tile's last position
      for (int64_t j = 0; j <= last / 64; ++j) {
        const int64_t t0 = 64 * j;
        const uint16_t* kb = kr + t0 * D;
        if constexpr (AMX)
          amx_scores(kb, qt_t, D, st);
        else
          bf16_scores(kb, qt_t, D, st);
        // token t0 + r is visible to query lane q iff t0 + r <= P + i0 + q and < ctx
        const bool diag = t0 + 63 > a.P + i0 || t0 + 63 >= ctx;
        __m512 bm = _mm512_set1_ps(-INFINITY);
        for (int r = 0; r < 64; ++r) {
          __m512 s = _mm512_loadu_ps(st + 16 * r);
          if (diag) {
            const int64_t t = t0 + r, thr = t - a.P - i0;  // first visible lane
            const __mmask16 k = t >= ctx || thr >= 16 ? 0
                                : thr <= 0 ? 0xffff : static_cast<__mmask16>(0xffffu << thr);
            s = _mm512_mask_blend_ps(k, _mm512_set1_ps(-INFINITY), s);
            _mm512_storeu_ps(st + 16 * r, s);
          }
          bm = _mm512_max_ps(bm, s);
        }
        // lazy rescaling: m is the reference the P values are taken against, raised only when
        // a lane's block max passes it by more than 2^8 (P <= 256 otherwise); O^T and l then
        // go unscaled, and the PV products accumulate straight into O^T's tiles
        const __mmask16 up = _mm512_cmp_ps_mask(bm, _mm512_add_ps(m, _mm512_set1_ps(8.f)),
                                                _CMP_GT_OQ);
        __m512 alpha = _mm512_set1_ps(1.f);
        if (up != 0) {
          // INV: only the lanes that passed move (the others' alpha is exp2(0) = 1 exactly)
          const __m512 mn = INV ? _mm512_mask_max_ps(m, up, m, bm) : _mm512_max_ps(m, bm);
          // lanes with nothing visible yet keep m = -inf; they compute with 0 (p ~ 1e-38)
          alpha = exp2_ps(_mm512_sub_ps(m, _mm512_mask_blend_ps(
              _mm512_cmp_ps_mask(mn, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), mn,
              _mm512_setzero_ps())));
          m = mn;
          for (int64_t r = 0; r < D; ++r)  // O^T row d: every query lane rescaled by its alpha
            _mm512_storeu_ps(ot + 16 * r, _mm512_mul_ps(_mm512_loadu_ps(ot + 16 * r), alpha));
        }
        const __m512 mu = _mm512_mask_blend_ps(
            _mm512_cmp_ps_mask(m, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ), m, _mm512_setzero_ps());
        __m512 sum = _mm512_setzero_ps();
        for (int p = 0; p < 32; ++p) {  // P^T rows 2p, 2p + 1 -> pair row p of tile p / 16
          const __m512 s0 = _mm512_loadu_ps(st + 32 * p), s1 = _mm512_loadu_ps(st + 32 * p + 16);
          __m512 p0 = exp2_ps(_mm512_sub_ps(s0, mu));
          __m512 p1 = exp2_ps(_mm512_sub_ps(s1, mu));
          if (INV && diag) {  // masked tokens (score -inf): exactly 0
            const __m512 ninf = _mm512_set1_ps(-INFINITY);
            p0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s0, ninf, _CMP_NEQ_UQ), p0);
            p1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s1, ninf, _CMP_NEQ_UQ), p1);
          }
          sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
          const __m512i pair = _mm512_permutexvar_epi16(pair_idx,
                                                        (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
          _mm512_storeu_si512(pt + 32 * p, pair);
        }
        l = _mm512_fmadd_ps(l, alpha, sum);
        if constexpr (AMX)
          amx_pv(vt + (2 * j) * DE * 512, vt + (2 * j + 1) * DE * 512, pt, DE, ot);
        else
          bf16_pv(vt + (2 * j) * DE * 512, vt + (2 * j + 1) * DE * 512, pt, DE, ot);
      }
      _mm512_storeu_ps(mla, _mm512_div_ps(_mm512_set1_ps(1.f), l));
      for (int64_t e = 0; e < DE; ++e) {  // O^T [16 d][16 q] -> rows q
        tr16x16(reinterpret_cast<const uint32_t*>(ot + 256 * e), 16,
                reinterpret_cast<uint32_t*>(pv), 16);
        for (int64_t r = 0; r < rows_q; ++r)
          _mm512_storeu_ps(a.out + ((i0 + r) * a.H + hq) * D + 16 * e,
                           _mm512_mul_ps(_mm512_loadu_ps(pv + 16 * r), _mm512_set1_ps(mla[r])));
      }
    }
    if constexpr (AMX) _tile_release();
  }
}
#pragma GCC pop_options

// Bytes of sl_prefill_attn's scratch: every KV head's packed context, then each thread's own.
inline int64_t prefill_attn_scratch(int64_t ctx, int64_t Hkv, int64_t D, int64_t threads) {
  return Hkv * ((ctx + 63) / 64 * 64 * D * 2) * 2 + prefill_attn_thread_bytes(D) * threads;
}
#endif  // SL_AMX

}  // namespace
