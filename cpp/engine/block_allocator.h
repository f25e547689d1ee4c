// Ref-counted allocator of KV blocks with a prefix cache: a full block can be registered under
// the hash of its tokens (chained over all preceding blocks, so a hit means the whole prefix
// matches). Freed blocks that carry a hash stay reusable until evicted, least recently used
// first, when fresh blocks run out.
#pragma once
#include <cstdint>
#include <list>
#include <unordered_map>
#include <vector>

namespace ferrum {

class BlockAllocator {
 public:
  explicit BlockAllocator(int32_t num_blocks);

  int32_t num_blocks() const { return int32_t(ref_.size()); }
  // Blocks an allocate() could hand out now (fresh + cached-but-unreferenced).
  int32_t num_available() const { return int32_t(free_.size() + lru_.size()); }
  int32_t num_used() const { return num_blocks() - num_available(); }
  int32_t num_cached() const { return int32_t(by_hash_.size()); }

  // All or nothing: false (and nothing taken) when fewer than n blocks are available.
  bool allocate(int32_t n, std::vector<int32_t>* out);
  void release(const std::vector<int32_t>& blocks);
  void release(int32_t block);

  // Prefix cache. lookup() takes a reference on the cached block (or returns -1).
  int32_t lookup(uint64_t hash);
  // The cached block for `hash` without taking it (-1 when none); *unreferenced says whether it
  // currently counts as available.
  int32_t peek(uint64_t hash, bool* unreferenced) const;
  void register_hash(int32_t block, uint64_t hash);
  void clear_cache();  // forget every hash (cached free blocks become fresh)

 private:
  void evict_one();
  std::vector<int32_t> ref_;
  std::vector<uint64_t> hash_;     // hash of a registered block
  std::vector<uint8_t> has_hash_;
  std::vector<int32_t> free_;      // fresh blocks, no hash
  std::list<int32_t> lru_;         // unreferenced blocks that keep a hash, oldest first
  std::vector<std::list<int32_t>::iterator> lru_pos_;
  std::vector<uint8_t> in_lru_;
  std::unordered_map<uint64_t, int32_t> by_hash_;
};

// Hash of a block of tokens chained on the previous block's hash.
uint64_t chain_hash(uint64_t previous, const int32_t* tokens, int64_t n);

}  // namespace ferrum
