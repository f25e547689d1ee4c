#include "engine/follower.h"

#include <map>
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
    } catch (...) {  // the other ranks wait to hear how this rank's load went (this throws)
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
  std::map<int64_t, std::unique_ptr<ModelRunner>> models;  // by rank 0's number
  StepPlan plan;
  const auto model = [&](const Order& order) -> ModelRunner& {
    auto it = models.find(order.model);
    if (it == models.end()) throw std::logic_error("a tensor-parallel order for a model that is not loaded");
    return *it->second;
  };
  for (;;) {
    Order order = receive_order(*group);
    switch (order.kind) {
      case OrderKind::Load:
        if (auto runner = load(group, order)) models[order.model] = std::move(runner);
        break;
      case OrderKind::Step:
        decode_step(order.payload, &plan);
        model(order).run(plan);
        break;
      case OrderKind::Memory:
        model(order).report_memory();
        break;
      case OrderKind::AddLora:
        model(order).add_lora(order.payload);
        break;
      case OrderKind::DropLora:
        model(order).drop_lora(order.payload);
        break;
      case OrderKind::Close:
        models.erase(order.model);
        break;
      case OrderKind::End:
        models.clear();
        group->close();
        return;
    }
  }
}

}  // namespace ferrum
