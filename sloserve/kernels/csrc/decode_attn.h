// sloserve CPU kernels: decode attention over the paged KV cache in place (no gather), one query
// token per request (sl_paged_attn_decode), for every cache kind (kv_cache.h).
//
// FlashDecoding: work items are (request, split of the context[, KV head]); a context longer
// than split_len is cut into splits whose partial softmax states are merged by log-sum-exp
// afterwards, so a small batch with a long context still uses every thread (parallel_for).
// Bodies: on AVX-512 with head_dim 64 or 128 and at most 4 query heads per KV head, a kernel
// templated on those (decode_item_t: block by block, all heads, the next block prefetched); else
// the portable one (one head after the other, load_row / dot / axpy), which the AVX2 and generic
// builds use for every shape. (head_dim 128, the Llama-3 3B/8B and Qwen2.5 shapes, on the
// portable body read the cache at 6-7 GB/s in a 16-request step, half of head_dim 64's rate.)
#pragma once

#include "kv_cache.h"
#include "parallel.h"
#include "vec_math.h"

namespace {

#if SL_ISA == 2
// max of v[0..n), 16 lanes at a time (a scalar std::max loop is one 4-cycle dependency chain:
// 13 % of the decode kernel's time, measured with perf).
inline float max16(const float* v, int64_t n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(v + j));
  if (j < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - j)) - 1u);
    m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, v + j));
  }
  return _mm512_reduce_max_ps(m);
}

// [sum(a0), sum(a1), sum(a2), sum(a3)] of four 16-lane vectors: 13 shuffles/adds for the four
// instead of ~7 each with _mm512_reduce_add_ps (the kernel's hottest instructions, perf).
inline __m128 hsum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  // per 128-bit block b: [a0 lanes 0+2, a1 0+2, a0 1+3, a1 1+3]
  const __m512 x01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 x23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  // per block b: [a0, a1, a2, a3] each summed over the block's 4 lanes
  const __m512 y = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x01), _mm512_castps_pd(x23))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x01), _mm512_castps_pd(x23))));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(y), _mm512_extractf32x8_ps(y, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// One K or V row of D = 16 NV cache values at p as NV float32 vectors. bf16: NV / 2 64-byte
// loads, each split into its even and odd elements by a shift and a mask (no cross-lane
// shuffle: the widening load that keeps the order is a shuffle-port uop per 16 values, and that
// port was the kernel's bottleneck), so vector 2j holds the even elements of 32j..32j+31 and
// vector 2j+1 the odd ones (see row_pos); float32: elements 16c..16c+15 in vector c.
// int8 (kind 2): the codes widened in order (elements 16c..16c+15), not yet scaled.
template <int BF16, int NV>
inline void load_row_v(const char* p, __m512 (&r)[NV]) {
  if constexpr (BF16 == kKvInt8) {  // the widening loads take their 16 bytes from memory
    const __m128i* q = reinterpret_cast<const __m128i*>(p);
    for (int c = 0; c < NV; ++c) r[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + c)));
  } else if constexpr (BF16 != 0) {
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int j = 0; j < NV / 2; ++j) {
      const __m512i a = _mm512_loadu_si512(p + 64 * j);
      r[2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
      r[2 * j + 1] = _mm512_castsi512_ps(_mm512_and_si512(a, hi));
    }
  } else {
    const float* f = reinterpret_cast<const float*>(p);
    for (int c = 0; c < NV; ++c) r[c] = _mm512_loadu_ps(f + 16 * c);
  }
}

// The row position of lane i of vector c as load_row_v lays a row out.
template <int BF16>
constexpr int row_pos(int c, int i) {
  return BF16 == kKvBF16 ? (c / 2) * 32 + 2 * i + (c % 2) : 16 * c + i;
}

