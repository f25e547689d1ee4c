#include "backend/cpu/weight_arena.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"

namespace ferrum {

namespace {
constexpr size_t kLargePage = size_t(2) << 20;
// Address space only (pages fill as weights land); large, so that few regions end in a
// partly filled 2 MiB page.
constexpr size_t kRegionBytes = size_t(256) << 20;
constexpr size_t kAlign = 64;                      // also the slack after each block

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// A kLargePage-aligned mapping of `bytes` (2 MiB pages where the system grants them on request,
// THP "madvise" or "always"); the shared_ptr unmaps it.
std::shared_ptr<const void> map_region(size_t bytes) {
  const size_t mapped = bytes + kLargePage;  // room to align the start
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw ResourceError("out of host memory mapping " + std::to_string(bytes) + " bytes of weights");
  char* start = reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(p), kLargePage));
  static const bool large_pages = !std::getenv("FERRUM_NO_HUGEPAGE");  // read once
  if (large_pages) madvise(start, bytes, MADV_HUGEPAGE);
  return std::shared_ptr<const void>(start, [p, mapped](const void*) { munmap(p, mapped); });
}
}  // namespace

WeightArena::Block WeightArena::allocate(size_t bytes) {
  const size_t need = round_up(bytes + kAlign, kAlign);
  if (need > kRegionBytes) {  // a region of its own; the current one goes on filling
    std::shared_ptr<const void> own = map_region(round_up(need, kLargePage));
    return {const_cast<void*>(own.get()), own};
  }
  std::shared_ptr<const void> region = region_.lock();
  if (!region || used_ + need > kRegionBytes) {
    region = map_region(kRegionBytes);
    region_ = region;
    used_ = 0;
  }
  void* data = static_cast<char*>(const_cast<void*>(region.get())) + used_;
  used_ += need;
  return {data, std::move(region)};
}

}  // namespace ferrum
