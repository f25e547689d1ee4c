// A fork-join pool in which the calling thread is worker 0. Idle workers sleep on a futex
// (they never spin between jobs); inside a job, barrier() lets all threads step through a
// list of ops together, briefly spinning before it sleeps, since the other thread is usually
// microseconds away.
#pragma once
#include <atomic>
#include <exception>
#include <functional>
#include <thread>
#include <vector>

namespace ferrum {

class ThreadPool {
 public:
  // num_threads <= 0: the number of cores. ResourceError when the threads cannot be started.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return num_threads_; }
  // Runs fn(thread_index, num_threads) on every thread, the caller included; returns when all
  // are done. Not reentrant. Exceptions thrown by fn are rethrown here (the first one).
  void run(const std::function<void(int, int)>& fn);
  // Inside run(): waits until every thread has reached the barrier. A thread that waits may
  // run idle(ctx) meanwhile, a small step at a time, until it returns false.
  void barrier(bool (*idle)(void* ctx) = nullptr, void* ctx = nullptr);

 private:
  void worker_loop(int index);
  void stop_workers();
  void wait_step() const;

  int num_threads_;
  bool oversubscribed_ = false;  // more threads than the machine has (wait_step)
  std::vector<std::thread> workers_;
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<uint32_t> job_generation_{0};
  std::atomic<uint32_t> pending_{0};  // workers still in the current job (a futex word)
  std::atomic<bool> stop_{false};
  std::atomic<int> barrier_count_{0};
  std::atomic<uint32_t> barrier_generation_{0};
  std::atomic<int> barrier_sleepers_{0};  // wake only when someone sleeps: a futex call is a system call
  std::exception_ptr error_;
  std::atomic<bool> has_error_{false};
};

// Splits [0, n) into near-equal contiguous parts; returns part i of k as [begin, end).
inline void split_range(int64_t n, int i, int k, int64_t* begin, int64_t* end) {
  int64_t base = n / k, rem = n % k;
  *begin = i * base + (i < rem ? i : rem);
  *end = *begin + base + (i < rem ? 1 : 0);
}

}  // namespace ferrum
