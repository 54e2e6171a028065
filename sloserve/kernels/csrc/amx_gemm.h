// sloserve CPU kernels: the bf16 GEMM on the AMX tiles (sl_amx_linear), the same with SwiGLU in
// its epilogue (sl_amx_swiglu), the weight packing (sl_amx_pack_bf16, plain C++ in every build)
// and the run-time check (sl_amx_init). Python: AmxWeight, Kernels.pack_amx / pack_amx_swiglu.
//
// y [M, N] float32 = x [M, K] (float32, rounded to bf16) @ W^T, W bf16 prepacked by
// sl_amx_pack_bf16, on the AMX tile unit (TDPBF16PS: a 16 x 16 float32 tile += a 16 x 32 bf16
// tile times a 32 x 16 bf16 tile, in one instruction), for the compute-bound steps (prefill
// chunks, large batches). Compiled into the AVX-512 library only, with the instructions
// enabled for these functions alone; sl_amx_init says at run time whether the CPU has them and
// the OS lets this process use the tile registers (Linux arch_prctl ARCH_REQ_XCOMP_PERM), else
// the caller never calls the rest.
//
// Packed W (VNNI pairs): for each block of 32 output rows nb and 32 inputs kb, two 1 KB tiles
// (rows n 0-15, then 16-31), each [16 pairs p][16 rows n][2]: element (p, n, e) = W[n, 32 kb +
// 2 p + e]. N % 16 == 0 (a last block of 16 rows holds one tile), K % 32 == 0.
// Blocking: per work item (32 output columns) the rows of x go by 32: 2 x-tiles x 2 W-tiles
// into 4 accumulator tiles (tmm0-3; x tmm4-5, W tmm6-7); W's 32 x K panel stays in L1/L2
// while x streams past it.
//
// Threads: an OpenMP region per product, 32-column blocks of W claimed one at a time; each
// thread configures its tiles on entry and releases them on exit.
#pragma once

#include "parallel.h"
#include "vec_math.h"

#if SL_ISA == 2 && defined(SL_USE_OMP) && defined(__linux__) && defined(__x86_64__)
#define SL_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define SL_AMX 0
#endif

namespace {

// W bf16 [N, K] row-major (N % 16 == 0, K % 32 == 0) -> the packed layout above.
void amx_pack_bf16(const uint16_t* w, int64_t N, int64_t K, uint16_t* out) {
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
}

#if SL_AMX
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512bf16")

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
#pragma GCC pop_options

// 1 when the CPU has AMX-TILE, AMX-BF16 and AVX512-BF16 and the kernel granted this process
// the tile state (asked for here); else 0.
int amx_init() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
  if (!((d >> 22) & 1) || !((d >> 24) & 1)) return 0;   // AMX-BF16, AMX-TILE
  if (!cpu_avx512_bf16()) return 0;
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) return 0;
  unsigned long perm = 0;
  if (syscall(SYS_arch_prctl, 0x1022 /* ARCH_GET_XCOMP_PERM */, &perm) != 0) return 0;
  return (perm >> 18) & 1 ? 1 : 0;
}
#endif  // SL_AMX

}  // namespace
