// The scheduler's invariants, with a real BlockManager and no model: a "forward" here computes
// nothing (Scheduler::computed records the scheduled tokens as cached), and "sampling" appends a
// token derived from the sequence.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <random>
#include <set>

#include "core/error.h"
#include "engine/block_manager.h"
#include "engine/scheduler.h"

using namespace ferrum;

namespace {

constexpr int64_t kBs = BlockManager::kBlockSize;

std::vector<int32_t> prompt_of(int64_t n, int32_t first = 1) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[size_t(i)] = first + int32_t(i % 97);
  return p;
}

struct Harness {
  BlockManager blocks;
  Scheduler sched;
  std::map<int64_t, int64_t> generated;  // per sequence
  std::map<int64_t, int64_t> max_tokens;

  Harness(int64_t num_blocks, int64_t max_seqs, int64_t budget, int64_t max_model_len = 4096, bool prefix = false)
      : blocks(num_blocks, prefix), sched(blocks, SchedulerOptions{max_seqs, budget, max_model_len}) {}

  int64_t add(int64_t prompt_len, int64_t max_new, int32_t first = 1) {
    int64_t id = sched.add(prompt_of(prompt_len, first));
    max_tokens[id] = max_new;
    return id;
  }

  // One step: schedule, "compute", then sample every row; returns the plan.
  SchedulerOutput step() {
    SchedulerOutput out = sched.schedule();
    sched.computed(out);
    for (const ScheduledChunk& c : out.chunks) {
      if (!c.sample) continue;
      const Sequence& s = sched.sequence(c.seq);
      const int32_t token = int32_t((c.seq * 31 + s.length()) % 500 + 3);
      if (++generated[c.seq] >= max_tokens[c.seq] || sched.append_token(c.seq, token)) sched.finish(c.seq);
    }
    return out;
  }

  void run_to_end(int64_t max_steps = 100000) {
    for (int64_t i = 0; i < max_steps && sched.has_unfinished(); ++i) step();
    ASSERT_FALSE(sched.has_unfinished());
  }
};

}  // namespace

TEST(Scheduler, DecodesFirstThenPromptChunksWithinTheTokenBudget) {
  Harness h(64, 8, 8);
  const int64_t a = h.add(3, 100);
  SchedulerOutput s1 = h.step();
  ASSERT_EQ(s1.chunks.size(), 1u);
  EXPECT_EQ(s1.chunks[0].count, 3);
  EXPECT_TRUE(s1.chunks[0].sample);
  const int64_t b = h.add(20, 100);
  for (int64_t start : {0, 7}) {
    SchedulerOutput s = h.step();
    ASSERT_EQ(s.chunks.size(), 2u);
    EXPECT_EQ(s.chunks[0].seq, a);
    EXPECT_EQ(s.chunks[0].count, 1);
    EXPECT_EQ(s.chunks[1].seq, b);
    EXPECT_EQ(s.chunks[1].start, start);
    EXPECT_EQ(s.chunks[1].count, 7);
    EXPECT_FALSE(s.chunks[1].sample);
    EXPECT_EQ(s.num_tokens, 8);
  }
  SchedulerOutput s4 = h.step();
  ASSERT_EQ(s4.chunks.size(), 2u);
  EXPECT_EQ(s4.chunks[1].count, 6);
  EXPECT_TRUE(s4.chunks[1].sample);  // the prompt is complete: its last row is sampled
  h.sched.finish(a);
  h.sched.finish(b);
  EXPECT_EQ(h.blocks.num_used(), 0);
}

TEST(Scheduler, NeverMoreThanMaxNumSeqsRunning) {
  Harness h(256, 3, 64);
  for (int i = 0; i < 10; ++i) h.add(5 + i, 4);
  while (h.sched.has_unfinished()) {
    SchedulerOutput s = h.step();
    EXPECT_LE(h.sched.running().size(), 3u);
    EXPECT_LE(s.chunks.size(), 3u);
  }
  EXPECT_EQ(h.blocks.num_used(), 0);
}