// a[g] (+)= the 16 lane products of query head g (qv: 64 of its values in load_row_v's order)
// with the 64 K values at kp, summed over their 4 vectors (the lanes still to be added up);
// ADD: onto a[g] (a later 64-value part of the row), else a[g] is set
template <int G, int BF16, bool ADD>
inline void row_dots(const __m512 (&qv)[G][4], const char* kp, __m512 (&a)[G]) {
  __m512 k[4];
  load_row_v<BF16, 4>(kp, k);
  for (int g = 0; g < G; ++g) {
    __m512 x = ADD ? _mm512_fmadd_ps(qv[g][0], k[0], a[g]) : _mm512_mul_ps(qv[g][0], k[0]);
    for (int c = 1; c < 4; ++c) x = _mm512_fmadd_ps(qv[g][c], k[c], x);
    a[g] = x;
  }
}

// Bytes of one 64-value part of a K or V entry of kind BF16 (the parts of a 128-value entry
// follow one another in load_row_v's order: part p holds vectors 4p..4p+3).
template <int BF16>
constexpr int64_t part_bytes() {
  return BF16 == kKvF32 ? 256 : BF16 == kKvBF16 ? 128 : 64;
}

// The next block of an item (all its heads' entries) prefetched a few lines at a time between
// the dot products of this one: a whole block's ~100 prefetches at once overflow the core's
// outstanding-miss slots, and the ones that do not fit are dropped. Into L2 (T1), which has
// more of those slots than L1, spread evenly over this block: 12-16 GB/s from DRAM with T0
// over the block's first half, 17-25 with this (16-request steps at 256-4096 tokens, Zen 4).
// The scores' last block asks for the values' first one. (An item of one KV head fetches for
// the others too only as head 0, like the old kernel: ``on``.)
struct BlockPrefetch {
  const char* base;
  const int64_t* bt;
  int64_t block_size, tok, vplane, t0, t1;
  bool on;
  const char* pf = nullptr;
  int64_t left = 0;

  // the block after the one holding token t, of the K (plane 0) or V (vplane) entries
  void next_block(int64_t t, int64_t plane) {
    const int64_t nxt = t / block_size + 1;
    if (!on) {
      left = 0;
    } else if (nxt * block_size < t1) {
      left = std::min(block_size, t1 - nxt * block_size) * tok;
      pf = base + plane + bt[nxt] * block_size * tok;
    } else if (plane == 0) {
      const int64_t first = t0 / block_size, off = t0 % block_size;
      left = (std::min(block_size, t1 - first * block_size) - off) * tok;
      pf = base + vplane + (bt[first] * block_size + off) * tok;
    } else {
      left = 0;
    }
  }
  void some(int lines) {
    for (int l = 0; l < lines && left > 0; ++l, pf += 64, left -= 64) _mm_prefetch(pf, _MM_HINT_T1);
  }
  // lines per 4-token step of the scores / per token of the values, so that the next block is
  // asked for over the whole of this one (block_size * tok / 64 lines over
  // nh * block_size / 4 steps, resp. nh * block_size tokens)
  int lines_k(int64_t nh) const { return static_cast<int>(std::max<int64_t>(1, (4 * tok / 64 + nh - 1) / nh)); }
  int lines_v(int64_t nh) const { return static_cast<int>(std::max<int64_t>(1, (tok / 64 + nh - 1) / nh)); }
};

