// sloserve CPU kernels: weight-only quantized linear layers, fused elementwise ops and paged
// decode attention, for the memory-bound steps (decode, small batches) of the engine.
//
// One source, compiled once per instruction set by sloserve/kernels/build.py:
//   avx512: -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c   (16-lane float vectors)
//   avx2:   -mavx2 -mfma -mf16c                                        (8-lane float vectors)
//   generic: plain C++ (the compiler's own vectorization)
// The Python side (sloserve/kernels/__init__.py) picks the library for the CPU it runs on and
// calls these functions through ctypes with raw pointers of contiguous torch tensors.
//
// Threading: a small pool of our own (not OpenMP). A product is split into many small work
// items that threads claim from an atomic counter; the caller works too and returns as soon as
// every item is done, without waiting for a worker that never woke up. So a thread the OS
// deschedules (the API process or a benchmark client on the same two cores) slows the product
// down by its share only, where a static split with a join barrier (OpenMP, torch's
// parallel_for) makes every other thread wait for it.
//
// Weight format (QuantizedWeight in sloserve/model/quant.py): W[n, k] = d[n, g] * q[n, k] +
// m[n, g], g = k / gs, per group of gs consecutive inputs:
//   bits 4, gs 32: q in 0..15, packed 16 bytes per group, byte j = q[j] | q[j + 16] << 4
//                  (GGUF's Q4_0/Q4_1 order; Q4_K is repacked into it at load);
//   bits 8, gs 32 or 16: q int8, one byte each.
// Activations are float32; accumulation is float32 (the weights are exact dequantized values,
// the activations are not requantized).
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
#include <immintrin.h>
#define SL_ISA 2
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SL_ISA 1
#else
#define SL_ISA 0
#endif

namespace {

// ------------------------------------------------------------------------------ thread pool
// run(total, fn, ctx): fn(ctx, i) for every i in [0, total), on the caller and the workers.
// The job's generation sits in the high 32 bits of the claim counter, so a worker that read an
// old job can never claim an item of a newer one.
class Pool {
 public:
  using Fn = void (*)(void*, int64_t);

  void resize(int nthreads) {
    stop_workers();
    stop_ = false;
    for (int i = 1; i < nthreads; ++i) workers_.emplace_back([this] { loop(); });
  }
  int size() const { return static_cast<int>(workers_.size()) + 1; }
  ~Pool() { stop_workers(); }

