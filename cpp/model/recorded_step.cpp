#include "model/recorded_step.h"

#include <chrono>

namespace ferrum {

RecordedStep::RecordedStep(Backend& be, Communicator* group)
    : be_(be), group_(group && group->size() > 1 ? group : nullptr) {
  segments_.push_back({be_.new_stream(), {}});
}

void RecordedStep::all_reduce(const Tensor& t) {
  if (!group_) return;
  segments_.back().sum = t;
  segments_.push_back({be_.new_stream(), {}});
}

void RecordedStep::run(ReduceTime& time) {
  for (Segment& seg : segments_) {
    seg.stream->submit();
    seg.stream->sync();
    if (!seg.sum.defined()) continue;
    const auto start = std::chrono::steady_clock::now();
    const size_t n = size_t(seg.sum.numel());
    host_.resize(n);
    be_.download(seg.sum, host_.data(), n * sizeof(float));
    group_->all_reduce_sum(host_.data(), n);
    be_.upload(seg.sum, host_.data(), n * sizeof(float));
    time.count++;
    time.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
}

}  // namespace ferrum