// G and the cache kind are template parameters: the per-head arrays (q, the 4-token partial
// scores, the value accumulators) get compile-time sizes the compiler can keep in zmm
// registers, and load_row_v no kind branch per row. (Templating alone measured no faster
// than the runtime-G kernel; the gains came from hsum4, max16, load_row_v and the prefetch.)
// Addresses are in bytes: a token's K (or V) row of all heads is `tok` bytes, head hk's entry
// starts `hoff` bytes into it, and the V plane `vplane` bytes after the K plane. For int8 the
// per-entry scale multiplies the score (K) and the softmax weight (V, in a pass of its own
// before the weighted sum), not each value.
// Heads [hk0, hk0 + nh) of one request over tokens [t0, t1), G (<= 4) query heads per KV head:
// q rows qh [nh * G, D]; each head's softmax state at st + (head - hk0) * st_stride.
// Block by block, every head's share of a block is done before the next block: a token's K (or
// V) row holds all the heads contiguously, so a block (block_size * tok bytes) is read once,
// whole, and the next block is prefetched while this one is computed. (Head after head over
// the whole range read a third of each row at a stride, and fetched every byte during the first
// head's pass only: 20 GB/s from DRAM in a 16-request step against 54 GB/s cache-resident.)
template <int G, int KIND, int D>
inline void decode_item_t(const float* qh, const char* base, const int64_t* bt,
                              int64_t block_size, int64_t tok, int64_t vplane, int64_t hbytes,
                              int64_t hk0, int64_t nh, int64_t t0, int64_t t1, float scale,
                              float* st, int64_t st_stride) {
  constexpr int NV = D / 16;  // vectors per row
  // A row is done in 64-value parts of 4 vectors: at D = 128 the q rows, the accumulators and
  // a whole row of G <= 4 heads would need up to 72 of the 32 vector registers, and the
  // spills doubled the time (a part's K or V is read again from L1, not memory).
  constexpr int NP = D / 64;
  constexpr int64_t PB = part_bytes<KIND>();
  const int64_t len = t1 - t0, R = nh * G;  // query rows
  thread_local std::vector<float> buf;
  buf.resize(R * len + 2 * R * D);
  float* sc = buf.data();       // scores, then weights [R, len]
  float* qp = sc + R * len;     // q rows in load_row_v's order (a dot product needs no reordering)
  float* accp = qp + R * D;     // weighted values [R, D], same order
  for (int64_t r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c)
      for (int i = 0; i < 16; ++i) qp[r * D + 16 * c + i] = qh[r * D + row_pos<KIND>(c, i)];
  const char* hb = base + hk0 * hbytes;  // head hk0's entry of token 0 of block 0
  BlockPrefetch pfb{base, bt, block_size, tok, vplane, t0, t1, nh > 1 || hk0 == 0};
  auto next_block = [&](int64_t t, int64_t plane) { pfb.next_block(t, plane); };
  auto prefetch_some = [&](int lines) { pfb.some(lines); };
  const int pf_k = pfb.lines_k(nh), pf_v = pfb.lines_v(nh);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t = t0; t < t1;) {  // scores, block by block (no division per token)
    const int64_t off = t % block_size, n = std::min(block_size - off, t1 - t);
    const char* kb = hb + (bt[t / block_size] * block_size + off) * tok;
    next_block(t, 0);
    for (int64_t h = 0; h < nh; ++h) {
      __m512 qv[G][4];  // part p of each q row (D = 64: loaded once here)
      auto load_q = [&](int p) {
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < 4; ++c)
            qv[g][c] = _mm512_loadu_ps(qp + (h * G + g) * D + 64 * p + 16 * c);
      };
      if constexpr (NP == 1) load_q(0);
      float* sh = sc + h * G * len + (t - t0);
      const char* kp = kb + h * hbytes;
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) {  // 4 tokens: their 4 x G dot products summed jointly
        prefetch_some(pf_k);
        __m512 a[4][G];
        __m128 ks = _mm512_castps512_ps128(vscale);
        if constexpr (KIND == kKvInt8)
          ks = _mm_mul_ps(ks, _mm_setr_ps(kv_scale(kp, D), kv_scale(kp + tok, D),
                                          kv_scale(kp + 2 * tok, D), kv_scale(kp + 3 * tok, D)));
        if constexpr (NP > 1) load_q(0);
        for (int u = 0; u < 4; ++u) row_dots<G, KIND, false>(qv, kp + u * tok, a[u]);
        for (int p = 1; p < NP; ++p) {
          load_q(p);
          for (int u = 0; u < 4; ++u) row_dots<G, KIND, true>(qv, kp + u * tok + p * PB, a[u]);
        }
        kp += 4 * tok;
        for (int g = 0; g < G; ++g)
          _mm_storeu_ps(sh + g * len + j, _mm_mul_ps(hsum4(a[0][g], a[1][g], a[2][g], a[3][g]), ks));
      }
      for (; j < n; ++j, kp += tok) {
        __m512 a[G];
        if constexpr (NP > 1) load_q(0);
        row_dots<G, KIND, false>(qv, kp, a);
        for (int p = 1; p < NP; ++p) {
          load_q(p);
          row_dots<G, KIND, true>(qv, kp + p * PB, a);
        }
        const float ks = KIND == kKvInt8 ? scale * kv_scale(kp, D) : scale;
        for (int g = 0; g < G; ++g) sh[g * len + j] = _mm512_reduce_add_ps(a[g]) * ks;
      }
    }
    t += n;
  }
  for (int64_t r = 0; r < R; ++r) {
    float* sr = sc + r * len;
    float* sth = st + (r / G) * st_stride;
    const float mx = max16(sr, len);
    sth[r % G] = mx;
    sth[G + r % G] = exp_sub_sum(sr, len, mx);
  }
  if constexpr (KIND == kKvInt8) {  // each weight times its V entry's scale, once per token
    for (int64_t t = t0; t < t1;) {
      const int64_t off = t % block_size, n = std::min(block_size - off, t1 - t);
      const char* vb = hb + vplane + (bt[t / block_size] * block_size + off) * tok;
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t j = 0; j < n; ++j) {
          const float vs = kv_scale(vb + h * hbytes + j * tok, D);
          for (int g = 0; g < G; ++g) sc[(h * G + g) * len + (t - t0) + j] *= vs;
        }
      t += n;
    }
  }
  for (int64_t i = 0; i < R * D; ++i) accp[i] = 0.f;
  for (int64_t t = t0; t < t1;) {  // weighted values, block by block
    const int64_t off = t % block_size, n = std::min(block_size - off, t1 - t);
    const char* vb = hb + vplane + (bt[t / block_size] * block_size + off) * tok;
    next_block(t, vplane);
    for (int64_t h = 0; h < nh; ++h)
      for (int part = 0; part < NP; ++part) {  // each part's tokens again (from L1 after the first)
        float* ap = accp + h * G * D + 64 * part;
        __m512 acc[G][4];
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_loadu_ps(ap + g * D + 16 * c);
        const float* wh = sc + h * G * len + (t - t0);
        const char* vp = vb + h * hbytes + part * PB;
        for (int64_t j = 0; j < n; ++j, vp += tok) {
          if (part == 0) prefetch_some(pf_v);
          __m512 v[4];
          load_row_v<KIND, 4>(vp, v);
          for (int g = 0; g < G; ++g) {
            const __m512 p = _mm512_set1_ps(wh[g * len + j]);
            for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
          }
        }
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < 4; ++c) _mm512_storeu_ps(ap + g * D + 16 * c, acc[g][c]);
      }
    t += n;
  }
  for (int64_t r = 0; r < R; ++r) {  // back to the row's order
    float* o = st + (r / G) * st_stride + 2 * G + (r % G) * D;
    for (int c = 0; c < NV; ++c)
      for (int i = 0; i < 16; ++i) o[row_pos<KIND>(c, i)] = accp[r * D + 16 * c + i];
  }
}