TEST(Scheduler, PreemptsTheYoungestAndRecomputesItsTokens) {
  // 4 blocks: three sequences of 15-token prompts fit at first and then outgrow the pool.
  Harness h(4, 8, 64);
  const int64_t ids[] = {h.add(15, 40), h.add(15, 40, 7), h.add(15, 40, 9)};
  bool seen = false;
  for (int step = 0; step < 200 && h.sched.has_unfinished(); ++step) {
    std::set<int64_t> running_before = h.sched.running();
    std::map<int64_t, std::vector<int32_t>> tokens_before;
    std::set<int64_t> preempted_before;
    for (int64_t id : ids)
      if (h.sched.contains(id)) {
        tokens_before[id] = h.sched.sequence(id).tokens;
        if (h.sched.sequence(id).preemptions > 0) preempted_before.insert(id);
      }
    SchedulerOutput s = h.step();
    for (int64_t victim : s.preempted) {
      seen = true;
      // The youngest of those running, and none of those still running is younger.
      EXPECT_TRUE(running_before.count(victim));
      for (int64_t r : h.sched.running()) EXPECT_LT(r, victim);
      const Sequence& v = h.sched.sequence(victim);
      EXPECT_EQ(v.kv, -1);
      EXPECT_EQ(v.computed, 0);
      EXPECT_EQ(v.tokens, tokens_before[victim]);  // what it generated is kept, to recompute
      EXPECT_TRUE(h.sched.waiting().count(victim));
      for (const ScheduledChunk& c : s.chunks) EXPECT_NE(c.seq, victim);
    }
    // A readmitted sequence recomputes everything it holds in one chunk and samples its next token.
    for (const ScheduledChunk& c : s.chunks)
      if (preempted_before.count(c.seq) && c.start == 0) {
        EXPECT_EQ(c.count, int64_t(tokens_before[c.seq].size()));
        EXPECT_TRUE(c.sample);
      }
    EXPECT_LE(h.blocks.num_used(), 4);
  }
  EXPECT_TRUE(seen);
  EXPECT_FALSE(h.sched.has_unfinished());
  for (int64_t id : ids) EXPECT_EQ(h.generated[id], 40);  // every one got all its tokens
  EXPECT_EQ(h.blocks.num_used(), 0);
}

TEST(Scheduler, OldestAloneFillingThePoolEnds) {
  Harness h(2, 8, 64);
  const int64_t a = h.add(5, 1000);
  int64_t ended_at = -1;
  for (int step = 0; step < 100 && ended_at < 0; ++step) {
    SchedulerOutput s = h.step();
    if (!s.ended.empty()) {
      EXPECT_EQ(s.ended, std::vector<int64_t>{a});
      ended_at = step;
    }
  }
  ASSERT_GE(ended_at, 0);
  EXPECT_FALSE(h.sched.contains(a));
  EXPECT_EQ(h.generated[a], 2 * kBs - 5 + 1);  // every slot was used, then one more token sampled
  EXPECT_EQ(h.blocks.num_used(), 0);
}

TEST(Scheduler, AdmissionWaitsUntilTheWholeSequenceFits) {
  Harness h(3, 8, 64);
  const int64_t a = h.add(40, 3);  // needs all 3 blocks (41 tokens)
  const int64_t b = h.add(5, 3);
  SchedulerOutput s1 = h.step();
  ASSERT_EQ(s1.chunks.size(), 1u);
  EXPECT_EQ(s1.chunks[0].seq, a);
  EXPECT_TRUE(h.sched.waiting().count(b));
  while (h.sched.contains(a)) {
    SchedulerOutput s = h.step();
    for (const ScheduledChunk& c : s.chunks) EXPECT_EQ(c.seq, a);
  }
  SchedulerOutput s = h.step();
  ASSERT_EQ(s.chunks.size(), 1u);
  EXPECT_EQ(s.chunks[0].seq, b);
  h.run_to_end();
  EXPECT_EQ(h.blocks.num_used(), 0);
}

TEST(Scheduler, RejectsWhatCanNeverRun) {
  BlockManager blocks(4, true);
  Scheduler s(blocks, SchedulerOptions{4, 16, 100});
  EXPECT_THROW(s.add({}), ValueError);
  EXPECT_THROW(s.add(prompt_of(100)), ValueError);  // no room for a generated token
  EXPECT_THROW(s.add(prompt_of(64)), ValueError);   // 65 tokens need 5 blocks of 4
  EXPECT_NO_THROW(s.add(prompt_of(63)));
  EXPECT_THROW(Scheduler(blocks, SchedulerOptions{0, 16, 100}), ValueError);
  EXPECT_THROW(Scheduler(blocks, SchedulerOptions{4, 0, 100}), ValueError);
  EXPECT_THROW(BlockManager(0, true), ValueError);
  EXPECT_THROW(BlockManager(-5, true), ValueError);
}

