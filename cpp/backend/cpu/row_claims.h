// Dealing a decode matmul's weight rows to threads so that none waits at the barrier for
// another. Each thread owns a contiguous share, as in a static split (its weights stream in
// address order), and claims it front to back: all but its last eighth at once, then small
// pieces; a thread done with its own share takes small pieces from the back of the others'.
// The threads of a static split finish apart (one core's memory stream runs slower than the
// other's for a while), and one thread reading alone gets less bandwidth than two. (Claiming
// small pieces of the whole matrix from one counter instead interleaves the two streams, which
// is slower: docs/performance.md.)
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "core/thread_pool.h"

namespace ferrum {

class RowClaims {
 public:
  static constexpr int64_t kMaxUnits = int64_t(1) << 24;

  explicit RowClaims(int threads) : shares_(new Share[size_t(threads)]), runs_(new Runs[size_t(threads)]) {}

  // Runs work(begin, end) over pieces of [0, units) (units < kMaxUnits) until every unit is
  // done; every thread of the pool calls it, in the same command. owner_part(i) is the part of
  // a static split in nth that thread i owns; min_piece is the smallest piece, in units.
  template <class Work, class OwnerPart>
  void run(int ith, int nth, OwnerPart&& owner_part, int64_t units, int64_t min_piece, Work&& work) {
    // Every thread runs each command once per run, so its own count of runs names this one:
    // the first thread to reach a share in this run sets it up, the owner or a helper whose
    // owner is late (a worker still waking up).
    const uint64_t run = ++runs_[size_t(ith)].count & 0xffff;
    const auto reach = [&](int i) -> Share& {
      int64_t b, e;
      split_range(units, owner_part(i), nth, &b, &e);
      Share& s = shares_[size_t(i)];
      for (uint64_t cur = s.bounds.load(std::memory_order_acquire); cur >> 48 != run;)
        if (s.bounds.compare_exchange_weak(cur, pack(run, b, e), std::memory_order_acq_rel)) break;
      return s;
    };
    // All but the share's last eighth in one piece: kernels called on many pieces of a share run
    // slower (k-quants; each call starts its stream afresh).
    Share& own = reach(ith);
    const uint64_t set = own.bounds.load(std::memory_order_acquire);
    const int64_t share = back(set) - front(set);
    const int64_t tail = std::min(share, std::max(min_piece, share / 8));
    for (int64_t lo, hi, piece = share - tail; claim(own, true, piece > 0 ? piece : min_piece, &lo, &hi); piece = 0)
      work(lo, hi);
    for (int k = 1; k < nth; ++k) {
      Share& other = reach((ith + k) % nth);
      for (int64_t lo, hi; claim(other, false, min_piece, &lo, &hi);) work(lo, hi);
    }
  }

 private:
  // The run it was set up for (16 bits), then [front, back) not yet claimed (24 bits each).
  struct alignas(64) Share {
    std::atomic<uint64_t> bounds{0};
  };
  struct alignas(64) Runs {
    uint64_t count = 0;
  };
  static uint64_t pack(uint64_t run, int64_t front, int64_t back) {
    return run << 48 | uint64_t(front) << 24 | uint64_t(back);
  }
  static int64_t front(uint64_t s) { return int64_t(s >> 24 & 0xffffff); }
  static int64_t back(uint64_t s) { return int64_t(s & 0xffffff); }

  // Takes up to `piece` units from the front (the owner) or the back (a helper) of what is left.
  static bool claim(Share& s, bool from_front, int64_t piece, int64_t* lo, int64_t* hi) {
    uint64_t cur = s.bounds.load(std::memory_order_acquire);
    for (;;) {
      const int64_t f = front(cur), bk = back(cur);
      if (f >= bk) return false;
      const int64_t take = std::min(bk - f, piece);
      *lo = from_front ? f : bk - take;
      *hi = *lo + take;
      const uint64_t next = from_front ? pack(cur >> 48, f + take, bk) : pack(cur >> 48, f, bk - take);
      if (s.bounds.compare_exchange_weak(cur, next, std::memory_order_acq_rel)) return true;
    }
  }

  std::unique_ptr<Share[]> shares_;
  std::unique_ptr<Runs[]> runs_;
};

}  // namespace ferrum
