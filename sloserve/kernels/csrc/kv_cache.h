// sloserve CPU kernels: the paged KV cache's entry formats, reading an entry back as float32
// (load_row), and writing the step's K and V into the cache (sl_cache_write).
//
// One layer's cache is [2 (K, V), num_blocks, block_size, Hkv, entry]; slot = block * block_size
// + offset. Its kind (kv_kind): float32, bf16, or int8 codes + a float32 scale per entry
// (kv_head_bytes; sloserve/model/attention/kv_int8.py computes the same codes with torch).
#pragma once

#include "common.h"

namespace {

// KV cache kinds (the `kv_kind` argument of the attention kernels): a head's entry of a token
// is D float32 values, D bf16 values, or D int8 codes followed by their float32 scale (value =
// code * scale; the scale is the entry's largest |value| / 127, see kv_quantize).
constexpr int kKvF32 = 0, kKvBF16 = 1, kKvInt8 = 2;

// Bytes of one head's entry of one token in a cache of this kind.
inline int64_t kv_head_bytes(int kind, int64_t D) {
  return kind == kKvInt8 ? D + 4 : kind == kKvBF16 ? 2 * D : 4 * D;
}

inline float kv_scale(const char* entry, int64_t D) {
  float s;
  std::memcpy(&s, entry + D, sizeof(float));
  return s;
}

// dst[0..n) = a head's entry of the cache in float32 (bf16 widened by a shift, int8 codes
// times their scale, or copied)
inline void load_row(const void* src, int kind, float* dst, int64_t n) {
  if (kind == kKvInt8) {
    const int8_t* c = static_cast<const int8_t*>(src);
    const float s = kv_scale(static_cast<const char*>(src), n);
    for (int64_t i = 0; i < n; ++i) dst[i] = float(c[i]) * s;
    return;
  }
  if (kind == kKvF32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  const uint16_t* s = static_cast<const uint16_t*>(src);
  int64_t i = 0;
#if SL_ISA == 2
  for (; i + 16 <= n; i += 16) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
  }
#elif SL_ISA == 1
  for (; i + 8 <= n; i += 8) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
}

// One head's entry of D float32 values as int8 codes and a float32 scale (kind 2): scale =
// max |x| / 127, code = x / scale rounded to nearest even (|code| <= 127), written D codes
// then the scale's 4 bytes. An all-zero entry gets scale 0; an entry holding a NaN gets scale
// NaN (reading it back gives NaN, as a float cache would). sloserve/model/attention/kv_int8.py
// computes the same codes with torch (the reference backend and the tests).
inline void kv_quantize(const float* x, int64_t D, char* dst) {
  float amax = 0.f;
  bool nan = false;
  for (int64_t i = 0; i < D; ++i) {
    nan |= std::isnan(x[i]);
    amax = std::max(amax, std::fabs(x[i]));
  }
  const float s = nan ? NAN : amax / 127.f;
  int8_t* c = reinterpret_cast<int8_t*>(dst);
  for (int64_t i = 0; i < D; ++i) {
    float r = s > 0.f ? std::nearbyint(x[i] / s) : 0.f;
    r = std::min(127.f, std::max(-127.f, r));
    c[i] = static_cast<int8_t>(r);
  }
  std::memcpy(dst + D, &s, sizeof(float));
}

// K and V of the step into the cache at their slots; see sl_cache_write.
void cache_write(const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                 void* cache, int kind, const int64_t* slots, int64_t T, int64_t num_slots,
                 int64_t Hkv, int64_t D) {
  const int64_t row = Hkv * D, tok = Hkv * kv_head_bytes(kind, D);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slots[t];
    char* kb = static_cast<char*>(cache) + s * tok;
    char* vb = kb + num_slots * tok;
    if (kind == kKvInt8) {
      for (int64_t h = 0; h < Hkv; ++h) {
        kv_quantize(k + t * k_stride + h * D, D, kb + h * (D + 4));
        kv_quantize(v + t * v_stride + h * D, D, vb + h * (D + 4));
      }
    } else if (kind == kKvBF16) {
      uint16_t* kc = reinterpret_cast<uint16_t*>(kb);
      uint16_t* vc = reinterpret_cast<uint16_t*>(vb);
      for (int64_t i = 0; i < row; ++i) {
        kc[i] = f32_to_bf16(k[t * k_stride + i]);
        vc[i] = f32_to_bf16(v[t * v_stride + i]);
      }
    } else {
      std::memcpy(kb, k + t * k_stride, row * sizeof(float));
      std::memcpy(vb, v + t * v_stride, row * sizeof(float));
    }
  }
}

}  // namespace