TEST(Scheduler, AppendTokenOnlyWhenASampleIsDueAndEndsAtMaxModelLen) {
  Harness h(16, 4, 64, /*max_model_len=*/8);
  const int64_t a = h.add(6, 100);
  EXPECT_THROW(h.sched.append_token(a, 5), ValueError);  // not computed yet
  SchedulerOutput s = h.sched.schedule();
  h.sched.computed(s);
  EXPECT_FALSE(h.sched.append_token(a, 5));  // 7 tokens
  EXPECT_THROW(h.sched.append_token(a, 5), ValueError);  // one per step
  s = h.sched.schedule();
  h.sched.computed(s);
  EXPECT_TRUE(h.sched.append_token(a, 5));  // 8 tokens = max_model_len
  h.sched.finish(a);
  h.sched.finish(a);  // twice is harmless
  EXPECT_EQ(h.blocks.num_used(), 0);
}

TEST(Scheduler, AbortMidPrefillAndMidDecodeFreesBlocks) {
  Harness h(32, 4, 8);
  const int64_t a = h.add(30, 100);
  h.step();
  EXPECT_EQ(h.sched.sequence(a).computed, 8);  // mid-prefill
  EXPECT_GT(h.blocks.num_used(), 0);
  h.sched.finish(a);
  EXPECT_EQ(h.blocks.num_used(), 0);
  const int64_t b = h.add(3, 100);
  for (int i = 0; i < 5; ++i) h.step();
  EXPECT_EQ(h.sched.sequence(b).generated(), 5);  // decoding
  h.sched.finish(b);
  EXPECT_EQ(h.blocks.num_used(), 0);
  EXPECT_EQ(h.blocks.num_sequences(), 0);
}

TEST(Scheduler, PrefixCacheAdoptsFullBlocksAndRecomputesTheLastToken) {
  Harness h(32, 4, 256, 4096, /*prefix=*/true);
  const int64_t a = h.add(40, 2);
  h.run_to_end();
  EXPECT_FALSE(h.sched.contains(a));
  EXPECT_EQ(h.blocks.num_used(), 0);
  EXPECT_EQ(h.blocks.num_cached(), 2);  // the finished sequence left its full blocks cached
  const int64_t b = h.add(40, 2);       // the same prompt
  SchedulerOutput s = h.step();
  ASSERT_EQ(s.chunks.size(), 1u);
  EXPECT_EQ(s.chunks[0].seq, b);
  EXPECT_EQ(s.chunks[0].start, 32);
  EXPECT_EQ(s.chunks[0].count, 8);
  // A prompt of exactly two blocks still computes its last token: one block is adopted.
  const int64_t c = h.add(32, 2);
  s = h.step();
  bool found = false;
  for (const ScheduledChunk& ch : s.chunks)
    if (ch.seq == c) {
      found = true;
      EXPECT_EQ(ch.start, 16);
      EXPECT_EQ(ch.count, 16);
    }
  EXPECT_TRUE(found);
  h.run_to_end();
  EXPECT_EQ(h.blocks.num_used(), 0);
  EXPECT_EQ(h.blocks.prefix_stats().hit_tokens, 32 + 16);
}

TEST(Scheduler, RandomWorkloadKeepsEveryInvariant) {
  for (bool prefix : {false, true}) {
    std::mt19937 rng(prefix ? 7 : 3);
    auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    const int64_t num_blocks = 24, max_seqs = 6, budget = 37;
    Harness h(num_blocks, max_seqs, budget, 200, prefix);
    int added = 0;
    for (int step = 0; step < 20000 && (added < 300 || h.sched.has_unfinished()); ++step) {
      while (added < 300 && h.sched.waiting().size() < 4) {
        // Prompts share a few prefixes so the cache gets hits; a quarter are scores.
        const int64_t n = uniform(1, 150);
        const int32_t first = 1 + 3 * uniform(0, 2);
        if (uniform(0, 3) == 0) h.sched.add_score(prompt_of(n, first), uniform(0, int(n) - 1));
        else h.add(n, uniform(1, 30), first);
        added++;
      }
      if (!h.sched.running().empty() && uniform(0, 40) == 0) {
        auto it = h.sched.running().begin();
        std::advance(it, uniform(0, int(h.sched.running().size()) - 1));
        h.sched.finish(*it);  // abort
      }
      SchedulerOutput s = h.step();
      EXPECT_LE(s.num_tokens, budget);
      int64_t sum = 0;
      std::set<int64_t> seen;
      for (const ScheduledChunk& c : s.chunks) {
        sum += c.count;
        EXPECT_GT(c.count, 0);
        EXPECT_TRUE(seen.insert(c.seq).second) << "a sequence twice in one step";
      }
      EXPECT_EQ(sum, s.num_tokens);
      EXPECT_LE(int64_t(h.sched.running().size()), max_seqs);
      // Block accounting: every running sequence holds exactly the blocks its cached tokens
      // need, and the pool's used count is exactly the distinct blocks they hold.
      std::set<int32_t> held;
      for (int64_t id : h.sched.running()) {
        const Sequence& q = h.sched.sequence(id);
        ASSERT_GE(q.kv, 0);
        EXPECT_EQ(h.blocks.length(q.kv), q.computed);
        EXPECT_EQ(int64_t(h.blocks.blocks(q.kv).size()), BlockManager::blocks_for(q.computed));
        for (int32_t b : h.blocks.blocks(q.kv)) held.insert(b);
      }
      for (int64_t id : h.sched.waiting()) EXPECT_EQ(h.sched.sequence(id).kv, -1);
      EXPECT_EQ(int64_t(held.size()), h.blocks.num_used());
      EXPECT_LE(h.blocks.num_used(), num_blocks);
    }
    EXPECT_FALSE(h.sched.has_unfinished());
    EXPECT_EQ(h.blocks.num_used(), 0);
    EXPECT_EQ(h.blocks.num_sequences(), 0);
    EXPECT_GT(h.sched.num_preemptions(), 0);
    if (prefix) {
      EXPECT_GT(h.blocks.prefix_stats().hit_tokens, 0);
    }
  }
}

