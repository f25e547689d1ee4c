// Internals: thread pool, the CPU weight arena, tensor views, the block allocator and its prefix
// cache.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <numeric>
#include <set>
#include <thread>

#include "backend/backend.h"
#include "backend/cpu/row_claims.h"
#include "backend/cpu/weight_arena.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "engine/block_allocator.h"

using namespace ferrum;

TEST(ThreadPool, EveryThreadRunsAndCallerParticipates) {
  for (int n : {1, 2, 3}) {
    ThreadPool pool(n);
    std::atomic<int> mask{0};
    pool.run([&](int i, int k) {
      EXPECT_EQ(k, n);
      mask |= 1 << i;
    });
    EXPECT_EQ(mask.load(), (1 << n) - 1);
  }
}

TEST(ThreadPool, BarrierOrdersPhases) {
  ThreadPool pool(2);
  std::vector<int> data(1000, 0);
  for (int rep = 0; rep < 200; ++rep) {
    pool.run([&](int i, int k) {
      int64_t b, e;
      split_range(int64_t(data.size()), i, k, &b, &e);
      for (int64_t j = b; j < e; ++j) data[size_t(j)] = rep;
      pool.barrier();
      // after the barrier every element written in this phase is visible to every thread
      for (int v : data) ASSERT_EQ(v, rep);
      pool.barrier();
    });
  }
}

TEST(ThreadPool, ExceptionsPropagateAndPoolSurvives) {
  ThreadPool pool(2);
  EXPECT_THROW(pool.run([](int i, int) { if (i == 1) throw std::runtime_error("boom"); }), std::runtime_error);
  std::atomic<int> count{0};
  pool.run([&](int, int) { count++; });
  EXPECT_EQ(count.load(), 2);
}

TEST(ThreadPool, WaitingThreadsRunIdleWorkUntilItIsDoneOrTheBarrierOpens) {
  ThreadPool pool(2);
  struct Idle {
    std::atomic<int> steps{0};
    int limit;
    static bool step(void* self) {
      Idle& d = *static_cast<Idle*>(self);
      return ++d.steps < d.limit;
    }
  };
  for (int limit : {1, 5, 1 << 30}) {
    Idle idle{{0}, limit};
    std::atomic<bool> late_done{false};
    pool.run([&](int i, int) {
      if (i == 1) {  // the late thread: the other waits, doing its idle work meanwhile
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        late_done = true;
        pool.barrier();
      } else {
        pool.barrier(&Idle::step, &idle);
        EXPECT_TRUE(late_done.load());  // idle work does not open the barrier
      }
    });
    // A finite job runs to its end (step returned false); an endless one stops at the opening.
    if (limit < 100) EXPECT_EQ(idle.steps.load(), limit);
    else EXPECT_GT(idle.steps.load(), 0);
  }
}

// Every unit of a matmul is done exactly once, by its owner or a helper, whatever the threads'
// speeds; helpers take from the back of a slow thread's share.
TEST(RowClaims, EveryUnitOnceWhateverTheThreadsSpeeds) {
  for (int n : {1, 2, 3}) {
    ThreadPool pool(n);
    RowClaims claims(n);
    for (int64_t units : {0, 1, 7, 100, 1000}) {
      for (int slow = 0; slow < n; ++slow) {
        std::vector<std::atomic<int>> done(static_cast<size_t>(units));
        std::vector<int> by(static_cast<size_t>(units), -1);
        for (int rep = 0; rep < 3; ++rep) {  // a command runs again: its shares start afresh
          for (auto& d : done) d = 0;
          pool.run([&](int i, int k) {
            claims.run(i, k, [&](int j) { return k - 1 - j; }, units, 2, [&](int64_t lo, int64_t hi) {
              ASSERT_LT(lo, hi);
              if (i == slow && n > 1) std::this_thread::sleep_for(std::chrono::microseconds(200));
              for (int64_t u = lo; u < hi; ++u) {
                done[size_t(u)]++;
                by[size_t(u)] = i;
              }
            });
          });
          for (int64_t u = 0; u < units; ++u) ASSERT_EQ(done[size_t(u)].load(), 1) << "unit " << u;
        }
        if (n == 2 && units == 1000) {  // the fast thread took the back of the slow one's share
          int64_t b, e;
          split_range(units, n - 1 - slow, n, &b, &e);
          EXPECT_NE(by[size_t(e - 1)], slow);
        }
      }
    }
  }
}

TEST(SplitRange, CoversEverythingOnce) {
  for (int64_t n : {0, 1, 7, 100}) {
    int64_t covered = 0, prev = 0;
    for (int i = 0; i < 3; ++i) {
      int64_t b, e;
      split_range(n, i, 3, &b, &e);
      EXPECT_EQ(b, prev);
      covered += e - b;
      prev = e;
    }
    EXPECT_EQ(covered, n);
  }
}

