// W8A16 on the AMX int8 unit against the bf16 AMX block loop (2026-12-04; not in the engine).
// g++ -O3 -march=native -fopenmp -o w8a16 w8a16_amx_bench.cpp [-DPF=k: prefetch k k-blocks ahead]
// OMP_NUM_THREADS=2 [LL=1: one layer's weights reused, L3-resident] [PP=1: bf16 with alternating
// tile registers] [N4=1: bf16 with 64 columns per item at 16 rows] [MB=128: time bf16 in row blocks of 128 instead of int8 (ROWS 512)] ./w8a16 ROWS   -> per round: 120 GEMMs (30 layers x Q/K/V, O, gate/up, down)
#include <immintrin.h>
#include <omp.h>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cmath>
#include <vector>
#include <chrono>
#include <random>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
struct AmxTileCfg { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
inline void amx_config() { AmxTileCfg c; std::memset(&c, 0, sizeof c); c.palette = 1;
  for (int i = 0; i < 8; ++i) { c.rows[i] = 16; c.colsb[i] = 64; } _tile_loadconfig(&c); }
// ---- bf16 (copy of project kernel, MA=1/2 NB=2)
template <int MA, int NB>
inline void amx_block(const uint16_t* xb, int64_t K, const uint16_t* wb, float* y, int64_t ldy) {
  _tile_zero(0); if (NB == 2) _tile_zero(1); if (MA == 2) _tile_zero(2); if (MA == 2 && NB == 2) _tile_zero(3);
  const int64_t KB = K / 32, wstride = NB * 512;
  for (int64_t kb = 0; kb < KB; ++kb) {
    _tile_loadd(4, xb + kb * 32, K * 2); _tile_loadd(6, wb + kb * wstride, 64); _tile_dpbf16ps(0, 4, 6);
    if (NB == 2) { _tile_loadd(7, wb + kb * wstride + 512, 64); _tile_dpbf16ps(1, 4, 7); }
    if (MA == 2) { _tile_loadd(5, xb + 16 * K + kb * 32, K * 2); _tile_dpbf16ps(2, 5, 6); if (NB == 2) _tile_dpbf16ps(3, 5, 7); }
  }
  _tile_stored(0, y, ldy * 4); if (NB == 2) _tile_stored(1, y + 16, ldy * 4);
  if (MA == 2) _tile_stored(2, y + 16 * ldy, ldy * 4); if (MA == 2 && NB == 2) _tile_stored(3, y + 16 * ldy + 16, ldy * 4);
}

// M=16, NB=2, ping-pong registers: C 0,1; A 4/5; B0 6/2; B1 7/3
inline void amx_block_pp(const uint16_t* xb, int64_t K, const uint16_t* wb, float* y, int64_t ldy) {
  _tile_zero(0); _tile_zero(1);
  const int64_t KB = K / 32;
  int64_t kb = 0;
  for (; kb + 2 <= KB; kb += 2) {
    _tile_loadd(4, xb + kb * 32, K * 2); _tile_loadd(6, wb + kb * 1024, 64); _tile_loadd(7, wb + kb * 1024 + 512, 64);
    _tile_loadd(5, xb + kb * 32 + 32, K * 2); _tile_loadd(2, wb + kb * 1024 + 1024, 64); _tile_loadd(3, wb + kb * 1024 + 1536, 64);
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(0, 5, 2); _tile_dpbf16ps(1, 5, 3);
  }
  for (; kb < KB; ++kb) {
    _tile_loadd(4, xb + kb * 32, K * 2); _tile_loadd(6, wb + kb * 1024, 64); _tile_loadd(7, wb + kb * 1024 + 512, 64);
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
  }
  _tile_stored(0, y, ldy * 4); _tile_stored(1, y + 16, ldy * 4);
}
// M=16, 64 columns per item: C 0-3, A 4, B 5/6/7 rotating
inline void amx_block_n4(const uint16_t* xb, int64_t K, const uint16_t* wb, float* y, int64_t ldy) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  const int64_t KB = K / 32;
  const uint16_t* w0 = wb; const uint16_t* w1 = wb + 32 * K;  // two 32-col packed panels
  for (int64_t kb = 0; kb < KB; ++kb) {
    _tile_loadd(4, xb + kb * 32, K * 2);
    _tile_loadd(5, w0 + kb * 1024, 64); _tile_loadd(6, w0 + kb * 1024 + 512, 64);
    _tile_loadd(7, w1 + kb * 1024, 64);
    _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, w1 + kb * 1024 + 512, 64);
    _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, y, ldy * 4); _tile_stored(1, y + 16, ldy * 4); _tile_stored(2, y + 32, ldy * 4); _tile_stored(3, y + 48, ldy * 4);
}
void gemm_bf16(const uint16_t* xb, int64_t M, int64_t K, const uint16_t* wp, int64_t N, float* y) {
  const int64_t NBLK = N / 32;
#pragma omp parallel
  { amx_config();
    if (getenv("N4") && M == 16) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t nb = 0; nb < NBLK / 2; ++nb) amx_block_n4(xb, K, wp + nb * 64 * K, y + nb * 64, N);
    } else
