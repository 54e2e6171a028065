// sloserve CPU kernels: the C API, and the library's one translation unit.
//
// The engine calls these functions through ctypes (sloserve/kernels/_lib.py holds their
// signatures; ops.py and packing.py the Python wrappers) with raw pointers of contiguous torch
// tensors and int64 sizes. Each one states its contract (shapes, formats, scratch sizes, return
// codes) here, checks the formats it must, and calls the part that does the work:
//   common.h        the instruction set of this build (SL_ISA), includes, scalar helpers
//   parallel.h      how work is split over threads: OpenMP (the build's), or a pool of our own
//   vec_math.h      exp, SiLU, dot / axpy, bf16 conversions shared by the parts
//   act_quant.h     activations quantized to int8 per group of 32
//   qlinear_rows.h  quantized weights in GGUF's row layout: products with float32 or int8
//                   activations, the embedding lookup
//   qlinear_x16.h   the x16 layout (16 rows interleaved): repacking, products, SwiGLU epilogue
//   elementwise.h   RMSNorm (with the residual add), SiLU-and-mul, RoPE
//   x16_layer.h     a decoder layer's tail in one call on x16 weights
//   kv_cache.h      the paged KV cache's entry formats (float32, bf16, int8 + scale), its write
//   decode_attn.h   paged decode attention (FlashDecoding splits)
//   amx_gemm.h      bf16 GEMM on the AMX tiles (AVX-512 library only)
//   prefill_attn.h  bf16 flash attention of a prefill chunk on AMX or AVX512-BF16 (AVX-512
//                   library only)
// build.py compiles this file alone, once per instruction set (avx512, avx2, generic; the flags
// select SL_ISA): every part is a header included here once, so the compiler sees and inlines
// across parts exactly as in one file. Only the sl_* functions below are exported.
#include "common.h"
#include "parallel.h"
#include "act_quant.h"
#include "qlinear_rows.h"
#include "vec_math.h"
#include "qlinear_x16.h"
#include "elementwise.h"
#include "x16_layer.h"
#include "kv_cache.h"
#include "decode_attn.h"
#include "amx_gemm.h"
#include "prefill_attn.h"