TEST(Scheduler, ScoresAreChunkedReturnEachRowOnceAndEndByThemselves) {
  for (const int64_t num_blocks : {64, 3}) {  // 3 blocks: the score is preempted by the older generation
    Harness h(num_blocks, 4, 10);
    const int64_t gen = h.add(14, 20);
    const int64_t score = h.sched.add_score(prompt_of(25, 5), 12);
    std::vector<int64_t> rows;
    bool ended_by_itself = false;
    for (int step = 0; step < 200 && h.sched.has_unfinished(); ++step) {
      const SchedulerOutput s = h.sched.schedule();
      for (const ScheduledChunk& c : s.chunks) {
        EXPECT_EQ(c.kind == SeqKind::Score, c.seq == score);
        if (c.seq != score) continue;
        EXPECT_FALSE(c.sample);
        EXPECT_GE(c.rows_from, c.start);
        EXPECT_LE(c.rows_from + c.rows, c.start + c.count);
        for (int64_t p = c.rows_from; p < c.rows_from + c.rows; ++p) rows.push_back(p);
      }
      const std::vector<int64_t> scored = h.sched.computed(s);
      for (int64_t id : scored) EXPECT_EQ(id, score);
      if (!scored.empty()) {
        ended_by_itself = true;
        EXPECT_FALSE(h.sched.contains(score));
      }
      for (const ScheduledChunk& c : s.chunks)
        if (c.sample && (++h.generated[c.seq] >= 20 || h.sched.append_token(c.seq, 7))) h.sched.finish(c.seq);
    }
    EXPECT_TRUE(ended_by_itself);
    std::vector<int64_t> want;
    for (int64_t p = 12; p < 25; ++p) want.push_back(p);
    EXPECT_EQ(rows, want);  // every asked-for position once, in order, preempted or not
    EXPECT_EQ(h.generated[gen], 20);
    EXPECT_EQ(h.blocks.num_used(), 0);
    if (num_blocks == 3) {
      EXPECT_GT(h.sched.num_preemptions(), 0);
    }
  }
}

TEST(Scheduler, ScoresAndGenerationsShareCachedBlocksOnlyWithTheirOwnKind) {
  Harness h(64, 4, 64, 4096, /*prefix=*/true);
  const std::vector<int32_t> tokens = prompt_of(40, 3);
  auto first_chunk_start = [&](int64_t id) {
    const SchedulerOutput s = h.step();
    for (const ScheduledChunk& c : s.chunks)
      if (c.seq == id) return c.start;
    return int64_t(-1);
  };
  const int64_t g = h.add(40, 1, 3);
  EXPECT_EQ(first_chunk_start(g), 0);
  h.run_to_end();
  const int64_t s1 = h.sched.add_score(tokens, 39);
  EXPECT_EQ(first_chunk_start(s1), 0);  // a generation's blocks are not a score's
  h.run_to_end();
  EXPECT_EQ(first_chunk_start(h.sched.add_score(tokens, 39)), 32);  // the first score's blocks
  h.run_to_end();
  EXPECT_EQ(first_chunk_start(h.sched.add_score(tokens, 20)), 16);  // only blocks before its rows
  h.run_to_end();
  EXPECT_EQ(first_chunk_start(h.add(40, 1, 3)), 32);  // the generation's blocks
  h.run_to_end();
  EXPECT_EQ(h.blocks.num_used(), 0);
}

