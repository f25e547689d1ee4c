// What rank 0 of a tensor-parallel group tells the other ranks (orders), each broadcast before the
// collective work it starts, and how the ranks agree that a model loaded. Rank 0's ModelRunners
// give orders about their model (numbered by rank 0: several may be loaded at once); the other
// ranks wait for them in engine/follower.h's loop:
//   Load    open the model at a path with the runner's options, load this rank's share;
//   Step    run one forward of the model (its StepPlan);
//   Memory  report this rank's memory for the model (gathered on rank 0);
//   Close   the model is done with: drop it;
//   End     leave the group;
//   AddLora a LoRA adapter made on rank 0 (its whole updates, rank 0's number for it and its
//           cache key): this rank keeps and uploads its share; steps name it by that number;
//   DropLora rank 0 freed that adapter: free this rank's share.
#pragma once
#include <exception>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "engine/model_runner.h"

namespace ferrum {

enum class OrderKind : int64_t { Load = 1, Step, Memory, Close, End, AddLora, DropLora };

struct Order {
  OrderKind kind;
  int64_t model;
  std::vector<char> payload;
};

// Rank 0.
void send_order(Communicator& group, OrderKind kind, int64_t model, const std::vector<char>& payload = {});
// Rank 0, without waiting for the others to take it: an order on its way, whose wait() returns
// once it is delivered (it holds the order's bytes until then).
class SentOrder {
 public:
  SentOrder(Communicator& group, OrderKind kind, int64_t model, std::vector<char> payload);
  void wait();

 private:
  int64_t header_[3];
  std::vector<char> payload_;
  std::unique_ptr<Communicator::Pending> header_sent_, payload_sent_;
};
// A number for a model rank 0 loads, unique in this process.
int64_t next_model_number();
// The others: waits for rank 0 without a deadline (it may have nothing to run for a long time).
Order receive_order(Communicator& group);
// Rank 0: ends the followers' loops and closes the group (nothing when it is closed already).
void end_group(Communicator& group);

// The path made absolute: the other ranks may run in other directories.
std::vector<char> encode_load(const std::string& path, const RunnerOptions& opt);
// The options without a group (the receiver adds its own).
void decode_load(const std::vector<char>& payload, std::string* path, RunnerOptions* opt);
std::vector<char> encode_step(const StepPlan& plan);
void decode_step(const std::vector<char>& payload, StepPlan* plan);
std::vector<char> encode_lora(int64_t number, uint64_t cache_key, const std::vector<LoraPart>& parts);
void decode_lora(const std::vector<char>& payload, int64_t* number, uint64_t* cache_key, std::vector<LoraPart>* parts);
std::vector<char> encode_drop_lora(int64_t number);
int64_t decode_drop_lora(const std::vector<char>& payload);

// Every rank's outcome of loading its share, made known to all: the KV blocks each can hold are
// agreed on (the smallest), or, when a rank failed (`error`), every rank throws: its own error,
// or the first failed rank's, of the same kind (ValueError, FormatError, ResourceError or
// RuntimeError) and prefixed with that rank.
int64_t agree_on_load(Communicator& group, std::exception_ptr error, int64_t kv_blocks);

}  // namespace ferrum
