// sloserve CPU kernels: how a kernel splits its work over threads.
//
// The build (build.py) defines SL_USE_OMP: the kernels run on OpenMP, and so on torch's own
// OpenMP runtime and threads (torch loads libgomp first; ours resolves to it) rather than a
// second pool competing with them for the cores. The thread count is torch's
// (sl_set_num_threads = omp_set_num_threads, called by the Python loader).
//   parallel_for(total, f)   f(i) for i in [0, total), claimed one at a time (dynamic, 1): the
//                            products' and the attention's work items
//   parallel_rows(total, f)  the same for cheap uniform items (norm rows): one contiguous range
//                            per thread (static)
// Both work-share inside an enclosing parallel region (the fused layer, x16_layer.h, opens one for
// all its phases; in_region() says so) and open their own otherwise. A few kernels use
// `omp parallel for` directly (elementwise.h, qembed) with a size threshold, or an explicit
// region (amx_gemm.h, prefill_attn.h: those exist only with SL_USE_OMP).
//
// Without SL_USE_OMP the kernels run on a pool of our own (Pool below): a job is split into work
// items that threads claim from an atomic counter; the caller works too and returns as soon as
// every item is done, so a thread the OS deschedules slows the job by its share only. Workers
// spin ~200 us after a job, then sleep. build.py does not build this variant.
#pragma once

#include "common.h"

#ifdef SL_USE_OMP
#include <omp.h>
#endif

namespace {

#ifdef SL_USE_OMP
// ------------------------------------------------------------------------------ OpenMP
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

inline bool in_region() { return false; }
inline int64_t nthreads() { return pool().size(); }
template <class F>
void parallel_for(int64_t total, F& f) {
  pool().run(total, [](void* c, int64_t i) { (*static_cast<F*>(c))(i); }, &f);
}
template <class F>
void parallel_rows(int64_t total, F& f) { parallel_for(total, f); }
#endif

}  // namespace
