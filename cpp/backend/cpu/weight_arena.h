// Host memory for the weights a decode streams every token: one run of 2 MiB pages after another.
// Each weight of its own mapping (or the file's page cache) sat on 4 KiB pages scattered over
// physical memory, where the hardware prefetchers stop at every page boundary and every 64th
// cache line costs a TLB walk (under a hypervisor, a two-level one); a 1-2 MB matrix on its own
// mapping did not even get a 2 MiB page. From one large, aligned region the weights stream at
// the machine's read bandwidth.
#pragma once
#include <cstddef>
#include <memory>

namespace ferrum {

class WeightArena {
 public:
  struct Block {
    void* data;
    std::shared_ptr<const void> region;  // keeps the region mapped while the block is in use
  };
  // `bytes` (plus a vector's worth of readable slack), 64-byte aligned. A region is unmapped
  // when the last block in it is gone; the space of a block freed before that is not reused
  // (a bump allocator: meant for a model's weights, loaded once and freed together; each
  // ModelRunner has its own backend and so its own arena).
  Block allocate(size_t bytes);

 private:
  std::weak_ptr<const void> region_;  // the region being filled (not kept alive by the arena)
  size_t used_ = 0;                   // its bytes handed out
};

}  // namespace ferrum
