#include "model/recorded_step.h"

#include <chrono>

namespace ferrum {

RecordedStep::RecordedStep(Backend& be, Communicator* group, StageLinks links)
    : be_(be), group_(group && group->size() > 1 ? group : nullptr), links_(links) {
  segments_.push_back({be_.new_stream(), {}, After::Nothing});
}

void RecordedStep::then(After after, const Tensor& t) {
  segments_.back().t = t;
  segments_.back().after = after;
  segments_.push_back({be_.new_stream(), {}, After::Nothing});
}

void RecordedStep::all_reduce(const Tensor& t) {
  if (group_) then(After::Sum, t);
}

void RecordedStep::receive(const Tensor& t) { then(After::Receive, t); }

void RecordedStep::send(const Tensor& t) { then(After::Send, t); }

void RecordedStep::run(ReduceTime& time, ReduceTime* hand_offs) {
  for (Segment& seg : segments_) {
    seg.stream->submit();
    seg.stream->sync();
    if (seg.after == After::Nothing) continue;
    const auto start = std::chrono::steady_clock::now();
    const size_t n = size_t(seg.t.numel());
    host_.resize(n);
    if (seg.after == After::Receive) {
      links_.group->recv(host_.data(), n * sizeof(float), links_.prev);
    } else {
      be_.download(seg.t, host_.data(), n * sizeof(float));
      if (seg.after == After::Sum) group_->all_reduce_sum(host_.data(), n);
      else links_.group->send(host_.data(), n * sizeof(float), links_.next);
    }
    if (seg.after != After::Send) be_.upload(seg.t, host_.data(), n * sizeof(float));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ReduceTime* into = seg.after == After::Sum ? &time : hand_offs;
    if (!into) continue;
    into->count++;
    into->seconds += seconds;
    if (seg.after != After::Sum) into->bytes += int64_t(n * sizeof(float));
  }
}

}  // namespace ferrum
