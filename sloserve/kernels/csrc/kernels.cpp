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
#include <cpuid.h>
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

#ifdef SL_USE_OMP
#include <omp.h>
// (inside a parallel region: its team's size; omp_get_max_threads() there is a nested team's)
inline int64_t nthreads() { return omp_in_parallel() ? omp_get_num_threads() : omp_get_max_threads(); }
// Called by every thread of an enclosing parallel region (the fused layer, sl_x16_layer_tail),
// the loop is shared out among them (and ends with their barrier); else it opens its own.
template <class F>
void parallel_for(int64_t total, F& f) {
  if (omp_in_parallel()) {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < total; ++i) f(i);
  } else {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < total; ++i) f(i);
  }
}
inline bool in_region() { return omp_in_parallel(); }
// parallel_for for cheap uniform items (rows of a norm): each thread one contiguous range (a
// dynamic claim per row made a 272-row add + RMSNorm 3x slower, measured)
template <class F>
void parallel_rows(int64_t total, F& f) {
  if (omp_in_parallel()) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < total; ++i) f(i);
  } else {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < total; ++i) f(i);
  }
}
#else
inline bool in_region() { return false; }
inline int64_t nthreads() { return pool().size(); }
template <class F>
void parallel_for(int64_t total, F& f) {
  pool().run(total, [](void* c, int64_t i) { (*static_cast<F*>(c))(i); }, &f);
}
template <class F>
void parallel_rows(int64_t total, F& f) { parallel_for(total, f); }
#endif

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
#endif
#if SL_ISA >= 1
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
#endif

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

inline void quantize_row(const float* xr, int64_t G, int8_t* qr, float* d, float* s) {
  for (int64_t g = 0; g < G; ++g, xr += 32, qr += 32) {
    float dx, inv;
#if SL_ISA == 2
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
#else
    float amax = 0.f, sum = 0.f;
    for (int j = 0; j < 32; ++j) {
      amax = std::max(amax, std::fabs(xr[j]));
      sum += xr[j];
    }
    s[g] = sum;
    const bool ok = group_scale(std::isnan(sum) ? NAN : amax, dx, inv);
    d[g] = dx;
    for (int j = 0; j < 32; ++j) qr[j] = ok ? static_cast<int8_t>(std::nearbyint(xr[j] * inv)) : 0;
#endif
  }
}

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

// ------------------------------------------------------------------ 4-bit x16 interleaved
// Rows in blocks of 16 (N % 16 == 0). Block b, group g: 4 chunks of 64 bytes; 32-bit lane r of
// chunk c holds bytes 4c..4c+3 of row 16b + r's group g in the nibble layout (low nibbles: codes
// 4c..4c+3, high nibbles: codes 16+4c..16+4c+3). Scales and offsets: [N / 16, G, 16] float32.
// One dpbusd then multiplies 4 codes of 16 rows with 4 broadcast activations, so the 16 rows'
// group sums land in the 16 lanes (no horizontal sums, one scale multiply per group and block).

constexpr int kX16 = 16;

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

constexpr int64_t kX16Prefetch = 2048;  // bytes ahead in a 4-bit weight stream (see x16_tile)

#if SL_ISA == 2
// acc += dpbusd(w, x[0] broadcast to 16 lanes): the activations' 4 codes come from memory as an
// embedded broadcast ({1to16}), not a separate vpbroadcastd (which g++ does not fold into
// vpdpbusd from the intrinsic): one vector op per 64 multiply-adds instead of two.
inline __m512i dpbusd_b(__m512i acc, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}
#endif

#if SL_ISA == 2
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
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    __m512i lo[BR][4], hi[BR][4];
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
        hi[br][c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      }
      dv[br] = _mm512_loadu_ps(d + (br * G + g) * kX16);
      if constexpr (HAS_MN) mv[br] = _mm512_loadu_ps(mn + (br * G + g) * kX16);
    }
    const int8_t* xg = a.q + g * 32;
#pragma GCC unroll 16
    for (int mi = 0; mi < MC; ++mi) {
      const int32_t* xq = reinterpret_cast<const int32_t*>(xg + mi * K);
      const __m512 dx = _mm512_set1_ps(a.d[mi * G + g]);
#pragma GCC unroll 2
      for (int br = 0; br < BR; ++br) {
        // two chains of 4 dpbusd (half the latency of one of 8), added
        __m512i i = _mm512_setzero_si512(), i2 = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) i = dpbusd_b(i, lo[br][c], xq + c);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) i2 = dpbusd_b(i2, hi[br][c], xq + 4 + c);
        i = _mm512_add_epi32(i, i2);
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
#endif

template <int MC, int BR>
inline void x16_tile(const ActQ& a, int64_t K, const uint8_t* w, const float* d, const float* mn,
                     int64_t G, float* y, int64_t N) {
#if SL_ISA == 2
  // per group: the BR blocks' codes unpacked once (8 registers each), then for each of the MC
  // activation rows 8 dpbusd (two chains of 4), their int32 sums scaled into the float
  // accumulator
  if (mn) x16_tile_avx512<MC, BR, true>(a, K, w, d, mn, G, y, N);
  else x16_tile_avx512<MC, BR, false>(a, K, w, d, mn, G, y, N);
#elif SL_ISA == 1
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
#else
  x16_tile_scalar<4, MC, BR>(a, K, w, d, mn, G, y, N);
#endif
}

#if SL_ISA == 2
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
#endif