  void run(int64_t total, Fn fn, void* ctx) {
    if (total <= 0) return;
    if (workers_.empty() || total == 1) {
      for (int64_t i = 0; i < total; ++i) fn(ctx, i);
      return;
    }
    const uint64_t g = (gen_.load(std::memory_order_relaxed) + 1) & 0xffffffffu;
    fn_ = fn;
    ctx_ = ctx;
    total_ = total;
    done_.store(0, std::memory_order_relaxed);
    next_.store(g << 32, std::memory_order_relaxed);
    gen_.store(g, std::memory_order_release);
    if (sleeping_.load(std::memory_order_acquire) > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    work(g);
    while (done_.load(std::memory_order_acquire) < total) {
#if SL_ISA > 0
      _mm_pause();
#endif
    }
  }

 private:
  void work(uint64_t g) {
    for (;;) {
      uint64_t v = next_.load(std::memory_order_acquire);
      if ((v >> 32) != g || static_cast<int64_t>(v & 0xffffffffu) >= total_) return;
      if (!next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) continue;
      fn_(ctx_, static_cast<int64_t>(v & 0xffffffffu));
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void loop() {
    uint64_t seen = gen_.load(std::memory_order_acquire);
    for (;;) {
      // spin a little (the next product of a step comes within microseconds), then sleep
      auto t0 = std::chrono::steady_clock::now();
      uint64_t g = seen;
      while ((g = gen_.load(std::memory_order_acquire)) == seen && !stop_) {
#if SL_ISA > 0
        _mm_pause();
#endif
        if (std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(200)) {
          std::unique_lock<std::mutex> lk(mu_);
          sleeping_.fetch_add(1, std::memory_order_acq_rel);
          cv_.wait(lk, [&] { return gen_.load(std::memory_order_acquire) != seen || stop_; });
          sleeping_.fetch_sub(1, std::memory_order_acq_rel);
        }
      }
      if (stop_) return;
      seen = g;
      work(g);
    }
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  std::vector<std::thread> workers_;
  std::atomic<uint64_t> gen_{0}, next_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
  Fn fn_ = nullptr;
  void* ctx_ = nullptr;
  int64_t total_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
};

Pool& pool() {
  static Pool p;
  return p;
}

template <class F>
void parallel_for(int64_t total, F& f) {
  pool().run(total, [](void* c, int64_t i) { (*static_cast<F*>(c))(i); }, &f);
}

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
#elif SL_ISA == 1
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
#endif

// Rows of the activation matrix processed together per pass over a weight row.
#if SL_ISA == 2
constexpr int kMB = 8;
#else
constexpr int kMB = 4;
#endif

// ------------------------------------------------------------------ dot of one weight group
// acc[mi] += d * sum_{j<gs} q[j] * x_mi[j]   for the mcount activation rows x_mi (stride K)

template <int BITS, int GS>
struct Group;

#if SL_ISA == 2
template <>
struct Group<4, 32> {
  static inline void run(const uint8_t* w, float d, const float* x, int64_t K, int mcount,
                         __m512* acc) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
    __m512 dv = _mm512_set1_ps(d);
    for (int mi = 0; mi < mcount; ++mi) {
      const float* xr = x + mi * K;
      __m512 t = _mm512_mul_ps(lo, _mm512_loadu_ps(xr));
      t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), t);
      acc[mi] = _mm512_fmadd_ps(t, dv, acc[mi]);
    }
  }
};
template <>
struct Group<8, 32> {
  static inline void run(const uint8_t* w, float d, const float* x, int64_t K, int mcount,
                         __m512* acc) {
    const __m128i* p = reinterpret_cast<const __m128i*>(w);
    __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
    __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
    __m512 dv = _mm512_set1_ps(d);
    for (int mi = 0; mi < mcount; ++mi) {
      const float* xr = x + mi * K;
      __m512 t = _mm512_mul_ps(w0, _mm512_loadu_ps(xr));
      t = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), t);
      acc[mi] = _mm512_fmadd_ps(t, dv, acc[mi]);
    }
  }
};
template <>
struct Group<8, 16> {
  static inline void run(const uint8_t* w, float d, const float* x, int64_t K, int mcount,
                         __m512* acc) {
    __m512 w0 = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
    __m512 dv = _mm512_set1_ps(d);
    for (int mi = 0; mi < mcount; ++mi) {
      __m512 t = _mm512_mul_ps(w0, _mm512_loadu_ps(x + mi * K));
      acc[mi] = _mm512_fmadd_ps(t, dv, acc[mi]);
    }
  }
};
using Acc = __m512;
inline Acc acc_zero() { return _mm512_setzero_ps(); }
#elif SL_ISA == 1
inline __m256 cvt_u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 cvt_i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
template <>
struct Group<4, 32> {
  static inline void run(const uint8_t* w, float d, const float* x, int64_t K, int mcount,
                         __m256* acc) {
    const __m256i mask = _mm256_set1_epi32(15);
    __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
    __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8)));
    __m256 lo0 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, mask));   // weights 0..7
    __m256 lo1 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask));   // 8..15
    __m256 hi0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));     // 16..23
    __m256 hi1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));     // 24..31
    __m256 dv = _mm256_set1_ps(d);
    for (int mi = 0; mi < mcount; ++mi) {
      const float* xr = x + mi * K;
      __m256 t = _mm256_mul_ps(lo0, _mm256_loadu_ps(xr));
      t = _mm256_fmadd_ps(lo1, _mm256_loadu_ps(xr + 8), t);
      t = _mm256_fmadd_ps(hi0, _mm256_loadu_ps(xr + 16), t);
      t = _mm256_fmadd_ps(hi1, _mm256_loadu_ps(xr + 24), t);
      acc[mi] = _mm256_fmadd_ps(t, dv, acc[mi]);
    }
  }
};
template <>
struct Group<8, 32> {
  static inline void run(const uint8_t* w, float d, const float* x, int64_t K, int mcount,
                         __m256* acc) {
    __m256 w0 = cvt_i8x8(w), w1 = cvt_i8x8(w + 8), w2 = cvt_i8x8(w + 16), w3 = cvt_i8x8(w + 24);
    __m256 dv = _mm256_set1_ps(d);
    for (int mi = 0; mi < mcount; ++mi) {
      const float* xr = x + mi * K;
      __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(xr));
      t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), t);
      t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), t);
      t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), t);
      acc[mi] = _mm256_fmadd_ps(t, dv, acc[mi]);
    }
  }
};
template <>
struct Group<8, 16> {
  static inline void run(const uint8_t* w, float d, const float* x, int64_t K, int mcount,
                         __m256* acc) {
    __m256 w0 = cvt_i8x8(w), w1 = cvt_i8x8(w + 8);
    __m256 dv = _mm256_set1_ps(d);
    for (int mi = 0; mi < mcount; ++mi) {
      const float* xr = x + mi * K;
      __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(xr));
      t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), t);
      acc[mi] = _mm256_fmadd_ps(t, dv, acc[mi]);
    }
  }
};
using Acc = __m256;
inline Acc acc_zero() { return _mm256_setzero_ps(); }
#else
struct Acc { float v; };
inline Acc acc_zero() { return Acc{0.f}; }
inline float hsum(Acc a) { return a.v; }
template <>
struct Group<4, 32> {
  static inline void run(const uint8_t* w, float d, const float* x, int64_t K, int mcount,
                         Acc* acc) {
    float lo[16], hi[16];
    for (int j = 0; j < 16; ++j) { lo[j] = float(w[j] & 15); hi[j] = float(w[j] >> 4); }
    for (int mi = 0; mi < mcount; ++mi) {
      const float* xr = x + mi * K;
      float t = 0.f;
      for (int j = 0; j < 16; ++j) t += lo[j] * xr[j] + hi[j] * xr[j + 16];
      acc[mi].v += d * t;
    }
  }
};
template <int GS>
struct Group8 {
  static inline void run(const uint8_t* w, float d, const float* x, int64_t K, int mcount,
                         Acc* acc) {
    const int8_t* q = reinterpret_cast<const int8_t*>(w);
    for (int mi = 0; mi < mcount; ++mi) {
      const float* xr = x + mi * K;
      float t = 0.f;
      for (int j = 0; j < GS; ++j) t += float(q[j]) * xr[j];
      acc[mi].v += d * t;
    }
  }
};
template <>
struct Group<8, 32> : Group8<32> {};
template <>
struct Group<8, 16> : Group8<16> {};
#endif