TEST(Scheduler, LoraSequencesShareCachedBlocksOnlyAtTheSameAdapterAndScale) {
  Harness h(64, 4, 64, 4096, /*prefix=*/true);
  const std::vector<int32_t> tokens = prompt_of(40, 3);
  auto adapter = std::make_shared<LoraAdapter>();
  adapter->cache_key = 0x1234;
  auto first_chunk_start = [&](float scale) {
    const int64_t id = h.sched.add(tokens, -1, {}, adapter, scale);
    h.max_tokens[id] = 1;
    const SchedulerOutput s = h.step();
    h.run_to_end();
    for (const ScheduledChunk& c : s.chunks)
      if (c.seq == id) return c.start;
    return int64_t(-1);
  };
  EXPECT_EQ(first_chunk_start(1.0f), 0);
  EXPECT_EQ(first_chunk_start(0.5f), 0);  // another scale: blocks of its own
  EXPECT_EQ(first_chunk_start(1.0f), 32);
  EXPECT_EQ(first_chunk_start(0.5f), 32);
  EXPECT_EQ(first_chunk_start(0.0f), 0);
  for (float bad : {std::nanf(""), INFINITY, -INFINITY})
    EXPECT_THROW(h.sched.add(tokens, -1, {}, adapter, bad), ValueError);
  EXPECT_EQ(h.blocks.num_used(), 0);
}

TEST(Scheduler, ScoresThatCouldNeverRunAreRefused) {
  BlockManager blocks(4, true);
  Scheduler s(blocks, SchedulerOptions{4, 16, 100});
  EXPECT_THROW(s.add_score({}, 0), ValueError);
  EXPECT_THROW(s.add_score(prompt_of(10), 10), ValueError);  // no position to score
  EXPECT_THROW(s.add_score(prompt_of(10), -1), ValueError);
  EXPECT_THROW(s.add_score(prompt_of(101), 0), ValueError);  // beyond max_model_len
  EXPECT_THROW(s.add_score(prompt_of(65), 0), ValueError);   // more than the pool
  EXPECT_NO_THROW(s.add_score(prompt_of(64), 0));            // the pool exactly: no token to generate
  const int64_t g = s.add(prompt_of(5));
  s.schedule();
  EXPECT_THROW(s.append_token(g + 100, 1), ValueError);
}

TEST(Scheduler, AGenerationAskingForItsPromptRowsGetsEachOnceThenItsSampleRows) {
  for (const int64_t num_blocks : {64, 3}) {  // 3 blocks: the younger one is preempted and recomputed
    Harness h(num_blocks, 4, 6);
    const int64_t older = h.add(14, 20, 9);
    const int64_t g = h.sched.add(prompt_of(11, 4), 2);
    h.max_tokens[g] = 25;
    std::vector<int64_t> rows, samples;
    for (int step = 0; step < 300 && h.sched.has_unfinished(); ++step) {
      const Sequence* before = h.sched.contains(g) ? &h.sched.sequence(g) : nullptr;
      const int64_t length = before ? before->length() : 0;
      const SchedulerOutput s = h.step();
      for (const ScheduledChunk& c : s.chunks) {
        if (c.seq != g) continue;
        for (int64_t p = c.rows_from; p < c.rows_from + c.rows; ++p) rows.push_back(p);
        if (c.sample) samples.push_back(length - 1);  // the sampled row is the last position
      }
    }
    std::vector<int64_t> want;
    for (int64_t p = 2; p < 11 + 24; ++p) want.push_back(p);  // prompt rows 2..10, then the samples'
    EXPECT_EQ(rows, want);
    EXPECT_EQ(samples, std::vector<int64_t>(want.begin() + 8, want.end()));
    EXPECT_EQ(h.generated[older], 20);
    EXPECT_EQ(h.blocks.num_used(), 0);
    if (num_blocks == 3) {
      EXPECT_GT(h.sched.num_preemptions(), 0);
    }
  }
}