// 8-bit codes (signed), same interleave: 8 chunks of 64 bytes per block and group. AVX-512
// dpbusd wants unsigned x signed: the codes are offset by 128 at load (xor 0x80) and 128 times the
// group's integer activation sum (isum holds -128 times it) is taken off again, so the dot
// product stays exact.
template <int MC, int BR>
inline void x16_tile8(const ActQ& a, const int32_t* isum, int64_t K, const uint8_t* w,
                      const float* d, const float* mn, int64_t G, float* y, int64_t N) {
#if SL_ISA == 2
  if (mn) x16_tile8_avx512<MC, BR, true>(a, isum, K, w, d, mn, G, y, N);
  else x16_tile8_avx512<MC, BR, false>(a, isum, K, w, d, mn, G, y, N);
#elif SL_ISA == 1
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
#else
  (void)isum;
  x16_tile_scalar<8, MC, BR>(a, K, w, d, mn, G, y, N);
#endif
}

template <int BITS, int MC>
inline void x16_blocks(const ActQ& a, const int32_t* isum, int64_t K, const uint8_t* qw,
                       const float* d, const float* mn, int64_t G, int64_t N, int64_t b0,
                       int64_t b1, float* y) {
  constexpr int BR = MC <= 2 ? 2 : 1;
  const int64_t bw = G * 16 * BITS * 4, bs = G * kX16;
  int64_t b = b0;
  for (; b + BR <= b1; b += BR) {
    if constexpr (BITS == 4)
      x16_tile<MC, BR>(a, K, qw + b * bw, d + b * bs, mn ? mn + b * bs : nullptr, G, y + b * kX16, N);
    else
      x16_tile8<MC, BR>(a, isum, K, qw + b * bw, d + b * bs, mn ? mn + b * bs : nullptr, G,
                        y + b * kX16, N);
  }
  for (; b < b1; ++b) {
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

// ------------------------------------------------------------------ vector helpers
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

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if SL_ISA == 2
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  s = _mm512_reduce_add_ps(acc);
#elif SL_ISA == 1
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  s = hsum(acc);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float p, const float* x, float* y, int64_t n) {  // y += p * x
  int64_t i = 0;
#if SL_ISA == 2
  const __m512 pv = _mm512_set1_ps(p);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(pv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#elif SL_ISA == 1
  const __m256 pv = _mm256_set1_ps(p);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += p * x[i];
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

// One K or V row of 64 cache values at p as four float32 vectors. bf16: two 64-byte loads,
// each split into its even and odd elements by a shift and a mask (no cross-lane shuffle: the
// widening load that keeps the order is a shuffle-port uop per 16 values, and that port was the
// kernel's bottleneck), so the vectors hold the even elements of 0..31, the odd ones of 0..31,
// then the same of 32..63 (see row64_pos); float32: elements 0..15, 16..31, 32..47, 48..63.
// int8 (kind 2): the 64 codes widened in order (elements 0..15, ..., 48..63), not yet scaled.
template <int BF16>
inline void load_row64(const char* p, __m512& r0, __m512& r1, __m512& r2, __m512& r3) {
  if constexpr (BF16 == kKvInt8) {  // the widening loads take their 16 bytes from memory
    const __m128i* q = reinterpret_cast<const __m128i*>(p);
    r0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
    r1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
    r2 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 2)));
    r3 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 3)));
  } else if constexpr (BF16 != 0) {
    const __m512i a = _mm512_loadu_si512(p), b = _mm512_loadu_si512(p + 64);
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    r0 = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
    r1 = _mm512_castsi512_ps(_mm512_and_si512(a, hi));
    r2 = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
    r3 = _mm512_castsi512_ps(_mm512_and_si512(b, hi));
  } else {
    const float* f = reinterpret_cast<const float*>(p);
    r0 = _mm512_loadu_ps(f);
    r1 = _mm512_loadu_ps(f + 16);
    r2 = _mm512_loadu_ps(f + 32);
    r3 = _mm512_loadu_ps(f + 48);
  }
}

// The row position of lane i of vector c as load_row64 lays a row out.
template <int BF16>
constexpr int row64_pos(int c, int i) {
  return BF16 == kKvBF16 ? (c / 2) * 32 + 2 * i + (c % 2) : 16 * c + i;
}

// a[g] = the 16 lane products of query head g (qv in load_row64's order) with the K row at kp,
// summed over the row's four vectors (the lanes still to be added up)
template <int G, int BF16>
inline void row_dots(const __m512 (&qv)[G][4], const char* kp, __m512 (&a)[G]) {
  __m512 k0, k1, k2, k3;
  load_row64<BF16>(kp, k0, k1, k2, k3);
  for (int g = 0; g < G; ++g) {
    __m512 x = _mm512_mul_ps(qv[g][0], k0);
    x = _mm512_fmadd_ps(qv[g][1], k1, x);
    x = _mm512_fmadd_ps(qv[g][2], k2, x);
    a[g] = _mm512_fmadd_ps(qv[g][3], k3, x);
  }
}