// y[m, n] = sum_k x[m, k] W[n, k] for rows n in [n0, n1) and all M rows of x.
template <int BITS, int GS>
void qlinear_rows(const float* x, int64_t M, int64_t K, const uint8_t* qw, const float* d,
                  const float* mn, const float* xsum, int64_t N, int64_t n0, int64_t n1,
                  float* y) {
  const int64_t G = K / GS;
  const int64_t row_bytes = K * BITS / 8;
  const int64_t group_bytes = GS * BITS / 8;
  Acc acc[kMB];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = qw + n * row_bytes;
    const float* dr = d + n * G;
    const float* mr = mn ? mn + n * G : nullptr;
    for (int64_t mb = 0; mb < M; mb += kMB) {
      const int mcount = static_cast<int>(std::min<int64_t>(kMB, M - mb));
      for (int mi = 0; mi < mcount; ++mi) acc[mi] = acc_zero();
      const float* xb = x + mb * K;
      for (int64_t g = 0; g < G; ++g)
        Group<BITS, GS>::run(wr + g * group_bytes, dr[g], xb + g * GS, K, mcount, acc);
      for (int mi = 0; mi < mcount; ++mi) {
        float s = hsum(acc[mi]);
        if (mr) {  // the offsets: sum_g m[n, g] * sum_{k in g} x[m, k]
          const float* xs = xsum + (mb + mi) * G;
          for (int64_t g = 0; g < G; ++g) s += mr[g] * xs[g];
        }
        y[(mb + mi) * N + n] = s;
      }
    }
  }
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
  const int64_t nt = pool().size();
  const int64_t chunk = std::max<int64_t>(8, std::min<int64_t>(64, N / (8 * nt)));
  const int64_t nchunks = (N + chunk - 1) / chunk;
  auto body = [&](int64_t c) {
    const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk);
    qlinear_rows<BITS, GS>(x, M, K, qw, d, mn, xsum, N, n0, n1, y);
  };
  parallel_for(nchunks, body);
}

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

}  // namespace

