// A forward step recorded for replay: streams that run in order, each followed by the sum of one
// tensor over the ranks of a tensor-parallel group (the all-reduce after a matmul split by its
// input, model/tensor_split.h). Without a group it is one stream. A sum goes through host memory:
// the tensor is downloaded, summed by the communicator and uploaded back, so it works the same on
// every backend; a replayed step runs its sums again with the rest.
#pragma once
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "dist/communicator.h"

namespace ferrum {

// Time spent in the sums of a group's steps (download, all-reduce, upload), and their count.
struct ReduceTime {
  int64_t count = 0;
  double seconds = 0;
};

class RecordedStep {
 public:
  // group: null or a group of one rank for none.
  RecordedStep(Backend& be, Communicator* group);
  // The stream ops are recorded into now (another after each all_reduce).
  Stream& stream() { return *segments_.back().stream; }
  // Records: once the ops recorded so far have run, t (f32, contiguous) = its sum over the ranks.
  void all_reduce(const Tensor& t);
  // Runs the streams in order, with the sums between them (timed into `time`).
  void run(ReduceTime& time);

 private:
  struct Segment {
    std::unique_ptr<Stream> stream;
    Tensor sum;  // summed after the stream has run; undefined for the last segment
  };
  Backend& be_;
  Communicator* group_;
  std::vector<Segment> segments_;
  std::vector<float> host_;
};

}  // namespace ferrum
