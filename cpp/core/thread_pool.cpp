#include "core/thread_pool.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <sched.h>
#include <unistd.h>

#include <climits>
#include <string>
#include <system_error>

#include "core/error.h"

namespace ferrum {

namespace {
void futex_wait(std::atomic<uint32_t>* addr, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT_PRIVATE, expected, nullptr,
          nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
}
inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}
// Spin iterations before sleeping at a barrier: long enough to cover an unbalanced op split
// (a few microseconds), short enough that a waiting thread gives its core back.
constexpr int kBarrierSpins = 4000;
}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  const int cores = int(std::thread::hardware_concurrency());
  if (num_threads <= 0) num_threads = cores;
  num_threads_ = num_threads < 1 ? 1 : num_threads;
  oversubscribed_ = cores > 0 && num_threads_ > cores;
  workers_.reserve(size_t(num_threads_ - 1));
  try {
    for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
  } catch (const std::system_error& e) {  // out of threads or of address space for their stacks
    const size_t started = workers_.size();
    stop_workers();
    throw ResourceError("could not start " + std::to_string(num_threads_ - 1) + " worker threads (" +
                        std::to_string(started) + " started: " + e.what() + "); use fewer threads");
  }
}

ThreadPool::~ThreadPool() { stop_workers(); }

void ThreadPool::stop_workers() {
  stop_.store(true);
  job_generation_.fetch_add(1);
  futex_wake_all(&job_generation_);
  for (auto& t : workers_) t.join();
  workers_.clear();
}

// One step of a wait for other threads. With more threads than cores, the one waited for may be
// off its core: yielding lets it run (spinning starves it: a decode with more threads than cores
// crawled).
void ThreadPool::wait_step() const {
  if (oversubscribed_) sched_yield();
  else cpu_relax();
}

void ThreadPool::worker_loop(int index) {
  uint32_t seen = 0;
  for (;;) {
    uint32_t gen;
    while ((gen = job_generation_.load(std::memory_order_acquire)) == seen) futex_wait(&job_generation_, seen);
    seen = gen;
    if (stop_.load()) return;
    try {
      (*job_)(index, num_threads_);
    } catch (...) {
      if (!has_error_.exchange(true)) error_ = std::current_exception();
    }
    if (pending_.fetch_sub(1) == 1) futex_wake_all(&pending_);
  }
}

void ThreadPool::run(const std::function<void(int, int)>& fn) {
  if (num_threads_ == 1) {
    fn(0, 1);
    return;
  }
  job_ = &fn;
  has_error_.store(false);
  error_ = nullptr;
  pending_.store(uint32_t(num_threads_ - 1));
  job_generation_.fetch_add(1, std::memory_order_acq_rel);
  futex_wake_all(&job_generation_);
  try {
    fn(0, num_threads_);
  } catch (...) {
    if (!has_error_.exchange(true)) error_ = std::current_exception();
  }
  // Wait for the workers to finish this job.
  int spins = 0;
  for (uint32_t left; (left = pending_.load()) != 0;) {
    if (++spins < kBarrierSpins) wait_step();
    else futex_wait(&pending_, left);
  }
  job_ = nullptr;
  if (has_error_.load()) std::rethrow_exception(error_);
}

void ThreadPool::barrier(bool (*idle)(void* ctx), void* ctx) {
  if (num_threads_ == 1) return;
  uint32_t gen = barrier_generation_.load(std::memory_order_acquire);
  if (barrier_count_.fetch_add(1, std::memory_order_acq_rel) == num_threads_ - 1) {
    barrier_count_.store(0, std::memory_order_relaxed);
    barrier_generation_.fetch_add(1);
    if (barrier_sleepers_.load() > 0) futex_wake_all(&barrier_generation_);
    return;
  }
  int spins = 0;
  while (barrier_generation_.load(std::memory_order_acquire) == gen) {
    if (idle && idle(ctx)) continue;
    idle = nullptr;
    if (++spins < kBarrierSpins) {
      wait_step();
    } else {
      barrier_sleepers_.fetch_add(1);
      futex_wait(&barrier_generation_, gen);
      barrier_sleepers_.fetch_sub(1);
    }
  }
}

}  // namespace ferrum