extern "C" {

// ------------------------------------------------------------------------------ library
// Which instruction set this library was built for: 2 AVX-512, 1 AVX2/FMA, 0 generic.
int sl_isa() { return SL_ISA; }

// The threads the kernels use (OpenMP's count; the loader sets it to torch's).
#ifdef SL_USE_OMP
int sl_num_threads() { return omp_get_max_threads(); }
void sl_set_num_threads(int n) { omp_set_num_threads(std::max(1, n)); }
#else
int sl_num_threads() { return pool().size(); }
void sl_set_num_threads(int n) { pool().resize(std::max(1, n)); }
#endif

// ------------------------------------------------------------------------------ row layout
// y [M, N] = x [M, K] @ W^T with W quantized in the row layout (qlinear_rows.h). xsum: scratch
// of M * K / gs floats (used when mn is not null). Returns 0, or -1 for an unsupported
// (bits, gs).
int sl_qlinear(const float* x, int64_t M, int64_t K, const uint8_t* qw, const float* d,
               const float* mn, int bits, int gs, int64_t N, float* y, float* xsum) {
  if (bits == 4 && gs == 32) qlinear_t<4, 32>(x, M, K, qw, d, mn, N, y, xsum);
  else if (bits == 8 && gs == 32) qlinear_t<8, 32>(x, M, K, qw, d, mn, N, y, xsum);
  else if (bits == 8 && gs == 16) qlinear_t<8, 16>(x, M, K, qw, d, mn, N, y, xsum);
  else return -1;
  return 0;
}

// The same product with x quantized to int8 per group of 32 (act_quant.h): for 4-bit or int8
// weights in groups of 32. scratch: at least M * K + 64 bytes + 2 * M * K / 32 floats.
// Returns 0, or -1 for an unsupported format.
int sl_qlinear_i8(const float* x, int64_t M, int64_t K, const uint8_t* qw, const float* d,
                  const float* mn, int bits, int gs, int64_t N, float* y, void* scratch) {
  if (gs != 32) return -1;
  if (bits == 4) qlinear_i8_t<4>(x, M, K, qw, d, mn, N, y, scratch);
  else if (bits == 8) qlinear_i8_t<8>(x, M, K, qw, d, mn, N, y, scratch);
  else return -1;
  return 0;
}

// out [T, K] = rows ids[0..T) of the quantized matrix, dequantized (an embedding lookup).
// Returns 0, or -1 for an unsupported (bits, gs).
int sl_qembed(const int64_t* ids, int64_t T, const uint8_t* qw, const float* d, const float* mn,
              int bits, int gs, int64_t K, float* out) {
  if (!((bits == 4 && gs == 32) || (bits == 8 && (gs == 32 || gs == 16)))) return -1;
  qembed(ids, T, qw, d, mn, bits, gs, K, out);
  return 0;
}

// ------------------------------------------------------------------------------ x16 layout
// Repack a 4-bit (nibble layout) or 8-bit group-32 weight, scales/offsets [N, G] of `ss` bytes
// each (4: float32, 2: float16) and offsets null where it has none, into the x16 layout's
// records `out` (see qlinear_x16.h; N / 16 * G records). Returns -1 unless N % 16 == 0,
// K % 32 == 0, bits is 4 or 8 and ss 2 or 4.
int sl_repack_x16(const uint8_t* qw, const uint8_t* d, const uint8_t* mn, int64_t N, int64_t K,
                  int bits, int ss, uint8_t* out) {
  if (N % kX16 || K % 32 || (bits != 4 && bits != 8) || (ss != 2 && ss != 4)) return -1;
  repack_x16(qw, d, mn, N, K, bits, ss, out);
  return 0;
}

// y [M, N] = x [M, K] @ W^T for an x16 weight, x quantized to int8 per group of 32
// (scratch: M * K + 64 + 12 * M * K / 32 bytes).
void sl_qlinear_x16(const float* x, int64_t M, const SlX16* w, float* y, void* scratch) {
  qlinear_x16(x, M, *w, y, scratch);
}

// out [M, F] = silu(gate) * up of an x16 gate/up weight whose blocks alternate gate, up
// (w->N = 2F rows; scratch as sl_qlinear_x16's).
void sl_qlinear_x16_swiglu(const float* x, int64_t M, const SlX16* w, float* out, void* scratch) {
  qlinear_x16_swiglu(x, M, *w, out, scratch);
}

// ------------------------------------------------------------------------------ elementwise
// out = rmsnorm(x) * w; x [T, D] float32, out [T, D] float32 or (out_bf16) bfloat16 (out may
// alias a float32 x).
void sl_rms_norm(const float* x, const float* w, int64_t T, int64_t D, float eps, void* out,
                 int out_bf16) {
  rms_norm(x, w, T, D, eps, out, out_bf16);
}

// h += delta (the residual stream, float32, in place), then out = rmsnorm(h) * w. [T, D];
// delta and out float32, or bfloat16 where the flag says so.
void sl_add_rms_norm(float* h, const void* delta, const float* w, int64_t T, int64_t D,
                     float eps, void* out, int delta_bf16, int out_bf16) {
  add_rms_norm(h, delta, w, T, D, eps, out, delta_bf16, out_bf16);
}

// out [T, F] = silu(gu[:, :F]) * gu[:, F:]   (gu [T, 2F]: gate then up, as the fused weight);
// both float32, or both bfloat16 (bf16 != 0).
void sl_silu_mul(const void* gu, int64_t T, int64_t F, void* out, int bf16) {
  silu_mul(gu, T, F, out, bf16);
}

// RoPE in place (Hugging Face rotate_half layout): q [T, Hq, D], k [T, Hk, D] float32 with
// row strides q_stride / k_stride (floats between tokens); cos / sin [T, D / 2] float32, the
// step's angles pos[t] * inv_freq[i] computed once for all layers (by the caller, as
// transformers computes them).
void sl_rope(float* q, int64_t q_stride, float* k, int64_t k_stride, const float* cos_t,
             const float* sin_t, int64_t T, int64_t Hq, int64_t Hk, int64_t D) {
  rope(q, q_stride, k, k_stride, cos_t, sin_t, T, Hq, Hk, D);
}

// ------------------------------------------------------------------------------ fused layer
// One decoder layer after its attention and the next layer up to its attention in one call
// (x16_layer.h): o [T, Hq * D]; h, delta, a [T, d] (d = wo.N); f [T, wgu.N / 2]; qkv
// [T, (Hq + 2 Hk) D]; every buffer float32 contiguous; cos / sin as sl_rope's. scratch:
// sl_qlinear_x16's for the widest input (f). Without L->ln1n (the last layer) delta holds the
// down projection's output and h lacks it (the caller adds it); qkv, cos and sin are unused.
void sl_x16_layer_tail(const SlX16Layer* L, const float* o, int64_t T, float* h, float* delta,
                       float* a, float* f, float* qkv, const float* cos_t, const float* sin_t,
                       void* scratch) {
  x16_layer_tail(L, o, T, h, delta, a, f, qkv, cos_t, sin_t, scratch);
}

// ------------------------------------------------------------------------------ attention
// Write the step's K and V (float32 [T, Hkv, D] with token strides) into one layer's paged
// cache [2, num_blocks, block_size, Hkv, entry] (kv_kind: 0 float32, 1 bf16, 2 int8 codes +
// scale, see kv_cache.h) at slot_mapping (num_slots = num_blocks * block_size).
void sl_cache_write(const float* k, int64_t k_stride, const float* v, int64_t v_stride,
                    void* cache, int kind, const int64_t* slots, int64_t T, int64_t num_slots,
                    int64_t Hkv, int64_t D) {
  cache_write(k, k_stride, v, v_stride, cache, kind, slots, T, num_slots, Hkv, D);
}

// Decode attention over the paged cache, in place (no gather): one query token per request.
//   q [B, H, D] float32 (row stride q_stride between requests); out [B, H, D] float32;
//   cache [2, num_blocks, block_size, Hkv, entry] of kind kv_kind (as sl_cache_write's);
//   block_table [B, max_blocks]; seq_lens [B] (context incl. the new token, already
//   written). GQA: H = G * Hkv. Contexts cut into max_splits splits of split_len tokens.
// work: scratch of B * Hkv * max_splits * G * (D + 2) floats.
void sl_paged_attn_decode(const float* q, int64_t q_stride, const void* cache, int kind,
                          const int64_t* block_table, int64_t max_blocks, const int64_t* seq_lens,
                          int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t block_size,
                          int64_t num_blocks, float scale, int64_t split_len, int64_t max_splits,
                          float* out, float* work) {
  paged_attn_decode(q, q_stride, cache, kind, block_table, max_blocks, seq_lens, B, H, Hkv, D,
                    block_size, num_blocks, scale, split_len, max_splits, out, work);
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

// Prefill attention of one request's chunk over its bf16 cache in place (prefill_attn.h):
// q [n, H, D] float32 (token stride q_stride floats, heads contiguous), n new tokens after P
// cached ones (their K/V already written), D % 32 == 0, H a multiple of Hkv; blocks: the
// request's block table; out [n, H, D] float32; amx 1: on the tiles (only after sl_amx_init()
// gave 1), 0: on AVX512-BF16 (only where sl_avx512_bf16() gives 1); invariant 1: each query
// token's output independent of its tile-mates (--batch-invariant, see prefill_attn). scratch:
// sl_prefill_attn_scratch(P + n, Hkv, D, threads) bytes, 64-byte aligned (0: no such kernel
// here). Returns -1 without these kernels or for another D.
int64_t sl_prefill_attn_scratch(int64_t ctx, int64_t Hkv, int64_t D, int64_t threads) {
#if SL_AMX
  return prefill_attn_scratch(ctx, Hkv, D, threads);
#else
  return 0;
#endif
}

int sl_prefill_attn(const float* q, int64_t q_stride, int64_t n, int64_t P,
                    const uint16_t* cache, const int64_t* blocks, int64_t block_size,
                    int64_t num_blocks, int64_t H, int64_t Hkv, int64_t D, float scale,
                    float* out, void* scratch, int amx, int invariant) {
#if SL_AMX
  if (D % 32 || D <= 0 || H % Hkv) return -1;
  const PrefillAttnArgs args{q, q_stride, n, P, cache, blocks, block_size, num_blocks, H, Hkv, D,
                             scale, out};
  uint8_t* sc = static_cast<uint8_t*>(scratch);
  if (amx && invariant) prefill_attn<true, true>(args, sc);
  else if (amx) prefill_attn<true, false>(args, sc);
  else if (invariant) prefill_attn<false, true>(args, sc);
  else prefill_attn<false, false>(args, sc);
  return 0;
#else
  return -1;
#endif
}

// ------------------------------------------------------------------------------ AMX GEMM
// 1 when this library has the AMX GEMM, the CPU has AMX-TILE, AMX-BF16 and AVX512-BF16, and the
// kernel granted this process the tile state (asked for here, once); else 0.
int sl_amx_init() {
#if SL_AMX
  return amx_init();
#else
  return 0;
#endif
}

// W bf16 [N, K] row-major -> the packed layout of amx_gemm.h (every library). -1 unless
// N % 16 == 0 and K % 32 == 0.
int sl_amx_pack_bf16(const uint16_t* w, int64_t N, int64_t K, uint16_t* out) {
  if (N % 16 || K % 32) return -1;
  amx_pack_bf16(w, N, K, out);
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

}  // extern "C"