TEST(Scheduler, ProposalsAreVerifiedWithTheLastTokenAndOnlyAcceptedOnesStay) {
  Harness h(64, 4, 64, 4096, /*prefix=*/true);
  const int64_t a = h.add(15, 100, 2);
  SchedulerOutput s = h.sched.schedule();  // the prompt
  h.sched.computed(s);
  const std::vector<int32_t> draft = {201, 202, 203, 204, 205};
  EXPECT_FALSE(h.sched.append(a, 0, 100, draft));  // token 100 at position 15, five proposals after it
  s = h.sched.schedule();
  ASSERT_EQ(s.chunks.size(), 1u);
  const ScheduledChunk c = s.chunks[0];
  EXPECT_TRUE(c.decode && c.sample);
  EXPECT_EQ(c.start, 15);
  EXPECT_EQ(c.count, 6);
  EXPECT_EQ(c.drafted, 5);
  EXPECT_EQ(c.rows_from, 15);  // the last token's row, then each proposal's
  EXPECT_EQ(c.rows, 6);
  EXPECT_EQ(h.blocks.blocks(c.kv).size(), 2u);  // blocks for the proposals too
  h.sched.computed(s);
  EXPECT_EQ(h.sched.sequence(a).computed, 16);  // proposals count once accepted
  EXPECT_THROW(h.sched.append(a, 6, 7, {}), ValueError);  // only five were verified
  EXPECT_FALSE(h.sched.append(a, 2, 300, {401}));  // 201, 202 accepted, then 300
  const Sequence& seq = h.sched.sequence(a);
  EXPECT_EQ(seq.length(), 19);
  EXPECT_EQ(seq.computed, 18);
  EXPECT_EQ(std::vector<int32_t>(seq.tokens.end() - 4, seq.tokens.end()), (std::vector<int32_t>{100, 201, 202, 300}));
  EXPECT_EQ(h.blocks.length(seq.kv), 18);
  EXPECT_EQ(h.blocks.blocks(seq.kv).size(), 2u);
  // A proposal is never cached: a prompt running into the rejected 203 shares block 0 only.
  for (int i = 0; i < 20; ++i) {  // fill block 1 with accepted tokens
    s = h.sched.schedule();
    h.sched.computed(s);
    h.sched.append(a, 0, 500 + i, {203, 204});
  }
  std::vector<int32_t> prompt(h.sched.sequence(a).tokens.begin(), h.sched.sequence(a).tokens.begin() + 18);
  prompt.insert(prompt.end(), {203, 204, 205});
  prompt.resize(40, 9);
  const int64_t b = h.sched.add(prompt);
  s = h.sched.schedule();
  for (const ScheduledChunk& ch : s.chunks)
    if (ch.seq == b) {
      EXPECT_EQ(ch.start, 16);
    }
  h.sched.computed(s);
  h.sched.finish(a);
  h.sched.finish(b);
  EXPECT_EQ(h.blocks.num_used(), 0);
}

TEST(Scheduler, RandomAcceptRejectAndAbortKeepBlockAccountingExact) {
  std::mt19937 rng(11);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const int64_t num_blocks = 20, budget = 24, max_len = 120;
  Harness h(num_blocks, 5, budget, max_len, /*prefix=*/true);
  int added = 0;
  int64_t verified = 0;
  for (int step = 0; step < 20000 && (added < 150 || h.sched.has_unfinished()); ++step) {
    while (added < 150 && h.sched.waiting().size() < 3) {
      h.add(uniform(1, 60), uniform(1, 50), 1 + 3 * uniform(0, 2));
      added++;
    }
    if (!h.sched.running().empty() && uniform(0, 30) == 0) {
      auto it = h.sched.running().begin();
      std::advance(it, uniform(0, int(h.sched.running().size()) - 1));
      h.sched.finish(*it);
    }
    const SchedulerOutput s = h.sched.schedule();
    EXPECT_LE(s.num_tokens, budget);
    h.sched.computed(s);
    for (const ScheduledChunk& c : s.chunks) {
      if (!c.sample) continue;
      verified += c.drafted;
      const Sequence& q = h.sched.sequence(c.seq);
      EXPECT_EQ(q.verified, c.drafted);
      EXPECT_LE(q.length() + c.drafted + 1, max_len);
      std::vector<int32_t> draft(size_t(uniform(0, 6)));
      for (int32_t& t : draft) t = uniform(3, 400);
      const int64_t accepted = uniform(0, int(c.drafted));
      h.generated[c.seq] += accepted + 1;
      if (h.generated[c.seq] >= h.max_tokens[c.seq] || h.sched.append(c.seq, accepted, 7, draft)) {
        h.sched.finish(c.seq);
      }
    }
    std::set<int32_t> held;
    for (int64_t id : h.sched.running()) {
      const Sequence& q = h.sched.sequence(id);
      EXPECT_EQ(h.blocks.length(q.kv), q.computed);
      // Exactly the blocks of the computed tokens, or those plus the proposals being verified.
      const int64_t n = int64_t(h.blocks.blocks(q.kv).size());
      EXPECT_TRUE(n == BlockManager::blocks_for(q.computed) || n == BlockManager::blocks_for(q.computed + q.verified))
          << n << " blocks for " << q.computed << " + " << q.verified;
      for (int32_t b : h.blocks.blocks(q.kv)) held.insert(b);
    }
    EXPECT_EQ(int64_t(held.size()), h.blocks.num_used());
  }
  EXPECT_GT(verified, 100);
  EXPECT_FALSE(h.sched.has_unfinished());
  EXPECT_EQ(h.blocks.num_used(), 0);
  EXPECT_EQ(h.blocks.num_sequences(), 0);
}

