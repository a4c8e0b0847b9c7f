// Small fork-join thread pool (no OpenMP dependency). The calling thread takes part in the work and
// finishes it alone if workers are slow to wake (oversubscribed machines): a job waits only for the
// workers that actually joined it. Workers spin briefly between jobs (decode issues many small jobs
// per token), then sleep.
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
  // One parallel_for call; lives on the caller's stack until every worker that joined has left.
  struct Job {
    Call call;
    void* ctx;
    int64_t n, chunk;
    std::atomic<int64_t> next{0};
    std::atomic<int> refs{0};
  };
  void run(int64_t n, int64_t grain, Call call, void* ctx);
  void worker(int tid);
  static void work(Job& job, int tid);

  int n_threads_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  Job* job_ = nullptr;  // published job, guarded by mu_
  bool stop_ = false;
};

}  // namespace lily
