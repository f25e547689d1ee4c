#include "engine/block_manager.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "core/error.h"

namespace ferrum {

namespace {
int32_t checked_block_count(int64_t n) {
  const int64_t most = INT32_MAX / BlockManager::kBlockSize;  // slots are int32
  if (n < 1 || n > most) throw ValueError("the KV pool needs between 1 and " + std::to_string(most) + " blocks");
  return int32_t(n);
}

// The chain hash a domain's first block continues from; domain 0 keeps the plain chain.
uint64_t domain_seed(int64_t domain) { return uint64_t(domain) * 0x9e3779b97f4a7c15ull; }

// Leading full blocks of tokens[0, limit) that adopt_prefix may take (the last token stays).
int64_t adoptable_blocks(const std::vector<int32_t>& tokens, int64_t limit) {
  const int64_t n = std::min<int64_t>(limit, int64_t(tokens.size()));
  return n < 2 ? 0 : (n - 1) / BlockManager::kBlockSize;
}
}  // namespace

BlockManager::BlockManager(int64_t num_blocks, bool prefix_cache)
    : alloc_(checked_block_count(num_blocks)), prefix_cache_(prefix_cache) {}

BlockManager::Table& BlockManager::table(int64_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw ValueError("unknown sequence " + std::to_string(seq));
  return it->second;
}

const BlockManager::Table& BlockManager::table(int64_t seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw ValueError("unknown sequence " + std::to_string(seq));
  return it->second;
}

int64_t BlockManager::add_sequence(int64_t domain) {
  Table t;
  t.seed = domain_seed(domain);
  seqs_[next_seq_] = t;
  return next_seq_++;
}

void BlockManager::release_sequence(int64_t seq) {
  alloc_.release(table(seq).blocks);
  seqs_.erase(seq);
}

int64_t BlockManager::length(int64_t seq) const { return table(seq).length; }

const std::vector<int32_t>& BlockManager::blocks(int64_t seq) const { return table(seq).blocks; }

void BlockManager::probe_prefix(const std::vector<int32_t>& tokens, int64_t limit, int64_t domain, int64_t* blocks,
                                int64_t* blocks_now_free) const {
  *blocks = *blocks_now_free = 0;
  if (!prefix_cache_) return;
  uint64_t h = domain_seed(domain);
  for (int64_t b = 0; b < adoptable_blocks(tokens, limit); ++b) {
    h = chain_hash(h, tokens.data() + b * kBlockSize, kBlockSize);
    bool unreferenced = false;
    if (alloc_.peek(h, &unreferenced) < 0) break;
    ++*blocks;
    *blocks_now_free += unreferenced;
  }
}

int64_t BlockManager::adopt_prefix(int64_t seq, const std::vector<int32_t>& tokens, int64_t limit) {
  Table& t = table(seq);
  if (t.length != 0) throw ValueError("adopt_prefix needs an empty sequence");
  prefix_stats_.queries++;
  prefix_stats_.query_tokens += std::min<int64_t>(limit, int64_t(tokens.size()));
  if (!prefix_cache_) return 0;
  for (int64_t b = 0; b < adoptable_blocks(tokens, limit); ++b) {
    uint64_t next = chain_hash(t.last_hash(), tokens.data() + b * kBlockSize, kBlockSize);
    int32_t block = alloc_.lookup(next);
    if (block < 0) break;
    t.hashes.push_back(next);
    t.blocks.push_back(block);
  }
  t.length = int64_t(t.blocks.size()) * kBlockSize;
  prefix_stats_.hit_tokens += t.length;
  return t.length;
}

int64_t BlockManager::blocks_needed(int64_t seq, int64_t extra) const {
  const Table& t = table(seq);
  return std::max<int64_t>(0, blocks_for(t.length + extra) - int64_t(t.blocks.size()));
}

void BlockManager::grow(int64_t seq, int64_t extra) {
  const int64_t need = blocks_needed(seq, extra);
  if (need > num_free())
    throw ResourceError("KV cache exhausted: " + std::to_string(need) + " more blocks needed, " +
                        std::to_string(num_free()) + " of " + std::to_string(num_blocks()) + " are free");
  alloc_.allocate(int32_t(need), &table(seq).blocks);
}

void BlockManager::computed(int64_t seq, const int32_t* tokens, int64_t length) {
  Table& t = table(seq);
  if (length < t.length || blocks_for(length) > int64_t(t.blocks.size()))
    throw std::logic_error("BlockManager::computed outside the blocks the sequence holds");
  t.length = length;
  if (!prefix_cache_ || tokens == nullptr) return;
  for (size_t b = t.hashes.size(); b < size_t(length / kBlockSize); ++b) {
    t.hashes.push_back(chain_hash(t.last_hash(), tokens + b * kBlockSize, kBlockSize));
    alloc_.register_hash(t.blocks[b], t.hashes.back());
  }
}

int64_t BlockManager::truncate(int64_t seq, int64_t length) {
  Table& t = table(seq);
  length = std::min(length, t.length);
  if (length < int64_t(t.hashes.size()) * kBlockSize) {  // back to the start of the cached block it ends in
    t.hashes.resize(size_t(length / kBlockSize));
    length = int64_t(t.hashes.size()) * kBlockSize;
  }
  const size_t keep = size_t(blocks_for(length));
  if (keep < t.blocks.size()) {
    alloc_.release(std::vector<int32_t>(t.blocks.begin() + int64_t(keep), t.blocks.end()));
    t.blocks.resize(keep);
  }
  t.length = length;
  return length;
}

}  // namespace ferrum