template <int G, int D>
inline void decode_item_g(const float* qh, const char* base, int kind, const int64_t* bt,
                          int64_t block_size, int64_t tok, int64_t vplane, int64_t hbytes,
                          int64_t hk0, int64_t nh, int64_t t0, int64_t t1, float scale,
                          float* st, int64_t st_stride) {
  if (kind == kKvBF16)
    decode_item_t<G, kKvBF16, D>(qh, base, bt, block_size, tok, vplane, hbytes, hk0, nh, t0, t1, scale, st, st_stride);
  else if (kind == kKvInt8)
    decode_item_t<G, kKvInt8, D>(qh, base, bt, block_size, tok, vplane, hbytes, hk0, nh, t0, t1, scale, st, st_stride);
  else
    decode_item_t<G, kKvF32, D>(qh, base, bt, block_size, tok, vplane, hbytes, hk0, nh, t0, t1, scale, st, st_stride);
}

template <int D>
inline void decode_item_d(const float* qh, const char* base, int kind, const int64_t* bt,
                          int64_t block_size, int64_t tok, int64_t vplane, int64_t hbytes,
                          int64_t hk0, int64_t nh, int64_t G, int64_t t0, int64_t t1,
                          float scale, float* st, int64_t st_stride) {
  switch (G) {
    case 1: return decode_item_g<1, D>(qh, base, kind, bt, block_size, tok, vplane, hbytes, hk0, nh, t0, t1, scale, st, st_stride);
    case 2: return decode_item_g<2, D>(qh, base, kind, bt, block_size, tok, vplane, hbytes, hk0, nh, t0, t1, scale, st, st_stride);
    case 3: return decode_item_g<3, D>(qh, base, kind, bt, block_size, tok, vplane, hbytes, hk0, nh, t0, t1, scale, st, st_stride);
    default: return decode_item_g<4, D>(qh, base, kind, bt, block_size, tok, vplane, hbytes, hk0, nh, t0, t1, scale, st, st_stride);
  }
}