// G and the cache kind are template parameters: the per-head arrays (q, the 4-token partial
// scores, the value accumulators) get compile-time sizes the compiler can keep in zmm
// registers, and load_row64 no kind branch per row. (Templating alone measured no faster
// than the runtime-G kernel; the gains came from hsum4, max16, load_row64 and the prefetch.)
// Addresses are in bytes: a token's K (or V) row of all heads is `tok` bytes, head hk's entry
// starts `hoff` bytes into it, and the V plane `vplane` bytes after the K plane. For int8 the
// per-entry scale multiplies the score (K) and the softmax weight (V, in a pass of its own
// before the weighted sum), not each value.
// Heads [hk0, hk0 + nh) of one request over tokens [t0, t1), G (<= 4) query heads per KV head:
// q rows qh [nh * G, 64]; each head's softmax state at st + (head - hk0) * st_stride.
// Block by block, every head's share of a block is done before the next block: a token's K (or
// V) row holds all the heads contiguously, so a block (block_size * tok bytes) is read once,
// whole, and the next block is prefetched while this one is computed. (Head after head over
// the whole range read a third of each row at a stride, and fetched every byte during the first
// head's pass only: 20 GB/s from DRAM in a 16-request step against 54 GB/s cache-resident.)
template <int G, int KIND>
inline void decode_item_d64_t(const float* qh, const char* base, const int64_t* bt,
                              int64_t block_size, int64_t tok, int64_t vplane, int64_t hbytes,
                              int64_t hk0, int64_t nh, int64_t t0, int64_t t1, float scale,
                              float* st, int64_t st_stride) {
  constexpr int D = 64;
  const int64_t len = t1 - t0, R = nh * G;  // query rows
  thread_local std::vector<float> buf;
  buf.resize(R * len + 2 * R * D);
  float* sc = buf.data();       // scores, then weights [R, len]
  float* qp = sc + R * len;     // q rows in load_row64's order (a dot product needs no reordering)
  float* accp = qp + R * D;     // weighted values [R, 64], same order
  for (int64_t r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c)
      for (int i = 0; i < 16; ++i) qp[r * D + 16 * c + i] = qh[r * D + row64_pos<KIND>(c, i)];
  const char* hb = base + hk0 * hbytes;  // head hk0's entry of token 0 of block 0
  // The next block (all heads) is prefetched a few lines at a time between the dot products of
  // this one: a whole block's ~100 prefetches at once overflow the core's outstanding-miss
  // slots, and the ones that do not fit are dropped.
  const char* pf = nullptr;
  int64_t pf_left = 0;
  // (an item of one KV head fetches for the others too only as head 0, like the old kernel)
  const bool pf_on = nh > 1 || hk0 == 0;
  // (the scores' last block asks for the values' first one)
  auto next_block = [&](int64_t t, int64_t plane) {
    const int64_t nxt = t / block_size + 1;
    if (!pf_on) {
      pf_left = 0;
    } else if (nxt * block_size < t1) {
      pf_left = std::min(block_size, t1 - nxt * block_size) * tok;
      pf = base + plane + bt[nxt] * block_size * tok;
    } else if (plane == 0) {
      const int64_t first = t0 / block_size, off = t0 % block_size;
      pf_left = (std::min(block_size, t1 - first * block_size) - off) * tok;
      pf = base + vplane + (bt[first] * block_size + off) * tok;
    } else {
      pf_left = 0;
    }
  };
  auto prefetch_some = [&](int lines) {
    for (int l = 0; l < lines && pf_left > 0; ++l, pf += 64, pf_left -= 64) _mm_prefetch(pf, _MM_HINT_T0);
  };
  // lines per 4-token step of the scores / per token of the values, so that the next block is
  // asked for within the first ~half of this one (block_size * tok / 64 lines over
  // nh * block_size / 4 steps, resp. nh * block_size tokens)
  const int pf_k = static_cast<int>(std::max<int64_t>(1, (8 * tok / 64 + nh - 1) / nh));
  const int pf_v = static_cast<int>(std::max<int64_t>(1, (2 * tok / 64 + nh - 1) / nh));
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t = t0; t < t1;) {  // scores, block by block (no division per token)
    const int64_t off = t % block_size, n = std::min(block_size - off, t1 - t);
    const char* kb = hb + (bt[t / block_size] * block_size + off) * tok;
    next_block(t, 0);
    for (int64_t h = 0; h < nh; ++h) {
      __m512 qv[G][4];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < 4; ++c) qv[g][c] = _mm512_loadu_ps(qp + (h * G + g) * D + 16 * c);
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
        for (int u = 0; u < 4; ++u, kp += tok) row_dots<G, KIND>(qv, kp, a[u]);
        for (int g = 0; g < G; ++g)
          _mm_storeu_ps(sh + g * len + j, _mm_mul_ps(hsum4(a[0][g], a[1][g], a[2][g], a[3][g]), ks));
      }
      for (; j < n; ++j, kp += tok) {
        __m512 a[G];
        row_dots<G, KIND>(qv, kp, a);
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
    for (int64_t h = 0; h < nh; ++h) {
      __m512 acc[G][4];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_loadu_ps(accp + (h * G + g) * D + 16 * c);
      const float* wh = sc + h * G * len + (t - t0);
      const char* vp = vb + h * hbytes;
      for (int64_t j = 0; j < n; ++j, vp += tok) {
        prefetch_some(pf_v);
        __m512 v0, v1, v2, v3;
        load_row64<KIND>(vp, v0, v1, v2, v3);
        for (int g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(wh[g * len + j]);
          acc[g][0] = _mm512_fmadd_ps(p, v0, acc[g][0]);
          acc[g][1] = _mm512_fmadd_ps(p, v1, acc[g][1]);
          acc[g][2] = _mm512_fmadd_ps(p, v2, acc[g][2]);
          acc[g][3] = _mm512_fmadd_ps(p, v3, acc[g][3]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(accp + (h * G + g) * D + 16 * c, acc[g][c]);
    }
    t += n;
  }
  for (int64_t r = 0; r < R; ++r) {  // back to the row's order
    float* o = st + (r / G) * st_stride + 2 * G + (r % G) * D;
    for (int c = 0; c < 4; ++c)
      for (int i = 0; i < 16; ++i) o[row64_pos<KIND>(c, i)] = accp[r * D + 16 * c + i];
  }
}

template <int G>
inline void decode_item_d64_g(const float* qh, const char* base, int kind, const int64_t* bt,
                              int64_t block_size, int64_t tok, int64_t vplane, int64_t hbytes,
                              int64_t hk0, int64_t nh, int64_t t0, int64_t t1, float scale,
                              float* st, int64_t st_stride) {
  if (kind == kKvBF16)
    decode_item_d64_t<G, kKvBF16>(qh, base, bt, block_size, tok, vplane, hbytes, hk0, nh, t0, t1, scale, st, st_stride);
  else if (kind == kKvInt8)
    decode_item_d64_t<G, kKvInt8>(qh, base, bt, block_size, tok, vplane, hbytes, hk0, nh, t0, t1, scale, st, st_stride);
  else
    decode_item_d64_t<G, kKvF32>(qh, base, bt, block_size, tok, vplane, hbytes, hk0, nh, t0, t1, scale, st, st_stride);
}

// One work item of the decode kernel for head_dim 64 on AVX-512: KV heads [hk0, hk0 + nh) with
// their G (<= 4) query heads each, over tokens [t0, t1) (see decode_item_d64_t).
inline void decode_item_d64(const float* qh, const char* base, int kind, const int64_t* bt,
                            int64_t block_size, int64_t tok, int64_t vplane, int64_t hbytes,
                            int64_t hk0, int64_t nh, int64_t G, int64_t t0, int64_t t1,
                            float scale, float* st, int64_t st_stride) {
  switch (G) {
    case 1: return decode_item_d64_g<1>(qh, base, kind, bt, block_size, tok, vplane, hbytes, hk0, nh, t0, t1, scale, st, st_stride);
    case 2: return decode_item_d64_g<2>(qh, base, kind, bt, block_size, tok, vplane, hbytes, hk0, nh, t0, t1, scale, st, st_stride);
    case 3: return decode_item_d64_g<3>(qh, base, kind, bt, block_size, tok, vplane, hbytes, hk0, nh, t0, t1, scale, st, st_stride);
    default: return decode_item_d64_g<4>(qh, base, kind, bt, block_size, tok, vplane, hbytes, hk0, nh, t0, t1, scale, st, st_stride);
  }
}
#endif

inline float silu(float v) { return v / (1.f + fast_exp(std::max(-v, -87.f))); }

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

// silu(g) * u for 16 floats: g / (1 + exp(-g)) as g * 1 / d, 1 / d by vrcp14ps and one Newton
// step (~1 ulp; vdivps cost more than the rest of the loop).
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
  __m512 y = _mm512_rcp14_ps(d);
  y = _mm512_mul_ps(y, _mm512_fnmadd_ps(d, y, _mm512_set1_ps(2.f)));
  return _mm512_mul_ps(_mm512_mul_ps(g, y), u);
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

// ------------------------------------------------------------------------------ AMX bf16 GEMM
// y [M, N] float32 = x [M, K] (float32, rounded to bf16) @ W^T, W bf16 prepacked by
// sl_amx_pack_bf16, on the AMX tile unit (TDPBF16PS: a 16 x 16 float32 tile += a 16 x 32 bf16
// tile times a 32 x 16 bf16 tile, in one instruction). For the compute-bound steps (prefill
// chunks, large batches): at 32-512 rows it runs the embedded model's shapes at ~0.65-0.73
// TFLOP/s on 2 cores of the AMX Xeon measured (torch's oneDNN matmul on the same weights:
// 0.21 at 32 rows, 0.45-0.54 at 256-512). Compiled into the AVX-512 library only, with the
// instructions enabled for this section alone; sl_amx_init says at run time whether the CPU has
// them and the OS lets this process use the tile registers (Linux arch_prctl
// ARCH_REQ_XCOMP_PERM), else the caller never calls the rest.
//
// Packed W (VNNI pairs): for each block of 32 output rows nb and 32 inputs kb, two 1 KB tiles
// (rows n 0-15, then 16-31), each [16 pairs p][16 rows n][2]: element (p, n, e) = W[n, 32 kb +
// 2 p + e]. N % 16 == 0 (a last block of 16 rows holds one tile), K % 32 == 0.
// Blocking: per work item (32 output columns) the rows of x go by 32: 2 x-tiles x 2 W-tiles
// into 4 accumulator tiles (tmm0-3; x tmm4-5, W tmm6-7); W's 32 x K panel stays in L1/L2
// while x streams past it.
#if SL_ISA == 2 && defined(SL_USE_OMP) && defined(__linux__) && defined(__x86_64__)
#define SL_AMX 1
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512bf16")
#include <sys/syscall.h>
#include <unistd.h>

inline bool cpu_avx512_bf16() {  // CPUID leaf 7 subleaf 1, EAX bit 5
  unsigned a, b, c, d;
  return __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1);
}

struct AmxTileCfg {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

inline void amx_config() {  // per thread: all 8 tiles 16 rows x 64 bytes
  AmxTileCfg c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int i = 0; i < 8; ++i) {
    c.rows[i] = 16;
    c.colsb[i] = 64;
  }
  _tile_loadconfig(&c);
}

// x rows [m0, m0 + 16 * MA) (bf16, row stride K) times W block `wb` (NB tiles) -> y rows
// (float32, row stride ldy) at columns [n0, n0 + 16 * NB); MA, NB in {1, 2}.
template <int MA, int NB>
inline void amx_block(const uint16_t* xb, int64_t K, const uint16_t* wb, float* y, int64_t ldy) {
  _tile_zero(0);
  if (NB == 2) _tile_zero(1);
  if (MA == 2) _tile_zero(2);
  if (MA == 2 && NB == 2) _tile_zero(3);
  const int64_t KB = K / 32, wstride = NB * 512;  // uint16 per kb in this block
  for (int64_t kb = 0; kb < KB; ++kb) {
    _tile_loadd(4, xb + kb * 32, K * 2);
    _tile_loadd(6, wb + kb * wstride, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (NB == 2) {
      _tile_loadd(7, wb + kb * wstride + 512, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (MA == 2) {
      _tile_loadd(5, xb + 16 * K + kb * 32, K * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (NB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, y, ldy * 4);
  if (NB == 2) _tile_stored(1, y + 16, ldy * 4);
  if (MA == 2) _tile_stored(2, y + 16 * ldy, ldy * 4);
  if (MA == 2 && NB == 2) _tile_stored(3, y + 16 * ldy + 16, ldy * 4);
}

// xb: x in bf16, Mp = M rounded up to 16 rows (zeros past M); tail: scratch of 16 x 32 floats
// per thread for the last rows when M % 16 != 0.
void amx_gemm(const uint16_t* xb, int64_t M, int64_t K, const uint16_t* wp, int64_t N, float* y,
              float* tails) {
  const int64_t NBLK = (N + 31) / 32, Mp = (M + 15) / 16 * 16;
#pragma omp parallel
  {
    amx_config();
    float* tail = tails + 512 * omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
    for (int64_t nb = 0; nb < NBLK; ++nb) {
      const int64_t n0 = nb * 32;
      const bool two = n0 + 32 <= N;
      const uint16_t* wb = wp + n0 * K;  // blocks before this one: n0 / 32 * K * 32 elements
      for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
        const bool full32 = m0 + 32 <= M;
        const uint16_t* xm = xb + m0 * K;
        float* ym = y + m0 * N + n0;
        if (full32 && two) amx_block<2, 2>(xm, K, wb, ym, N);
        else if (full32) amx_block<2, 1>(xm, K, wb, ym, N);
        else {
          // 16 rows at a time: direct while whole, through `tail` for the last partial one
          for (int64_t r = m0; r < std::min(m0 + 32, Mp); r += 16) {
            const bool whole = r + 16 <= M;
            float* dst = whole ? y + r * N + n0 : tail;
            const int64_t ld = whole ? N : 32;
            if (two) amx_block<1, 2>(xb + r * K, K, wb, dst, ld);
            else amx_block<1, 1>(xb + r * K, K, wb, dst, ld);
            if (!whole)
              for (int64_t i = 0; i < M - r; ++i)
                std::memcpy(y + (r + i) * N + n0, tail + i * 32, (two ? 32 : 16) * 4);
          }
        }
      }
    }
    _tile_release();
  }
}

// SwiGLU fused into the gate/up product: out [M, N / 2] float32 = silu(g) * u, where W (N rows,
// N % 32 == 0) was packed from the gate and up weights interleaved by 16 rows (block nb: gate
// rows 16 nb.. then up rows 16 nb..; Kernels.pack_amx_swiglu), so that every 32-column block of
// the product holds one feature block's gate and up: the epilogue turns the block into 16 output
// columns while it is in L1, instead of storing [M, N] and reading it back in a second pass
// (silu_mul ran ~3x slower in a step than alone, its rows in the other core's cache).
// scratch: 32 x 32 floats per thread.
void amx_gemm_swiglu(const uint16_t* xb, int64_t M, int64_t K, const uint16_t* wp, int64_t N,
                     float* out, float* scratch) {
  const int64_t NBLK = N / 32, Mp = (M + 15) / 16 * 16, F = N / 2;
#pragma omp parallel
  {
    amx_config();
    float* s = scratch + 1024 * omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
    for (int64_t nb = 0; nb < NBLK; ++nb) {
      const uint16_t* wb = wp + nb * 32 * K;
      for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
        if (m0 + 32 <= Mp) amx_block<2, 2>(xb + m0 * K, K, wb, s, 32);
        else amx_block<1, 2>(xb + m0 * K, K, wb, s, 32);
        const int64_t rows = std::min<int64_t>(32, M - m0);
        for (int64_t i = 0; i < rows; ++i)
          _mm512_storeu_ps(out + (m0 + i) * F + nb * 16,
                           silu_mul16(_mm512_loadu_ps(s + i * 32), _mm512_loadu_ps(s + i * 32 + 16)));
      }
    }
    _tile_release();
  }
}

// x float32 [M, K] -> bf16 [Mp, K] (round to nearest even, as torch), zero rows to Mp.
void amx_x_to_bf16(const float* x, int64_t M, int64_t K, uint16_t* xb) {
  const int64_t Mp = (M + 15) / 16 * 16;
#pragma omp parallel for schedule(static) if (M * K >= 65536)
  for (int64_t m = 0; m < Mp; ++m) {
    uint16_t* o = xb + m * K;
    if (m >= M) {
      std::memset(o, 0, K * 2);
      continue;
    }
    const float* r = x + m * K;
    for (int64_t k = 0; k < K; k += 32) {  // K % 32 == 0
      __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(r + k + 16), _mm512_loadu_ps(r + k));
      _mm512_storeu_si512(o + k, (__m512i)v);
    }
  }
}
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
template <bool AMX>
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
        const bool raise = _mm512_cmp_ps_mask(bm, _mm512_add_ps(m, _mm512_set1_ps(8.f)),
                                              _CMP_GT_OQ) != 0;
        __m512 alpha = _mm512_set1_ps(1.f);
        if (raise) {
          const __m512 mn = _mm512_max_ps(m, bm);
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
          const __m512 p0 = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(st + 32 * p), mu));
          const __m512 p1 = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(st + 32 * p + 16), mu));
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
#else
#define SL_AMX 0
#endif

}  // namespace