#pragma omp for schedule(dynamic, 1)
    for (int64_t nb = 0; nb < NBLK; ++nb) {
      const uint16_t* wb = wp + nb * 32 * K;
      for (int64_t m0 = 0; m0 < M; m0 += 32) {
        if (m0 + 32 <= M) amx_block<2,2>(xb + m0 * K, K, wb, y + m0 * N + nb * 32, N);
        else if (getenv("PP")) amx_block_pp(xb + m0 * K, K, wb, y + m0 * N + nb * 32, N); else amx_block<1,2>(xb + m0 * K, K, wb, y + m0 * N + nb * 32, N);
      }
    }
    _tile_release(); }
}
// ---- int8 weights per channel, x as int16 per row split hi (s8) / lo (u8)
inline void i8_block(const int8_t* ah, const uint8_t* al, int64_t K, const int8_t* wb, int32_t* c) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  const int64_t KB = K / 64;
  for (int64_t kb = 0; kb < KB; ++kb) {
#ifdef PF
    { const char* p = (const char*)(wb + (kb + PF) * 2048); for (int j = 0; j < 2048; j += 64) _mm_prefetch(p + j, _MM_HINT_T0); }
#endif
    _tile_loadd(4, ah + kb * 64, K); _tile_loadd(6, wb + kb * 2048, 64); _tile_loadd(7, wb + kb * 2048 + 1024, 64);
    _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7);
    _tile_loadd(5, al + kb * 64, K);
    _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7);
  }
  _tile_stored(0, c, 128); _tile_stored(1, c + 16, 128); _tile_stored(2, c + 512, 128); _tile_stored(3, c + 528, 128);
}
void quant_x(const float* x, int64_t M, int64_t K, int8_t* ah, uint8_t* al, float* sa) {
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * K; __m512 mx = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(r + k)));
    float amax = _mm512_reduce_max_ps(mx); float s = amax > 0 ? amax / 32767.f : 1.f; sa[m] = s;
    __m512 inv = _mm512_set1_ps(1.f / s);
    for (int64_t k = 0; k < K; k += 16) {
      __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(r + k), inv));
      q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(32767)), _mm512_set1_epi32(-32767));
      _mm_storeu_si128((__m128i*)(ah + m * K + k), _mm512_cvtepi32_epi8(_mm512_srai_epi32(q, 8)));
      _mm_storeu_si128((__m128i*)(al + m * K + k), _mm512_cvtepi32_epi8(_mm512_and_si512(q, _mm512_set1_epi32(255))));
    }
  }
}
void gemm_i8(const int8_t* ah, const uint8_t* al, const float* sa, int64_t M, int64_t K, const int8_t* wp, const float* sw, int64_t N, float* y) {
  const int64_t NBLK = N / 32;
#pragma omp parallel
  { amx_config(); alignas(64) int32_t c[1024];
#pragma omp for schedule(dynamic, 1)
    for (int64_t nb = 0; nb < NBLK; ++nb) {
      const int8_t* wb = wp + nb * 32 * K;
      for (int64_t m0 = 0; m0 < M; m0 += 16) {
        i8_block(ah + m0 * K, al + m0 * K, K, wb, c);
        __m512 s0 = _mm512_loadu_ps(sw + nb * 32), s1 = _mm512_loadu_ps(sw + nb * 32 + 16);
        for (int i = 0; i < 16 && m0 + i < M; ++i) {
          __m512 a = _mm512_set1_ps(sa[m0 + i]);
          __m512 v0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + i * 32)), _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(_mm512_load_si512(c + 512 + i * 32)));
          __m512 v1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + i * 32 + 16)), _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(_mm512_load_si512(c + 512 + i * 32 + 16)));
          _mm512_storeu_ps(y + (m0 + i) * N + nb * 32, _mm512_mul_ps(_mm512_mul_ps(v0, s0), a));
          _mm512_storeu_ps(y + (m0 + i) * N + nb * 32 + 16, _mm512_mul_ps(_mm512_mul_ps(v1, s1), a));
        }
      }
    }
    _tile_release(); }
}