TEST(Scheduler, RewindReplacesTheTailAndNeverWritesACachedBlock) {
  Harness h(64, 4, 64, 4096, /*prefix=*/true);
  const int64_t a = h.add(40, 100, 5);
  SchedulerOutput s = h.sched.schedule();
  h.sched.computed(s);
  h.sched.append_token(a, 77);  // 41 tokens, 40 computed, blocks 0 and 1 cached
  h.sched.rewind(a, 36, {88, 89});  // inside block 2, which is not cached: K/V kept up to 36
  EXPECT_EQ(h.sched.sequence(a).computed, 36);
  h.sched.rewind(a, 30, {88, 89});  // inside cached block 1: back to its start
  const Sequence& q = h.sched.sequence(a);
  EXPECT_EQ(q.length(), 32);
  EXPECT_EQ(q.tokens[30], 88);
  EXPECT_EQ(q.computed, 16);
  EXPECT_EQ(h.blocks.length(q.kv), 16);
  EXPECT_EQ(h.blocks.blocks(q.kv).size(), 1u);
  EXPECT_EQ(h.blocks.num_cached(), 2);  // block 1 stays cached for whoever shares its prefix
  s = h.sched.schedule();
  ASSERT_EQ(s.chunks.size(), 1u);
  EXPECT_EQ(s.chunks[0].start, 16);
  EXPECT_EQ(s.chunks[0].count, 16);
  EXPECT_TRUE(s.chunks[0].sample);
  EXPECT_EQ(s.chunks[0].rows, 1);
  h.sched.computed(s);
  h.sched.rewind(a, 32, {90});  // the K/V of all 32 kept
  EXPECT_EQ(h.sched.sequence(a).computed, 32);
  EXPECT_THROW(h.sched.rewind(a, 0, {1}), ValueError);
  EXPECT_THROW(h.sched.rewind(a, 10, {}), ValueError);
  h.sched.finish(a);
  EXPECT_EQ(h.blocks.num_used(), 0);
}

TEST(Scheduler, StepsInFlightTakeDisjointSequencesThatNoneOtherPreempts) {
  // Two steps in flight at a time, as with two pipeline stages, on a pool small enough to
  // preempt; some sequences are aborted while their step is in flight.
  Harness h(6, 8, 48);
  std::mt19937 rng(7);
  std::vector<int64_t> ids;
  for (int i = 0; i < 10; ++i) ids.push_back(h.add(1 + int64_t(rng() % 30), 1 + int64_t(rng() % 25), 1 + i));
  std::deque<SchedulerOutput> in_flight;
  std::set<int64_t> aborted;
  int64_t preempted = 0;
  for (int step = 0; step < 2000 && h.sched.has_unfinished(); ++step) {
    while (in_flight.size() < 2) {
      const int64_t share = (h.sched.num_sequences() + 1) / 2;
      SchedulerOutput out = h.sched.schedule(share);
      EXPECT_LE(int64_t(out.chunks.size()), share);
      std::set<int64_t> flying;
      for (const SchedulerOutput& f : in_flight)
        for (const ScheduledChunk& c : f.chunks) flying.insert(c.seq);
      for (const ScheduledChunk& c : out.chunks) EXPECT_FALSE(flying.count(c.seq)) << "scheduled twice";
      for (int64_t v : out.preempted) EXPECT_FALSE(flying.count(v)) << "preempted in flight";
      for (int64_t e : out.ended) EXPECT_FALSE(flying.count(e)) << "ended in flight";
      preempted += int64_t(out.preempted.size());
      if (out.chunks.empty()) break;
      in_flight.push_back(std::move(out));
    }
    if (in_flight.empty()) continue;
    if (rng() % 40 == 0 && !in_flight.back().chunks.empty()) {  // aborted while its step is in flight
      const int64_t victim = in_flight.back().chunks.front().seq;
      h.sched.finish(victim);
      aborted.insert(victim);
    }
    SchedulerOutput done = std::move(in_flight.front());
    in_flight.pop_front();
    h.sched.computed(done);
    for (const ScheduledChunk& c : done.chunks) {
      if (!c.sample || !h.sched.contains(c.seq)) continue;
      const Sequence& s = h.sched.sequence(c.seq);
      const int32_t token = int32_t((c.seq * 31 + s.length()) % 500 + 3);
      if (++h.generated[c.seq] >= h.max_tokens[c.seq] || h.sched.append_token(c.seq, token)) h.sched.finish(c.seq);
    }
  }
  EXPECT_TRUE(in_flight.empty());
  EXPECT_FALSE(h.sched.has_unfinished());
  EXPECT_GT(preempted, 0);
  for (int64_t id : ids)
    if (!aborted.count(id)) EXPECT_EQ(h.generated[id], h.max_tokens[id]) << id;
  EXPECT_EQ(h.blocks.num_used(), 0);
  EXPECT_EQ(h.blocks.num_sequences(), 0);
}

