// Block tables of the sequences that share one paged KV pool. A sequence holds the blocks its
// cached tokens occupy and grows block by block; with the prefix cache on, every full block is
// registered under the chain hash of all tokens up to its end, so a new sequence whose prompt
// starts the same way adopts those blocks (ref-counted) instead of recomputing them.
// No model and no tokens here: the runner writes K/V into the blocks, the scheduler plans with
// the counts and hands in the tokens (which its Sequence owns) when they are computed.
#pragma once
#include <cstdint>
#include <map>
#include <vector>

#include "engine/block_allocator.h"

namespace ferrum {

struct PrefixCacheStats {
  int64_t queries = 0, query_tokens = 0, hit_tokens = 0;
};

class BlockManager {
 public:
  static constexpr int64_t kBlockSize = 16;
  static int64_t blocks_for(int64_t tokens) { return (tokens + kBlockSize - 1) / kBlockSize; }

  BlockManager(int64_t num_blocks, bool prefix_cache);

  int64_t num_blocks() const { return alloc_.num_blocks(); }
  int64_t num_free() const { return alloc_.num_available(); }  // fresh + cached-but-unused
  int64_t num_used() const { return alloc_.num_used(); }
  int64_t num_cached() const { return alloc_.num_cached(); }
  int64_t num_sequences() const { return int64_t(seqs_.size()); }
  bool prefix_cache() const { return prefix_cache_; }
  const PrefixCacheStats& prefix_stats() const { return prefix_stats_; }

  // A sequence shares cached blocks only with sequences of its `domain`: K/V computed with
  // different activation precision (generation's 8-bit matmuls, scoring's f32) are not
  // interchangeable, so each kind of sequence caches in a domain of its own.
  int64_t add_sequence(int64_t domain = 0);
  void release_sequence(int64_t seq);  // full blocks stay cached for later prompts
  int64_t length(int64_t seq) const;   // tokens whose K/V are in the cache
  const std::vector<int32_t>& blocks(int64_t seq) const;

  // Adopts the longest cached prefix of tokens[0, limit) (whole blocks, leaving at least the
  // last of them to compute, so there are logits at `limit - 1`); returns how many tokens it
  // now holds. Empty sequences only.
  int64_t adopt_prefix(int64_t seq, const std::vector<int32_t>& tokens, int64_t limit);
  // What adopt_prefix would do for a sequence of `domain`, without doing it: the blocks it would
  // adopt, and how many of those sit unreferenced in the cache (adopting them takes them out of
  // num_free()).
  void probe_prefix(const std::vector<int32_t>& tokens, int64_t limit, int64_t domain, int64_t* blocks,
                    int64_t* blocks_now_free) const;

  // More blocks `seq` needs before `extra` more tokens can be written.
  int64_t blocks_needed(int64_t seq, int64_t extra) const;
  // Takes those blocks (ResourceError, nothing taken, when too few are free).
  void grow(int64_t seq, int64_t extra);
  // The K/V of the sequence's tokens up to `length` are written (after grow). `tokens` are the
  // sequence's tokens from position 0, whose newly full blocks are registered in the prefix
  // cache; null registers none.
  void computed(int64_t seq, const int32_t* tokens, int64_t length);
  // Keeps the K/V of at most the first `length` tokens and releases the blocks beyond them.
  // A block in the prefix cache is never written again: when `length` ends inside one, the
  // sequence lets it go and keeps less. Returns the length kept.
  int64_t truncate(int64_t seq, int64_t length);

 private:
  struct Table {
    std::vector<int32_t> blocks;
    int64_t length = 0;            // tokens whose K/V are in the cache
    std::vector<uint64_t> hashes;  // chain hash of each leading full block (registered in the cache)
    uint64_t seed = 0;             // what the first block's hash continues from (the domain's)
    uint64_t last_hash() const { return hashes.empty() ? seed : hashes.back(); }
  };
  Table& table(int64_t seq);
  const Table& table(int64_t seq) const;

  BlockAllocator alloc_;
  bool prefix_cache_;
  std::map<int64_t, Table> seqs_;
  int64_t next_seq_ = 1;
  PrefixCacheStats prefix_stats_;
};

}  // namespace ferrum