extern "C" {

// Which instruction set this library was built for: 2 AVX-512, 1 AVX2/FMA, 0 generic.
int sl_isa() { return SL_ISA; }

#ifdef SL_USE_OMP
int sl_num_threads() { return omp_get_max_threads(); }
void sl_set_num_threads(int n) { omp_set_num_threads(std::max(1, n)); }
#else
int sl_num_threads() { return pool().size(); }
void sl_set_num_threads(int n) { pool().resize(std::max(1, n)); }
#endif

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

// The same product with x quantized to int8 per group of 32 (see the int8-activation section):
// for 4-bit or int8 weights in groups of 32. scratch: at least M * K + 64 bytes + 2 * M * K / 32
// floats. Returns 0, or -1 for an unsupported format.
int sl_qlinear_i8(const float* x, int64_t M, int64_t K, const uint8_t* qw, const float* d,
                  const float* mn, int bits, int gs, int64_t N, float* y, void* scratch) {
  if (gs != 32) return -1;
  if (bits == 4) qlinear_i8_t<4>(x, M, K, qw, d, mn, N, y, scratch);
  else if (bits == 8) qlinear_i8_t<8>(x, M, K, qw, d, mn, N, y, scratch);
  else return -1;
  return 0;
}

// out [T, K] = rows ids[0..T) of the quantized matrix, dequantized (an embedding lookup).
// Repack a 4-bit (nibble layout) or 8-bit group-32 weight, scales/offsets [N, G], into the x16
// layout (see qlinear_x16). Returns -1 unless N % 16 == 0, K % 32 == 0 and bits is 4 or 8.
int sl_repack_x16(const uint8_t* qw, const float* d, const float* mn, int64_t N, int64_t K,
                  int bits, uint8_t* ow, float* od, float* om) {
  if (N % kX16 || K % 32 || (bits != 4 && bits != 8)) return -1;
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
  return 0;
}

// y [M, N] = x [M, K] @ W^T for an x16-layout weight, x quantized to int8 per group of 32
// (scratch: M * K + 64 + 12 * M * K / 32 bytes).
void sl_qlinear_x16(const float* x, int64_t M, int64_t K, const uint8_t* qw, const float* d,
                    const float* mn, int bits, int64_t N, float* y, void* scratch) {
  if (bits == 4) qlinear_x16<4>(x, M, K, qw, d, mn, N, y, scratch);
  else qlinear_x16<8>(x, M, K, qw, d, mn, N, y, scratch);
}

// out [M, F] = silu(gate) * up of an x16 gate/up weight whose blocks alternate gate, up (2F rows;
// scratch as sl_qlinear_x16's).
void sl_qlinear_x16_swiglu(const float* x, int64_t M, int64_t K, const uint8_t* qw, const float* d,
                           const float* mn, int bits, int64_t F, float* out, void* scratch) {
  if (bits == 4) qlinear_x16_swiglu<4>(x, M, K, qw, d, mn, F, out, scratch);
  else qlinear_x16_swiglu<8>(x, M, K, qw, d, mn, F, out, scratch);
}

int sl_qembed(const int64_t* ids, int64_t T, const uint8_t* qw, const float* d, const float* mn,
              int bits, int gs, int64_t K, float* out) {
  if (!((bits == 4 && gs == 32) || (bits == 8 && (gs == 32 || gs == 16)))) return -1;
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
  return 0;
}

// out = rmsnorm(x) * w; x, out [T, D] float32 (out may alias x).
// rmsnorm, its residual add and SwiGLU read and write float32 or bfloat16 (a 16-bit dense step
// feeds its GEMMs bf16 and gets bf16 back: converting every GEMM's input and output with torch
// cost ~25 % of a 512-token bf16 step). Arithmetic is float32; bf16 is rounded to nearest even.
void sl_rms_norm(const float* x, const float* w, int64_t T, int64_t D, float eps, void* out,
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

// h += delta (the residual stream, float32, in place), then out = rmsnorm(h) * w. [T, D];
// delta and out float32, or bfloat16 where the flag says so.
void sl_add_rms_norm(float* h, const void* delta, const float* w, int64_t T, int64_t D,
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

// out [T, F] = silu(gu[:, :F]) * gu[:, F:]   (gu [T, 2F]: gate then up, as the fused weight);
// both float32, or both bfloat16 (bf16 != 0).
void sl_silu_mul(const void* gu, int64_t T, int64_t F, void* out, int bf16) {
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

// RoPE in place (Hugging Face rotate_half layout): q [T, Hq, D], k [T, Hk, D] float32 with
// row strides q_stride / k_stride (floats between tokens); cos / sin [T, D / 2] float32, the
// step's angles pos[t] * inv_freq[i] computed once for all layers (by the caller, as
// transformers computes them).
void sl_rope(float* q, int64_t q_stride, float* k, int64_t k_stride, const float* cos_t,
             const float* sin_t, int64_t T, int64_t Hq, int64_t Hk, int64_t D) {
  const int64_t half = D / 2;
#ifdef SL_USE_OMP
#pragma omp parallel for schedule(static) if (T * (Hq + Hk) * D * 4 >= 32768)
#endif
  for (int64_t t = 0; t < T; ++t)
    rope_row(q + t * q_stride, k + t * k_stride, cos_t + t * half, sin_t + t * half, Hq, Hk, D);
}

// ------------------------------------------------------------------ fused layer (x16 weights)
// An x16 weight as the fused layer takes it: codes, scales, offsets (or null), bits, and its
// shape [N, K] (N = 2F for a gate/up weight packed for the SwiGLU epilogue).
struct SlX16 {
  const uint8_t* qw;
  const float* d;
  const float* mn;
  int64_t bits, N, K;
};

inline void x16_product(const float* x, int64_t M, const SlX16& w, float* y, void* scratch) {
  if (w.bits == 4) qlinear_x16<4>(x, M, w.K, w.qw, w.d, w.mn, w.N, y, scratch);
  else qlinear_x16<8>(x, M, w.K, w.qw, w.d, w.mn, w.N, y, scratch);
}

inline void x16_swiglu(const float* x, int64_t M, const SlX16& w, float* y, void* scratch) {
  if (w.bits == 4) qlinear_x16_swiglu<4>(x, M, w.K, w.qw, w.d, w.mn, w.N / 2, y, scratch);
  else qlinear_x16_swiglu<8>(x, M, w.K, w.qw, w.d, w.mn, w.N / 2, y, scratch);
}

// h += delta; a = rmsnorm(h) * w, row by row (work-shared inside a region). [T, D] float32.
inline void add_rms_norm_rows(float* h, const float* delta, const float* w, int64_t T,
                              int64_t D, float eps, float* a) {
  auto row = [&](int64_t t) {
    const float ss = add_sumsq(h + t * D, delta + t * D, D);
    store_scaled(h + t * D, 1.f / std::sqrt(ss / float(D) + eps), w, D, a, t * D, 0);
  };
  parallel_rows(T, row);
}

// A decoder layer's constant part for sl_x16_layer_tail: its output projection, post-attention
// norm, gate/up (packed for the SwiGLU epilogue) and down weights; the next layer's input norm,
// q/k/v weight and bias (ln1n null: the last layer); head counts and size, the norms' epsilon.
struct SlX16Layer {
  const SlX16 *wo, *wgu, *wd;
  const float* ln2;
  const float* ln1n;
  const SlX16* wqkv;
  const float* bias;
  int64_t Hq, Hk, D;
  float eps;
};

// One decoder layer after its attention and the next layer up to its attention, in one call
// and one parallel region (the phases separated by the work-sharing loops' barriers), with the
// same numbers as the separate kernels (sl_qlinear_x16, sl_add_rms_norm, sl_qlinear_x16_swiglu,
// sl_rope) called one after another:
//   delta = o Wo^T; h += delta; a = rmsnorm(h) * ln2; f = silu(a Wg^T) * (a Wu^T);
//   delta = f Wd^T;
//   and where ln1n is given (not the last layer): h += delta; a = rmsnorm(h) * ln1n;
//   qkv = a Wqkv^T (+ bias); RoPE on its query and key heads (cos / sin [T, D / 2]).
// o [T, Hq * D]; h, delta, a [T, d] (d = wo.N); f [T, wgu.N / 2]; qkv [T, (Hq + 2 Hk) D];
// every buffer float32 contiguous. scratch: sl_qlinear_x16's for the widest input (f).
// Without ln1n, delta holds the down projection's output and h lacks it (the caller adds it).
void sl_x16_layer_tail(const SlX16Layer* L, const float* o, int64_t T, float* h, float* delta,
                       float* a, float* f, float* qkv, const float* cos_t, const float* sin_t,
                       void* scratch) {
  if (T <= 0) return;
  const int64_t d = L->wo->N;
#ifdef SL_USE_OMP
#pragma omp parallel
#endif
  {
    x16_product(o, T, *L->wo, delta, scratch);
    add_rms_norm_rows(h, delta, L->ln2, T, d, L->eps, a);
    x16_swiglu(a, T, *L->wgu, f, scratch);
    x16_product(f, T, *L->wd, delta, scratch);
    if (L->ln1n) {
      add_rms_norm_rows(h, delta, L->ln1n, T, d, L->eps, a);
      x16_product(a, T, *L->wqkv, qkv, scratch);
      const int64_t nq = L->wqkv->N, D = L->D, half = D / 2;
      auto row = [&](int64_t t) {
        float* r = qkv + t * nq;
        if (L->bias)
          for (int64_t i = 0; i < nq; ++i) r[i] += L->bias[i];
        rope_row(r, r + L->Hq * D, cos_t + t * half, sin_t + t * half, L->Hq, L->Hk, D);
      };
      parallel_rows(T, row);
    }
  }
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

// Write the step's K and V (float32 [T, Hkv, D] with token strides) into one layer's paged
// cache [2, num_blocks, block_size, Hkv, entry] (kv_kind: float32, bf16, or int8 codes + scale,
// see kv_head_bytes) at slot_mapping.
void sl_cache_write(const float* k, int64_t k_stride, const float* v, int64_t v_stride,
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

// Decode attention over the paged cache, in place (no gather): one query token per request.
//   q [B, H, D] float32 (row stride q_stride between requests); out [B, H, D] float32;
//   cache [2, num_blocks, block_size, Hkv, entry] of kind kv_kind (float32, bf16, or int8
//   codes + scale: kv_head_bytes); block_table [B, max_blocks];
//   seq_lens [B] (context incl. the new token, already written). GQA: H = G * Hkv.
// Work items are (request, KV head, split of the context); a context longer than split_len
// is cut into splits whose partial softmax states are merged by log-sum-exp afterwards
// (FlashDecoding), so a small batch with a long context still uses every thread.
// work: scratch of B * Hkv * max_splits * G * (D + 2) floats.
void sl_paged_attn_decode(const float* q, int64_t q_stride, const void* cache, int kind,
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
    if (D == 64 && G <= 4) {
      decode_item_d64(q + b * q_stride + hk0 * G * D, static_cast<const char*>(cache), kind,
                      block_table + b * max_blocks, block_size, tok, vplane, hbytes, hk0, nh, G,
                      t0, t1, scale, st, st_stride);
      return;
    }
#endif
    for (int64_t h = 0; h < nh; ++h) one_head(b, hk0 + h, t0, t1, st + h * st_stride);
  };
  // A work item is one split of one request with all its KV heads (on AVX-512 with D = 64 block
  // by block, see decode_item_d64_t; else one head after the other): a token's K (or V) row
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

// ------------------------------------------------------------------------------ AMX entry points
// 1 when this library has the AMX GEMM, the CPU has AMX-TILE, AMX-BF16 and AVX512-BF16, and the
// kernel granted this process the tile state (asked for here, once); else 0.
int sl_amx_init() {
#if SL_AMX
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
  if (!((d >> 22) & 1) || !((d >> 24) & 1)) return 0;   // AMX-BF16, AMX-TILE
  if (!cpu_avx512_bf16()) return 0;
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) return 0;
  unsigned long perm = 0;
  if (syscall(SYS_arch_prctl, 0x1022 /* ARCH_GET_XCOMP_PERM */, &perm) != 0) return 0;
  return (perm >> 18) & 1 ? 1 : 0;
#else
  return 0;
#endif
}

// W bf16 [N, K] row-major -> the packed layout of the AMX section. -1 unless N % 16 == 0 and
// K % 32 == 0.
int sl_amx_pack_bf16(const uint16_t* w, int64_t N, int64_t K, uint16_t* out) {
  if (N % 16 || K % 32) return -1;
  for (int64_t n0 = 0; n0 < N; n0 += 32) {
    const int64_t tiles = n0 + 32 <= N ? 2 : 1;
    uint16_t* blk = out + n0 * K;
    for (int64_t kb = 0; kb < K / 32; ++kb)
      for (int64_t t = 0; t < tiles; ++t)
        for (int p = 0; p < 16; ++p)
          for (int n = 0; n < 16; ++n)
            for (int e = 0; e < 2; ++e)
              blk[((kb * tiles + t) * 16 + p) * 32 + n * 2 + e] =
                  w[(n0 + 16 * t + n) * K + kb * 32 + 2 * p + e];
  }
  return 0;
}

// y [M, N] float32 = x [M, K] float32 (rounded to bf16) @ W^T, W packed by sl_amx_pack_bf16.
// scratch: at least ((M + 15) / 16 * 16 * K * 2 + 2048 * threads) bytes, 64-byte aligned.
// Only after sl_amx_init() returned 1. Returns -1 when the library has no AMX GEMM.
int sl_amx_linear(const float* x, int64_t M, int64_t K, const uint16_t* wp, int64_t N, float* y,
                  void* scratch) {
#if SL_AMX
  uint16_t* xb = static_cast<uint16_t*>(scratch);
  const int64_t Mp = (M + 15) / 16 * 16;
  float* tails = reinterpret_cast<float*>(xb + Mp * K);
  amx_x_to_bf16(x, M, K, xb);
  amx_gemm(xb, M, K, wp, N, y, tails);
  return 0;
#else
  return -1;
#endif
}

// out [M, N / 2] float32 = silu(x W_gate^T) * (x W_up^T), W packed from the interleaved gate/up
// weight (see amx_gemm_swiglu; N % 32 == 0). scratch: at least ((M + 15) / 16 * 16 * K * 2 +
// 4096 * threads) bytes, 64-byte aligned. Returns -1 when the library has no AMX GEMM or N % 32.
int sl_amx_swiglu(const float* x, int64_t M, int64_t K, const uint16_t* wp, int64_t N,
                  float* out, void* scratch) {
#if SL_AMX
  if (N % 32) return -1;
  uint16_t* xb = static_cast<uint16_t*>(scratch);
  const int64_t Mp = (M + 15) / 16 * 16;
  amx_x_to_bf16(x, M, K, xb);
  amx_gemm_swiglu(xb, M, K, wp, N, out, reinterpret_cast<float*>(xb + Mp * K));
  return 0;
#else
  return -1;
#endif
}

// 1 when this library has the in-place bf16 prefill attention and the CPU has AVX512-BF16
// (its products without AMX); else 0.
int sl_avx512_bf16() {
#if SL_AMX
  return cpu_avx512_bf16() ? 1 : 0;
#else
  return 0;
#endif
}

// Prefill attention of one request's chunk over its bf16 cache in place (see prefill_attn in
// the AMX section): q [n, H, D] float32 (token stride q_stride floats, heads contiguous),
// D % 32 == 0, H a multiple of Hkv; out [n, H, D] float32; amx 1: on the tiles (only after
// sl_amx_init() gave 1), 0: on AVX512-BF16 (only where sl_avx512_bf16() gives 1). scratch:
// sl_prefill_attn_scratch(...) bytes, 64-byte aligned. Returns -1 without these kernels or for
// another D.
int64_t sl_prefill_attn_scratch(int64_t ctx, int64_t Hkv, int64_t D, int64_t threads) {
#if SL_AMX
  return Hkv * ((ctx + 63) / 64 * 64 * D * 2) * 2 + prefill_attn_thread_bytes(D) * threads;
#else
  return 0;
#endif
}

int sl_prefill_attn(const float* q, int64_t q_stride, int64_t n, int64_t P,
                    const uint16_t* cache, const int64_t* blocks, int64_t block_size,
                    int64_t num_blocks, int64_t H, int64_t Hkv, int64_t D, float scale,
                    float* out, void* scratch, int amx) {
#if SL_AMX
  if (D % 32 || D <= 0 || H % Hkv) return -1;
  const PrefillAttnArgs args{q, q_stride, n, P, cache, blocks, block_size, num_blocks, H, Hkv, D,
                             scale, out};
  if (amx)
    prefill_attn<true>(args, static_cast<uint8_t*>(scratch));
  else
    prefill_attn<false>(args, static_cast<uint8_t*>(scratch));
  return 0;
#else
  return -1;
#endif
}

}  // extern "C"
