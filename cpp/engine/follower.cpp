#include "engine/follower.h"

#include <stdexcept>

#include "engine/model_runner.h"
#include "engine/rank_orders.h"

namespace ferrum {

namespace {

// Loads the model a Load order names; null when it failed on some rank (rank 0 reports it).
std::unique_ptr<ModelRunner> load(const std::shared_ptr<Communicator>& group, const Order& order) {
  std::string path;
  RunnerOptions opt;
  decode_load(order.payload, &path, &opt);
  opt.group = group;
  try {
    ModelFile file;
    try {
      file = open_model_file(path);
    } catch (const CommError&) {
      throw;
    } catch (...) {  // the others wait to hear how this rank's load went
      agree_on_load(*group, std::current_exception(), 0);
    }
    return std::make_unique<ModelRunner>(std::move(file), opt);
  } catch (const CommError&) {
    throw;
  } catch (...) {
    return nullptr;
  }
}

}  // namespace

void follow_orders(const std::shared_ptr<Communicator>& group) {
  std::unique_ptr<ModelRunner> runner;
  StepPlan plan;
  for (;;) {
    Order order = receive_order(*group);
    switch (order.kind) {
      case OrderKind::Load:
        runner = load(group, order);
        break;
      case OrderKind::Step:
        if (!runner) throw std::logic_error("a step order without a model");
        decode_step(order.payload, &plan);
        runner->run(plan);
        break;
      case OrderKind::Memory:
        if (!runner) throw std::logic_error("a memory order without a model");
        runner->report_memory();
        break;
      case OrderKind::Close:
        runner.reset();
        break;
      case OrderKind::End:
        runner.reset();
        group->close();
        return;
    }
  }
}

}  // namespace ferrum