TEST(Scheduler, AStepThatDidNotRunIsScheduledAgain) {
  Harness h(16, 8, 64);
  const int64_t a = h.add(20, 5), b = h.add(7, 5);
  const SchedulerOutput first = h.sched.schedule();
  ASSERT_EQ(first.chunks.size(), 2u);
  EXPECT_TRUE(h.sched.schedule().chunks.empty());  // both in flight
  h.sched.not_run(first);                          // its forward threw
  const SchedulerOutput again = h.sched.schedule();
  ASSERT_EQ(again.chunks.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(again.chunks[i].seq, first.chunks[i].seq);
    EXPECT_EQ(again.chunks[i].start, first.chunks[i].start);
    EXPECT_EQ(again.chunks[i].count, first.chunks[i].count);
  }
  EXPECT_EQ(h.blocks.num_used(), 3);  // the blocks taken once: 2 for a, 1 for b
  h.sched.computed(again);
  h.sched.finish(a);
  h.sched.finish(b);
  EXPECT_EQ(h.blocks.num_used(), 0);
}

TEST(Scheduler, ATokenCapLimitsPromptChunksButNotDecodes) {
  Harness h(64, 8, 512);
  const int64_t a = h.add(3, 4), b = h.add(4, 4), c = h.add(100, 2);
  EXPECT_EQ(h.sched.prompt_tokens_waiting(), 107);
  SchedulerOutput s = h.sched.schedule(INT64_MAX, 5);  // a's prompt, 2 of b's
  ASSERT_EQ(s.chunks.size(), 2u);
  EXPECT_EQ(s.num_tokens, 5);
  EXPECT_EQ(s.chunks[1].seq, b);
  EXPECT_EQ(s.chunks[1].count, 2);
  EXPECT_EQ(h.sched.prompt_tokens_waiting(), 100);  // c's; a and b are in flight
  h.sched.computed(s);
  EXPECT_EQ(h.sched.prompt_tokens_waiting(), 102);
  h.sched.append_token(a, 7);
  s = h.sched.schedule(INT64_MAX, 1);  // a's decode fills the cap: nothing of b or c joins it
  ASSERT_EQ(s.chunks.size(), 1u);
  EXPECT_TRUE(s.chunks[0].decode);
  h.sched.computed(s);
  h.sched.append_token(a, 8);
  s = h.sched.schedule(INT64_MAX, 0);  // decodes exceed a cap rather than wait
  ASSERT_EQ(s.chunks.size(), 1u);
  EXPECT_EQ(s.chunks[0].seq, a);
  h.sched.computed(s);
  h.sched.append_token(a, 9);
  s = h.sched.schedule(INT64_MAX, 40);  // a's decode, b's last 2 tokens, 37 of c's
  ASSERT_EQ(s.chunks.size(), 3u);
  EXPECT_EQ(s.num_tokens, 40);
  EXPECT_EQ(s.chunks[2].seq, c);
  EXPECT_EQ(s.chunks[2].count, 37);
  h.sched.computed(s);
  EXPECT_EQ(h.sched.prompt_tokens_waiting(), 63);
  for (int64_t id : {a, b, c}) h.sched.finish(id);
  EXPECT_EQ(h.blocks.num_used(), 0);
}