// the same at M rows in row blocks of MB (the loop order tried for 512-row steps)
void gemm_bf16_mb(const uint16_t* xb, int64_t M, int64_t K, const uint16_t* wp, int64_t N, float* y, int64_t MB) {
  const int64_t NBLK = N / 32;
#pragma omp parallel
  { amx_config();
    for (int64_t mc = 0; mc < M; mc += MB) {
      const int64_t me = std::min(M, mc + MB);
#pragma omp for schedule(dynamic, 1)
      for (int64_t nb = 0; nb < NBLK; ++nb) {
        const uint16_t* wb = wp + nb * 32 * K;
        for (int64_t m0 = mc; m0 < me; m0 += 32) amx_block<2,2>(xb + m0 * K, K, wb, y + m0 * N + nb * 32, N);
      }
    }
    _tile_release(); }
}
int main(int argc, char** argv) {
  syscall(SYS_arch_prctl, 0x1023, 18);
  int M = argc > 1 ? atoi(argv[1]) : 16; const int L = getenv("LL") ? atoi(getenv("LL")) : 30;
  struct Sh { int64_t N, K; } sh[4] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
  std::mt19937 g(1); std::normal_distribution<float> nd;
  std::vector<std::vector<uint16_t>> wb(L * 4); std::vector<std::vector<int8_t>> wi(L * 4); std::vector<std::vector<float>> sw(L*4);
  size_t bytes_bf = 0;
  for (int l = 0; l < L * 4; ++l) { auto s = sh[l % 4]; wb[l].resize(s.N * s.K); wi[l].resize(s.N * s.K); sw[l].assign(s.N, 0.01f);
    for (auto& v : wb[l]) v = 0x3c00 + (g() & 0xff); for (auto& v : wi[l]) v = (int8_t)(g() & 0xff); bytes_bf += s.N * s.K * 2; }
  std::vector<float> x(M * 1536), y(M * 3072 + 64); for (auto& v : x) v = nd(g);
  std::vector<uint16_t> xb(((M + 31) / 32 * 32) * 1536, 0x3f80); std::vector<int8_t> ah(32 * 1536); std::vector<uint8_t> al(32 * 1536); std::vector<float> sa(M);
  const int64_t mb = getenv("MB") ? atoi(getenv("MB")) : 0;  // >0: time the row-blocked bf16 loop instead of int8
  for (int rep = 0; rep < 7; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int ll = 0; ll < 120; ++ll) { int l = ll % (L * 4); auto s = sh[l % 4]; gemm_bf16(xb.data(), (M + 15) / 16 * 16, s.K, wb[l].data(), s.N, y.data()); }
    auto t1 = std::chrono::steady_clock::now();
    for (int ll = 0; ll < 120; ++ll) { int l = ll % (L * 4); auto s = sh[l % 4]; if (mb) gemm_bf16_mb(xb.data(), M, s.K, wb[l].data(), s.N, y.data(), mb); else { quant_x(x.data(), M, s.K, ah.data(), al.data(), sa.data()); gemm_i8(ah.data(), al.data(), sa.data(), M, s.K, wi[l].data(), sw[l].data(), s.N, y.data()); } }
    auto t2 = std::chrono::steady_clock::now();
    double a = std::chrono::duration<double>(t1 - t0).count() * 1e3, b = std::chrono::duration<double>(t2 - t1).count() * 1e3;
    if (mb) printf("M=%d bf16 %.2f ms (%.2f TFLOP/s)  row blocks of %ld %.2f ms (%.2f TFLOP/s)\n", M, a, bytes_bf * M / a / 1e9, (long)mb, b, bytes_bf * M / b / 1e9);
    else printf("M=%d bf16 %.2f ms (%.1f GB/s)  i8 %.2f ms (%.1f GB/s)\n", M, a, bytes_bf / a / 1e6, b, bytes_bf / 2 / b / 1e6);
  }
}
