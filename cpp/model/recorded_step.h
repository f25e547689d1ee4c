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

// Time spent in the sums of a group's steps (download, all-reduce, upload), and their count;
// or in a pipeline stage's hand-offs (download and send, receive and upload), with their bytes.
struct ReduceTime {
  int64_t count = 0;
  double seconds = 0;
  int64_t bytes = 0;
};

// Pipeline parallelism: where a stage's hidden rows come from and go to (ranks of `group`; -1:
// none, the first or the last stage).
struct StageLinks {
  Communicator* group = nullptr;
  int prev = -1, next = -1;
};

class RecordedStep {
 public:
  // group: null or a group of one rank for none.
  RecordedStep(Backend& be, Communicator* group, StageLinks links = {});
  // The stream ops are recorded into now (another after each all_reduce).
  Stream& stream() { return *segments_.back().stream; }
  // Records: once the ops recorded so far have run, t (f32, contiguous) = its sum over the ranks.
  void all_reduce(const Tensor& t);
  // Records, for pipeline parallelism: t (f32, contiguous) = the previous stage's, received
  // before the ops recorded after it; or, once the ops so far have run, t sent to the next.
  void receive(const Tensor& t);
  void send(const Tensor& t);
  // Runs the streams in order, with the sums between them (timed into `time`) and the hand-offs
  // (into `hand_offs`).
  void run(ReduceTime& time, ReduceTime* hand_offs = nullptr);

 private:
  enum class After { Nothing, Sum, Send, Receive };
  struct Segment {
    std::unique_ptr<Stream> stream;
    Tensor t;  // summed, sent or received after the stream has run
    After after = After::Nothing;
  };
  void then(After after, const Tensor& t);
  Backend& be_;
  Communicator* group_;
  StageLinks links_;
  std::vector<Segment> segments_;
  std::vector<float> host_;
};

}  // namespace ferrum
