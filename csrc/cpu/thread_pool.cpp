#include "cpu/thread_pool.h"

#include <algorithm>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define LILY_PAUSE() _mm_pause()
#else
#define LILY_PAUSE() std::this_thread::yield()
#endif

namespace lily {
namespace {
thread_local bool t_in_job = false;
}

ThreadPool::ThreadPool(int n_threads) {
  if (n_threads <= 0) n_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  n_threads_ = n_threads;
  for (int t = 1; t < n_threads_; ++t) threads_.emplace_back([this, t] { worker(t); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    generation_.fetch_add(1);
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::work(int tid) {
  t_in_job = true;
  for (;;) {
    int64_t b = next_.fetch_add(chunk_);
    if (b >= n_) break;
    call_(ctx_, b, std::min(n_, b + chunk_), tid);
  }
  t_in_job = false;
}

void ThreadPool::worker(int tid) {
  uint64_t seen = 0;
  for (;;) {
    // Spin first: consecutive jobs of one decode step arrive microseconds apart.
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen && spins < 20000) {
      LILY_PAUSE();
      ++spins;
    }
    if (generation_.load(std::memory_order_acquire) == seen) {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return generation_.load() != seen; });
    }
    seen = generation_.load(std::memory_order_acquire);
    if (stop_) return;
    work(tid);
    busy_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::run(int64_t n, int64_t grain, Call call, void* ctx) {
  grain = std::max<int64_t>(grain, 1);
  if (n_threads_ == 1 || n <= grain || t_in_job) {
    call(ctx, 0, n, 0);
    return;
  }
  call_ = call;
  ctx_ = ctx;
  n_ = n;
  // Several chunks per thread balance uneven work (e.g. causal attention rows).
  chunk_ = std::max<int64_t>(grain, (n + 4 * n_threads_ - 1) / (4 * n_threads_));
  next_.store(0);
  busy_.store(n_threads_ - 1);
  {
    std::lock_guard<std::mutex> lk(mu_);
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  cv_.notify_all();
  work(0);
  while (busy_.load(std::memory_order_acquire) != 0) LILY_PAUSE();
}

}  // namespace lily