TEST(WeightArena, PacksAlignedBlocksInOrderAndUnmapsWithTheLastOne) {
  WeightArena arena;
  std::weak_ptr<const void> first_region;
  {
    const size_t sizes[] = {1000, 64, 3 << 20, 1};
    std::vector<WeightArena::Block> blocks;
    for (size_t n : sizes) {
      blocks.push_back(arena.allocate(n));
      std::memset(blocks.back().data, 0x5a, n + 64);  // the block and its vector of slack
    }
    const uintptr_t start = reinterpret_cast<uintptr_t>(blocks[0].data);
    EXPECT_EQ(start % (2u << 20), 0u);  // a region starts on a 2 MiB page
    for (size_t i = 0; i < blocks.size(); ++i) {
      const uintptr_t p = reinterpret_cast<uintptr_t>(blocks[i].data);
      EXPECT_EQ(p % 64, 0u);
      EXPECT_EQ(blocks[i].region, blocks[0].region);  // one region, filled in order
      if (i > 0) {
        EXPECT_GE(p, reinterpret_cast<uintptr_t>(blocks[i - 1].data) + sizes[i - 1] + 64);
      }
    }
    // Larger than a region: a region of its own, while the current one goes on filling.
    WeightArena::Block big = arena.allocate(size_t(300) << 20);
    EXPECT_NE(big.region, blocks[0].region);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(big.data) % (2u << 20), 0u);
    blocks.push_back(arena.allocate(10));
    EXPECT_EQ(blocks.back().region, blocks[0].region);
    first_region = blocks[0].region;
    blocks.erase(blocks.begin());
    EXPECT_FALSE(first_region.expired());
  }
  EXPECT_TRUE(first_region.expired());  // the last block gone: the region is unmapped
  WeightArena::Block again = arena.allocate(100);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(again.data) % (2u << 20), 0u);  // a fresh region
}

TEST(Tensor, SliceAndReshapeKeepStorage) {
  auto be = make_backend("cpu", 1);
  Tensor t = be->alloc(DType::F32, {4, 6});
  Tensor s = t.slice(1, 2);
  EXPECT_EQ(s.offset, size_t(6 * 4));
  EXPECT_EQ(s.shape, (Shape{2, 6}));
  EXPECT_EQ(s.storage, t.storage);
  EXPECT_EQ(t.reshape({24}).numel(), 24);
  EXPECT_THROW(t.slice(3, 2), ValueError);
  EXPECT_THROW(t.reshape({5, 5}), ValueError);
  Tensor q = be->alloc(DType::Q4_0, {2, 64});
  EXPECT_EQ(q.nbytes(), size_t(2 * 2 * 18));
}

TEST(BlockAllocator, AllocateIsAllOrNothing) {
  BlockAllocator a(4);
  std::vector<int32_t> got;
  EXPECT_TRUE(a.allocate(3, &got));
  EXPECT_EQ(a.num_available(), 1);
  std::vector<int32_t> more;
  EXPECT_FALSE(a.allocate(2, &more));
  EXPECT_TRUE(more.empty());
  EXPECT_EQ(a.num_available(), 1);
  a.release(got);
  EXPECT_EQ(a.num_available(), 4);
  EXPECT_EQ(std::set<int32_t>(got.begin(), got.end()).size(), 3u);
  EXPECT_THROW(a.release(got[0]), std::logic_error);  // double free is caught
}

TEST(BlockAllocator, PrefixCacheSharesRefcountsAndEvictsLru) {
  BlockAllocator a(3);
  std::vector<int32_t> b;
  ASSERT_TRUE(a.allocate(2, &b));
  a.register_hash(b[0], 11);
  a.register_hash(b[1], 22);
  EXPECT_EQ(a.lookup(11), b[0]);  // shared: refcount 2
  a.release(b[0]);
  EXPECT_EQ(a.num_available(), 1);  // still held once
  a.release(b);                     // now both unreferenced but cached
  EXPECT_EQ(a.num_available(), 3);
  EXPECT_EQ(a.num_cached(), 2);
  EXPECT_EQ(a.lookup(22), b[1]);  // revived from the LRU
  std::vector<int32_t> c;
  ASSERT_TRUE(a.allocate(2, &c));  // takes the fresh block, then evicts the cached 11
  EXPECT_EQ(a.lookup(11), -1);
  EXPECT_EQ(a.num_cached(), 1);
  a.release(c);
  a.release(b[1]);
  EXPECT_EQ(a.num_used(), 0);
}

TEST(BlockAllocator, ChainHashDependsOnEveryPrecedingToken) {
  std::vector<int32_t> t(32);
  std::iota(t.begin(), t.end(), 0);
  uint64_t h1 = chain_hash(chain_hash(0, t.data(), 16), t.data() + 16, 16);
  t[3] = 99;
  uint64_t h2 = chain_hash(chain_hash(0, t.data(), 16), t.data() + 16, 16);
  EXPECT_NE(h1, h2);
}
