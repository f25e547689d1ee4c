#include "engine/block_allocator.h"

#include "core/error.h"

namespace ferrum {

BlockAllocator::BlockAllocator(int32_t n)
    : ref_(size_t(n), 0), hash_(size_t(n), 0), has_hash_(size_t(n), 0), lru_pos_(size_t(n)), in_lru_(size_t(n), 0) {
  free_.reserve(size_t(n));
  for (int32_t b = n - 1; b >= 0; --b) free_.push_back(b);  // hand out low ids first
}

void BlockAllocator::evict_one() {
  int32_t b = lru_.front();
  lru_.pop_front();
  in_lru_[size_t(b)] = 0;
  by_hash_.erase(hash_[size_t(b)]);
  has_hash_[size_t(b)] = 0;
  free_.push_back(b);
}

bool BlockAllocator::allocate(int32_t n, std::vector<int32_t>* out) {
  if (n < 0 || n > num_available()) return false;
  for (int32_t i = 0; i < n; ++i) {
    if (free_.empty()) evict_one();
    int32_t b = free_.back();
    free_.pop_back();
    ref_[size_t(b)] = 1;
    out->push_back(b);
  }
  return true;
}

void BlockAllocator::release(int32_t b) {
  if (b < 0 || b >= num_blocks() || ref_[size_t(b)] <= 0)
    throw std::logic_error("BlockAllocator: releasing block " + std::to_string(b) + " that is not held");
  if (--ref_[size_t(b)] > 0) return;
  if (has_hash_[size_t(b)]) {
    lru_.push_back(b);
    lru_pos_[size_t(b)] = std::prev(lru_.end());
    in_lru_[size_t(b)] = 1;
  } else {
    free_.push_back(b);
  }
}

void BlockAllocator::release(const std::vector<int32_t>& blocks) {
  for (int32_t b : blocks) release(b);
}

int32_t BlockAllocator::lookup(uint64_t hash) {
  auto it = by_hash_.find(hash);
  if (it == by_hash_.end()) return -1;
  int32_t b = it->second;
  if (in_lru_[size_t(b)]) {
    lru_.erase(lru_pos_[size_t(b)]);
    in_lru_[size_t(b)] = 0;
  }
  ++ref_[size_t(b)];
  return b;
}

int32_t BlockAllocator::peek(uint64_t hash, bool* unreferenced) const {
  auto it = by_hash_.find(hash);
  if (it == by_hash_.end()) return -1;
  *unreferenced = in_lru_[size_t(it->second)] != 0;
  return it->second;
}

void BlockAllocator::register_hash(int32_t b, uint64_t hash) {
  if (has_hash_[size_t(b)] || by_hash_.count(hash)) return;  // first writer wins
  hash_[size_t(b)] = hash;
  has_hash_[size_t(b)] = 1;
  by_hash_[hash] = b;
}

void BlockAllocator::clear_cache() {
  while (!lru_.empty()) evict_one();
  for (auto& [h, b] : by_hash_) has_hash_[size_t(b)] = 0;
  by_hash_.clear();
}

uint64_t chain_hash(uint64_t previous, const int32_t* tokens, int64_t n) {
  // FNV-1a over the previous hash and the token ids, then a 64-bit finalizer (splitmix).
  uint64_t h = 1469598103934665603ull ^ previous;
  for (int64_t i = 0; i < n; ++i) {
    h ^= uint32_t(tokens[i]);
    h *= 1099511628211ull;
  }
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  return h ^ (h >> 31);
}

}  // namespace ferrum