// One work item of the decode kernel for head_dim D (64 or 128) on AVX-512: KV heads
// [hk0, hk0 + nh) with their G (<= 4) query heads each, over tokens [t0, t1) (decode_item_t).
inline void decode_item(const float* qh, const char* base, int kind, const int64_t* bt,
                        int64_t block_size, int64_t tok, int64_t vplane, int64_t hbytes,
                        int64_t hk0, int64_t nh, int64_t G, int64_t D, int64_t t0, int64_t t1,
                        float scale, float* st, int64_t st_stride) {
  if (D == 64) decode_item_d<64>(qh, base, kind, bt, block_size, tok, vplane, hbytes, hk0, nh, G, t0, t1, scale, st, st_stride);
  else decode_item_d<128>(qh, base, kind, bt, block_size, tok, vplane, hbytes, hk0, nh, G, t0, t1, scale, st, st_stride);
}
#endif

// Work items are (request, KV head, split of the context); a context longer than split_len
// is cut into splits whose partial softmax states are merged by log-sum-exp afterwards
// (FlashDecoding), so a small batch with a long context still uses every thread.
// work: scratch of B * Hkv * max_splits * G * (D + 2) floats.
void paged_attn_decode(const float* q, int64_t q_stride, const void* cache, int kind,
                       const int64_t* block_table, int64_t max_blocks, const int64_t* seq_lens,
                       int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                       int64_t num_blocks, float scale, int64_t split_len, int64_t max_splits,
                       float* out, float* work) {
  const int64_t G = H / Hkv;
  const int64_t hbytes = kv_head_bytes(kind, D);
  const int64_t tok = Hkv * hbytes;                  // one token's K (or V) for all heads, bytes
  const int64_t vplane = num_blocks * block_size * tok;
  const int64_t item_floats = G * (D + 2);
  const int64_t items = B * Hkv * max_splits;
  // KV head hk of request b over tokens [t0, t1), its state at st: the portable path
  auto one_head = [&](int64_t b, int64_t hk, int64_t t0, int64_t t1, float* st) {
    thread_local std::vector<float> sc;  // scores of one split, [G, len]
    thread_local std::vector<float> kv;  // one K or V row in float32
    const int64_t len = t1 - t0;
    sc.resize(G * len);
    kv.resize(D);
    float* kr = kv.data();
    float* scp = sc.data();  // plain pointers: a thread_local is looked up on every use
    const float* qh = q + b * q_stride + hk * G * D;
    const int64_t* bt = block_table + b * max_blocks;
    const char* base = static_cast<const char*>(cache);
    // scores, block by block (the tokens of a block are contiguous rows of the cache)
    for (int64_t t = t0; t < t1;) {
      const int64_t blk = t / block_size, off = t % block_size;
      const int64_t n = std::min(block_size - off, t1 - t);
      const char* src = base + (bt[blk] * block_size + off) * tok + hk * hbytes;
      for (int64_t j = 0; j < n; ++j, ++t) {
        load_row(src + j * tok, kind, kr, D);
        for (int64_t g = 0; g < G; ++g) scp[g * len + (t - t0)] = dot(qh + g * D, kr, D) * scale;
      }
    }
    for (int64_t g = 0; g < G; ++g) {  // softmax state of this split
      float* sg = scp + g * len;
      float mx = -INFINITY;
      for (int64_t j = 0; j < len; ++j) mx = std::max(mx, sg[j]);
      st[g] = mx;
      st[G + g] = exp_sub_sum(sg, len, mx);  // sg[j] = exp(sg[j] - mx), returns the sum
      float* acc = st + 2 * G + g * D;
      for (int64_t i = 0; i < D; ++i) acc[i] = 0.f;
    }
    for (int64_t t = t0; t < t1;) {  // weighted values
      const int64_t blk = t / block_size, off = t % block_size;
      const int64_t n = std::min(block_size - off, t1 - t);
      const char* src = base + vplane + (bt[blk] * block_size + off) * tok + hk * hbytes;
      for (int64_t j = 0; j < n; ++j, ++t) {
        load_row(src + j * tok, kind, kr, D);
        for (int64_t g = 0; g < G; ++g) axpy(scp[g * len + (t - t0)], kr, st + 2 * G + g * D, D);
      }
    }
  };
  // One work item: KV heads [hk0, hk0 + nh) of request b, split sp. Head hk's softmax state
  // ([G] max, [G] sum, [G, D] acc) is at work + ((b * Hkv + hk) * max_splits + sp) * item_floats.
  auto heads = [&](int64_t b, int64_t hk0, int64_t nh, int64_t sp) {
    const int64_t t0 = sp * split_len, t1 = std::min(seq_lens[b], t0 + split_len);
    const int64_t st_stride = max_splits * item_floats;
    float* st = work + ((b * Hkv + hk0) * max_splits + sp) * item_floats;
    if (t0 >= t1) {
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t g = 0; g < G; ++g) {
          st[h * st_stride + g] = -INFINITY;
          st[h * st_stride + G + g] = 0.f;
        }
      return;
    }
#if SL_ISA == 2
    if ((D == 64 || D == 128) && G <= 4) {
      decode_item(q + b * q_stride + hk0 * G * D, static_cast<const char*>(cache), kind,
                  block_table + b * max_blocks, block_size, tok, vplane, hbytes, hk0, nh, G, D,
                  t0, t1, scale, st, st_stride);
      return;
    }
#endif
    for (int64_t h = 0; h < nh; ++h) one_head(b, hk0 + h, t0, t1, st + h * st_stride);
  };
  // A work item is one split of one request with all its KV heads (on AVX-512 with D = 64 or
  // 128 block by block, see decode_item_t; else one head after the other): a token's K (or V) row
  // holds every head (Hkv * D contiguous values), so the heads of a split read the same cache
  // lines and the hardware prefetcher streams whole rows. One item per
  // (request, KV head, split) read a third of each row at a stride and ran at ~7 GB/s from
  // DRAM in a 16-request decode step (vs ~20 GB/s streaming). With too few such items to
  // keep every thread busy (a short batch), an item is one KV head again.
  auto body = [&](int64_t bs_it) { heads(bs_it / max_splits, 0, Hkv, bs_it % max_splits); };
  auto one = [&](int64_t it) {
    heads(it / (Hkv * max_splits), (it / max_splits) % Hkv, 1, it % max_splits);
  };
  if (B * max_splits >= 2 * nthreads()) parallel_for(B * max_splits, body);
  else parallel_for(items, one);
  // merge the splits: o = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hk = 0; hk < Hkv; ++hk)
      for (int64_t g = 0; g < G; ++g) {
        const float* bs = work + (b * Hkv + hk) * max_splits * item_floats;
        float M = -INFINITY;
        for (int64_t s = 0; s < max_splits; ++s) M = std::max(M, bs[s * item_floats + g]);
        float* o = out + (b * H + hk * G + g) * D;
        for (int64_t i = 0; i < D; ++i) o[i] = 0.f;
        float den = 0.f;
        for (int64_t s = 0; s < max_splits; ++s) {
          const float* stt = bs + s * item_floats;
          if (stt[G + g] == 0.f) continue;
          const float f = std::exp(stt[g] - M);
          den += f * stt[G + g];
          axpy(f, stt + 2 * G + g * D, o, D);
        }
        const float inv = den > 0.f ? 1.f / den : 0.f;
        for (int64_t i = 0; i < D; ++i) o[i] *= inv;
      }
}

}  // namespace
