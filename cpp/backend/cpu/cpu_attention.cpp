// paged_attention on the CPU: the call's tokens in tiles, the tiles' (tile, kv head) items dealt
// to the threads, each run by attention_kernel.h, in its AVX-512 copy where the CPU has it.
#include <algorithm>
#include <vector>

#include "backend/cpu/attention_kernel.h"
#include "backend/op_checks.h"

namespace ferrum {

namespace {

// The longest tile: kTileTokens, or shorter where a call has too few tokens to give every thread
// two (tile, kv head) items otherwise (a verify step's tokens, a short chunk). A query's result
// does not depend on its tile, so this moves only work.
int64_t tile_length(int64_t tokens, int64_t kv_heads, int nth) {
  const int64_t tiles = (2 * nth + kv_heads - 1) / kv_heads;
  return std::clamp<int64_t>((tokens + tiles - 1) / tiles, 1, cpu::kTileTokens);
}

// Runs of consecutive tokens of one sequence, at most `longest` each.
void make_tiles(const int32_t* seq, int64_t tokens, int64_t longest, std::vector<cpu::AttnTile>& tiles) {
  tiles.clear();
  for (int64_t t = 0; t < tokens;) {
    int64_t e = t + 1;
    while (e < tokens && e - t < longest && seq[e] == seq[t]) ++e;
    tiles.push_back({t, e});
    t = e;
  }
}

cpu::AttendItemsFn attention_kernel() {
  return cpu::avx512_copies() ? cpu::attend_items_avx512 : cpu::attend_items;
}

}  // namespace

void CpuBackend::paged_attention(Stream& s, const Tensor& q, const KvLayer& kv,
                                 const AttnBatch& batch, const AttnParams& p, const Tensor& out) {
  own({&q, &out}, batch, kv);
  checks::paged_attention(q, kv, batch, p, out);
  static const cpu::AttendItemsFn attend = attention_kernel();
  const size_t per_thread = cpu::attention_scratch_floats(p);
  auto buf = scratch(Scratch::Attention, per_thread * size_t(pool_.size()) * 4);
  static_cast<CpuStream&>(s).record("paged_attention", [=](int ith, int nth) {
    const cpu::AttnCall call{host_ptr<float>(q), host_ptr<float>(out), host_ptr<int32_t>(batch.token_seq),
                             host_ptr<int32_t>(batch.token_pos), host_ptr<int32_t>(batch.block_tables),
                             batch.block_tables.dim(0), batch.block_tables.dim(1),
                             batch.block_tables.dim(1) * kv.block_size(), &kv, p};
    thread_local std::vector<cpu::AttnTile> tiles;  // grows once; every thread derives the same list
    const int64_t tokens = q.numel() / (p.heads * p.head_dim);
    make_tiles(call.seq, tokens, tile_length(tokens, p.kv_heads, nth), tiles);
    attend(call, tiles.data(), int64_t(tiles.size()), reinterpret_cast<float*>(buf->data()) + per_thread * size_t(ith),
           ith, nth);
  });
}

}  // namespace ferrum