extern "C" {

// Which instruction set this library was built for: 2 AVX-512, 1 AVX2/FMA, 0 generic.
int sl_isa() { return SL_ISA; }

int sl_num_threads() { return pool().size(); }

void sl_set_num_threads(int n) { pool().resize(std::max(1, n)); }

// y [M, N] = x [M, K] @ W^T with W quantized (see the header). xsum: scratch of M * K / gs
// floats (used when mn is not null). Returns 0, or -1 for an unsupported (bits, gs).
int sl_qlinear(const float* x, int64_t M, int64_t K, const uint8_t* qw, const float* d,
               const float* mn, int bits, int gs, int64_t N, float* y, float* xsum) {
  if (bits == 4 && gs == 32) qlinear_t<4, 32>(x, M, K, qw, d, mn, N, y, xsum);
  else if (bits == 8 && gs == 32) qlinear_t<8, 32>(x, M, K, qw, d, mn, N, y, xsum);
  else if (bits == 8 && gs == 16) qlinear_t<8, 16>(x, M, K, qw, d, mn, N, y, xsum);
  else return -1;
  return 0;
}

// out [T, K] = rows ids[0..T) of the quantized matrix, dequantized (an embedding lookup).
int sl_qembed(const int64_t* ids, int64_t T, const uint8_t* qw, const float* d, const float* mn,
              int bits, int gs, int64_t K, float* out) {
  if (!((bits == 4 && gs == 32) || (bits == 8 && (gs == 32 || gs == 16)))) return -1;
  const int64_t G = K / gs, row_bytes = K * bits / 8;
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
  return 0;
}

// out = rmsnorm(x) * w; x, out [T, D] float32 (out may alias x).
void sl_rms_norm(const float* x, const float* w, int64_t T, int64_t D, float eps, float* out) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * D;
    float ss = 0.f;
    for (int64_t i = 0; i < D; ++i) ss += xr[i] * xr[i];
    const float r = 1.f / std::sqrt(ss / float(D) + eps);
    float* o = out + t * D;
    for (int64_t i = 0; i < D; ++i) o[i] = xr[i] * r * w[i];
  }
}

// h += delta (the residual stream, in place), then out = rmsnorm(h) * w. [T, D] float32.
void sl_add_rms_norm(float* h, const float* delta, const float* w, int64_t T, int64_t D,
                     float eps, float* out) {
  for (int64_t t = 0; t < T; ++t) {
    float* hr = h + t * D;
    const float* dr = delta + t * D;
    float ss = 0.f;
    for (int64_t i = 0; i < D; ++i) {
      hr[i] += dr[i];
      ss += hr[i] * hr[i];
    }
    const float r = 1.f / std::sqrt(ss / float(D) + eps);
    float* o = out + t * D;
    for (int64_t i = 0; i < D; ++i) o[i] = hr[i] * r * w[i];
  }
}

