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

void ThreadPool::work(Job& job, int tid) {
  t_in_job = true;
  for (;;) {
    const int64_t b = job.next.fetch_add(job.chunk, std::memory_order_relaxed);
    if (b >= job.n) break;
    job.call(job.ctx, b, std::min(job.n, b + job.chunk), tid);
  }
  t_in_job = false;
}

void ThreadPool::worker(int tid) {
  uint64_t seen = 0;
  for (;;) {
    // Spin first: consecutive jobs of one decode step arrive microseconds apart.
    for (int spins = 0; generation_.load(std::memory_order_acquire) == seen && spins < 4000; ++spins) LILY_PAUSE();
    Job* job = nullptr;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return generation_.load() != seen; });
      seen = generation_.load();
      if (stop_) return;
      job = job_;
      if (job) job->refs.fetch_add(1, std::memory_order_relaxed);
    }
    if (job) {
      work(*job, tid);
      job->refs.fetch_sub(1, std::memory_order_release);
    }
  }
}

void ThreadPool::run(int64_t n, int64_t grain, Call call, void* ctx) {
  grain = std::max<int64_t>(grain, 1);
  if (n_threads_ == 1 || n <= grain || t_in_job) {
    call(ctx, 0, n, 0);
    return;
  }
  Job job;
  job.call = call;
  job.ctx = ctx;
  job.n = n;
  // Several chunks per thread balance uneven work (e.g. causal attention rows).
  job.chunk = std::max<int64_t>(grain, (n + 4 * n_threads_ - 1) / (4 * n_threads_));
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = &job;
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  cv_.notify_all();
  work(job, 0);
  {
    // No worker can join after this; wait only for those that did (they hold claimed chunks).
    std::lock_guard<std::mutex> lk(mu_);
    job_ = nullptr;
  }
  for (int spins = 0; job.refs.load(std::memory_order_acquire) != 0; ++spins) {
    if (spins < 2000) LILY_PAUSE();
    else std::this_thread::yield();
  }
}

}  // namespace lily
