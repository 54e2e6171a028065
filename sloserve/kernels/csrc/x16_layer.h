// sloserve CPU kernels: a decoder layer after its attention, and the next one up to its
// attention, in one call on x16 weights (sl_x16_layer_tail): one OpenMP region whose phases
// (qlinear_x16.h's products, elementwise.h's norms and RoPE rows) share its threads, separated
// by their work-sharing loops' barriers. Python: X16Layer, Kernels.x16_layer / run_x16_layer.
#pragma once

#include "elementwise.h"
#include "qlinear_x16.h"

// The C struct the Python side fills (_SlX16Layer in sloserve/kernels/_lib.py; its weights are
// qlinear_x16.h's SlX16): a decoder layer's constant part for sl_x16_layer_tail: its output projection, post-attention
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

namespace {

// h += delta; a = rmsnorm(h) * w, row by row (work-shared inside a region). [T, D] float32.
inline void add_rms_norm_rows(float* h, const float* delta, const float* w, int64_t T,
                              int64_t D, float eps, float* a) {
  auto row = [&](int64_t t) {
    const float ss = add_sumsq(h + t * D, delta + t * D, D);
    store_scaled(h + t * D, 1.f / std::sqrt(ss / float(D) + eps), w, D, a, t * D, 0);
  };
  parallel_rows(T, row);
}

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
void x16_layer_tail(const SlX16Layer* L, const float* o, int64_t T, float* h, float* delta,
                    float* a, float* f, float* qkv, const float* cos_t, const float* sin_t,
                    void* scratch) {
  if (T <= 0) return;
  const int64_t d = L->wo->N;
#ifdef SL_USE_OMP
#pragma omp parallel
#endif
  {
    qlinear_x16(o, T, *L->wo, delta, scratch);
    add_rms_norm_rows(h, delta, L->ln2, T, d, L->eps, a);
    qlinear_x16_swiglu(a, T, *L->wgu, f, scratch);
    qlinear_x16(f, T, *L->wd, delta, scratch);
    if (L->ln1n) {
      add_rms_norm_rows(h, delta, L->ln1n, T, d, L->eps, a);
      qlinear_x16(a, T, *L->wqkv, qkv, scratch);
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

}  // namespace