// out [T, F] = silu(gu[:, :F]) * gu[:, F:]   (gu [T, 2F]: gate then up, as the fused weight).
void sl_silu_mul(const float* gu, int64_t T, int64_t F, float* out) {
  for (int64_t t = 0; t < T; ++t) {
    const float* g = gu + t * 2 * F;
    const float* u = g + F;
    float* o = out + t * F;
    for (int64_t i = 0; i < F; ++i) o[i] = silu(g[i]) * u[i];
  }
}

// RoPE in place (Hugging Face rotate_half layout): q [T, Hq, D], k [T, Hk, D] float32 with
// row strides q_stride / k_stride (floats between tokens); angle = pos[t] * inv_freq[i] in
// float32, as transformers computes it.
void sl_rope(float* q, int64_t q_stride, float* k, int64_t k_stride, const int64_t* pos,
             const float* inv_freq, int64_t T, int64_t Hq, int64_t Hk, int64_t D) {
  const int64_t half = D / 2;
  std::vector<float> c(half), s(half);
  for (int64_t t = 0; t < T; ++t) {
    const float p = float(pos[t]);
    for (int64_t i = 0; i < half; ++i) {
      const float a = p * inv_freq[i];
      c[i] = std::cos(a);
      s[i] = std::sin(a);
    }
    for (int64_t h = 0; h < Hq + Hk; ++h) {
      float* v = h < Hq ? q + t * q_stride + h * D : k + t * k_stride + (h - Hq) * D;
      for (int64_t i = 0; i < half; ++i) {
        const float x0 = v[i], x1 = v[i + half];
        v[i] = x0 * c[i] - x1 * s[i];
        v[i + half] = x1 * c[i] + x0 * s[i];
      }
    }
  }
}

// Write the step's K and V (float32 [T, Hkv, D] with token strides) into one layer's paged
// cache [2, num_blocks, block_size, Hkv, D] (bf16 when kv_bf16, else float32) at slot_mapping.
void sl_cache_write(const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                    void* cache, int kv_bf16, const int64_t* slots, int64_t T, int64_t num_slots,
                    int64_t row) {
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slots[t];
    if (kv_bf16) {
      uint16_t* kc = static_cast<uint16_t*>(cache) + s * row;
      uint16_t* vc = kc + num_slots * row;
      for (int64_t i = 0; i < row; ++i) {
        kc[i] = f32_to_bf16(k[t * k_stride + i]);
        vc[i] = f32_to_bf16(v[t * v_stride + i]);
      }
    } else {
      float* kc = static_cast<float*>(cache) + s * row;
      float* vc = kc + num_slots * row;
      std::memcpy(kc, k + t * k_stride, row * sizeof(float));
      std::memcpy(vc, v + t * v_stride, row * sizeof(float));
    }
  }
}

