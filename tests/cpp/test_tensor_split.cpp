// How a model divides between tensor-parallel ranks (model/tensor_split.h): every rank's shares
// tile the model's rows, KV heads are divided or shared, and splits that cannot be made are
// refused.
#include <gtest/gtest.h>

#include "core/error.h"
#include "model/tensor_split.h"

using namespace ferrum;

namespace {
ModelConfig config(int64_t heads, int64_t kv_heads, int64_t intermediate, int64_t vocab) {
  ModelConfig c;
  c.arch = "llama";
  c.hidden = 64;
  c.layers = 2;
  c.heads = heads;
  c.kv_heads = kv_heads;
  c.head_dim = 16;
  c.intermediate = intermediate;
  c.vocab = vocab;
  return c;
}
}  // namespace

TEST(TensorSplit, OneRankHoldsTheWholeModel) {
  const ModelConfig c = config(8, 4, 172, 515);
  const TensorSplit s = split_model(c, 0, 1);
  EXPECT_TRUE(s.whole());
  EXPECT_EQ(s.heads, 8);
  EXPECT_EQ(s.kv_heads, 4);
  EXPECT_EQ(s.intermediate, 172);
  EXPECT_EQ(s.vocab, 515);
  EXPECT_EQ(s.local(c).q_dim(), c.q_dim());
}

TEST(TensorSplit, SharesTileTheRows) {
  const ModelConfig c = config(16, 8, 1024, 49160);
  for (int ranks : {2, 4, 8}) {
    int64_t head = 0, kv = 0, inter = 0, vocab = 0;
    for (int r = 0; r < ranks; ++r) {
      const TensorSplit s = split_model(c, r, ranks);
      EXPECT_EQ(s.head0, head);
      EXPECT_EQ(s.kv_head0, kv);
      EXPECT_EQ(s.inter0, inter);
      EXPECT_EQ(s.vocab0, vocab);
      // a rank's query heads are the ones its KV heads serve
      EXPECT_EQ(s.heads * c.kv_heads, s.kv_heads * c.heads);
      EXPECT_GT(s.vocab, 0);
      if (r + 1 < ranks) EXPECT_EQ(s.vocab % 16, 0);  // whole row groups but on the last rank
      head += s.heads, kv += s.kv_heads, inter += s.intermediate, vocab += s.vocab;
      const ModelConfig l = s.local(c);
      EXPECT_EQ(l.heads, s.heads);
      EXPECT_EQ(l.vocab, s.vocab);
      EXPECT_EQ(l.hidden, c.hidden);
    }
    EXPECT_EQ(head, c.heads);
    EXPECT_EQ(kv, c.kv_heads);
    EXPECT_EQ(inter, c.intermediate);
    EXPECT_EQ(vocab, c.vocab);
  }
}

TEST(TensorSplit, FewerKvHeadsThanRanksAreShared) {
  const ModelConfig c = config(8, 2, 128, 512);
  for (int r = 0; r < 4; ++r) {
    const TensorSplit s = split_model(c, r, 4);
    EXPECT_EQ(s.kv_heads, 1);
    EXPECT_EQ(s.kv_head0, r / 2);  // ranks 0, 1 hold KV head 0; ranks 2, 3 KV head 1
    EXPECT_EQ(s.head0, 2 * r);     // query heads 2r, 2r + 1: both in that KV head's group of 4
    EXPECT_EQ(s.head0 / 4, s.kv_head0);
  }
}

TEST(TensorSplit, SplitsThatCannotBeMadeAreRefused) {
  EXPECT_THROW(split_model(config(6, 2, 128, 512), 0, 4), ValueError);   // heads
  EXPECT_THROW(split_model(config(6, 3, 128, 512), 0, 2), ValueError);   // 3 KV heads, 2 ranks
  EXPECT_THROW(split_model(config(8, 4, 172, 512), 0, 8), ValueError);   // intermediate
  EXPECT_THROW(split_model(config(8, 4, 128, 3), 0, 4), ValueError);     // vocabulary
  EXPECT_THROW(split_model(config(8, 4, 128, 512), 2, 2), ValueError);   // rank
  ModelConfig moe = config(8, 4, 128, 512);
  moe.experts = 8;
  moe.experts_per_token = 2;
  moe.expert_intermediate = 40;
  moe.moe_layers = {true, true};
  EXPECT_THROW(split_model(moe, 0, 16), ValueError);
  EXPECT_NO_THROW(split_model(moe, 0, 8));
  try {
    split_model(config(6, 3, 128, 512), 0, 2);
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("3 KV heads"), std::string::npos) << e.what();
  }
}
