// Small fork-join thread pool (no OpenMP dependency). The calling thread takes part in the work;
// workers spin briefly between jobs (decode issues many small jobs per token), then sleep.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace lily {

class ThreadPool {
 public:
  // n_threads: total threads including the caller; 0 = hardware concurrency.
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // Calls fn(begin, end, thread_id) over disjoint ranges covering [0, n), ranges of >= grain items.
  // Runs inline when n is small or when called from inside a job (no nesting).
  template <class F>
  void parallel_for(int64_t n, int64_t grain, F&& fn) {
    if (n <= 0) return;
    auto call = [](void* ctx, int64_t b, int64_t e, int tid) { (*static_cast<F*>(ctx))(b, e, tid); };
    run(n, grain, call, &fn);
  }

 private:
  using Call = void (*)(void*, int64_t, int64_t, int);
  void run(int64_t n, int64_t grain, Call call, void* ctx);
  void worker(int tid);
  void work(int tid);

  int n_threads_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> busy_{0};
  bool stop_ = false;
  // current job
  Call call_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_ = 0, chunk_ = 1;
  std::atomic<int64_t> next_{0};
};

}  // namespace lily