// Decode attention over the paged cache, in place (no gather): one query token per request.
//   q [B, H, D] float32 (row stride q_stride between requests); out [B, H, D] float32;
//   cache [2, num_blocks, block_size, Hkv, D] (bf16 or float32); block_table [B, max_blocks];
//   seq_lens [B] (context incl. the new token, already written). GQA: H = G * Hkv.
// Work items are (request, KV head, split of the context); a context longer than split_len
// is cut into splits whose partial softmax states are merged by log-sum-exp afterwards
// (FlashDecoding), so a small batch with a long context still uses every thread.
// work: scratch of B * Hkv * max_splits * G * (D + 2) floats.
void sl_paged_attn_decode(const float* q, int64_t q_stride, const void* cache, int kv_bf16,
                          const int64_t* block_table, int64_t max_blocks, const int64_t* seq_lens,
                          int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                          int64_t num_blocks, float scale, int64_t split_len, int64_t max_splits,
                          float* out, float* work) {
  const int64_t G = H / Hkv;
  const int64_t row = Hkv * D;                       // one token's K (or V) for all heads
  const int64_t vplane = num_blocks * block_size * row;
  const int64_t item_floats = G * (D + 2);
  const int64_t items = B * Hkv * max_splits;
  auto body = [&](int64_t it) {
    thread_local std::vector<float> sc;  // scores of one split, [G, len]
    {
      const int64_t b = it / (Hkv * max_splits);
      const int64_t hk = (it / max_splits) % Hkv;
      const int64_t sp = it % max_splits;
      const int64_t L = seq_lens[b];
      const int64_t t0 = sp * split_len, t1 = std::min(L, t0 + split_len);
      float* st = work + it * item_floats;  // [G] max, [G] sum, [G, D] acc
      if (t0 >= t1) {
        for (int64_t g = 0; g < G; ++g) { st[g] = -INFINITY; st[G + g] = 0.f; }
        return;
      }
      const int64_t len = t1 - t0;
      sc.resize(G * len);
      const float* qh = q + b * q_stride + hk * G * D;
      const int64_t* bt = block_table + b * max_blocks;
      for (int64_t t = t0; t < t1; ++t) {  // scores
        const int64_t slot = bt[t / block_size] * block_size + t % block_size;
        float kr[256];
        if (kv_bf16) {
          const uint16_t* kc = static_cast<const uint16_t*>(cache) + slot * row + hk * D;
          for (int64_t i = 0; i < D; ++i) kr[i] = bf16_to_f32(kc[i]);
        } else {
          const float* kc = static_cast<const float*>(cache) + slot * row + hk * D;
          for (int64_t i = 0; i < D; ++i) kr[i] = kc[i];
        }
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qh + g * D;
          float s = 0.f;
          for (int64_t i = 0; i < D; ++i) s += qg[i] * kr[i];
          sc[g * len + (t - t0)] = s * scale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {  // softmax state of this split
        float* sg = sc.data() + g * len;
        float mx = -INFINITY;
        for (int64_t j = 0; j < len; ++j) mx = std::max(mx, sg[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < len; ++j) {
          sg[j] = std::exp(sg[j] - mx);
          sum += sg[j];
        }
        st[g] = mx;
        st[G + g] = sum;
        float* acc = st + 2 * G + g * D;
        for (int64_t i = 0; i < D; ++i) acc[i] = 0.f;
      }
      for (int64_t t = t0; t < t1; ++t) {  // weighted values
        const int64_t slot = bt[t / block_size] * block_size + t % block_size;
        float vr[256];
        if (kv_bf16) {
          const uint16_t* vc = static_cast<const uint16_t*>(cache) + vplane + slot * row + hk * D;
          for (int64_t i = 0; i < D; ++i) vr[i] = bf16_to_f32(vc[i]);
        } else {
          const float* vc = static_cast<const float*>(cache) + vplane + slot * row + hk * D;
          for (int64_t i = 0; i < D; ++i) vr[i] = vc[i];
        }
        for (int64_t g = 0; g < G; ++g) {
          const float p = sc[g * len + (t - t0)];
          float* acc = st + 2 * G + g * D;
          for (int64_t i = 0; i < D; ++i) acc[i] += p * vr[i];
        }
      }
    }
  };
  parallel_for(items, body);
  // merge the splits: o = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hk = 0; hk < Hkv; ++hk)
      for (int64_t g = 0; g < G; ++g) {
        const float* base = work + (b * Hkv + hk) * max_splits * item_floats;
        float M = -INFINITY;
        for (int64_t s = 0; s < max_splits; ++s) M = std::max(M, base[s * item_floats + g]);
        float* o = out + (b * H + hk * G + g) * D;
        for (int64_t i = 0; i < D; ++i) o[i] = 0.f;
        float den = 0.f;
        for (int64_t s = 0; s < max_splits; ++s) {
          const float* st = base + s * item_floats;
          if (st[G + g] == 0.f) continue;
          const float f = std::exp(st[g] - M);
          den += f * st[G + g];
          const float* acc = st + 2 * G + g * D;
          for (int64_t i = 0; i < D; ++i) o[i] += f * acc[i];
        }
        const float inv = den > 0.f ? 1.f / den : 0.f;
        for (int64_t i = 0; i < D; ++i) o[i] *= inv;
      }
}

}  // extern "C"
