// One completion being generated: its tokens (prompt, then generated), how many of them have
// K/V in the cache, and which BlockManager sequence holds those blocks while it runs.
#pragma once
#include <cstdint>
#include <vector>

namespace ferrum {

struct Sequence {
  int64_t id = 0;                // engine-wide, increasing: a smaller id arrived earlier
  std::vector<int32_t> tokens;   // prompt + generated
  int64_t prompt_len = 0;
  int64_t computed = 0;          // leading tokens whose K/V are in the cache
  int64_t kv = -1;               // BlockManager sequence while it holds blocks, else -1
  int64_t preemptions = 0;

  int64_t length() const { return int64_t(tokens.size()); }
  int64_t generated() const { return length() - prompt_len; }
  // Tokens still to compute before the next sample; 1 for a decode.
  int64_t remaining() const { return length() - computed; }
};

}  // namespace ferrum
