// A rank of a tensor-parallel group other than rank 0: it waits for rank 0's orders
// (engine/rank_orders.h) and carries them out with a ModelRunner of its own for each model rank 0
// has loaded, until rank 0 ends the group. A model that fails to load on any rank is
// reported on rank 0 (its ModelRunner throws); the followers then wait for the next order.
#pragma once
#include <memory>

#include "dist/communicator.h"

namespace ferrum {

// Returns when rank 0 ends the group (the group is then closed). CommError when rank 0 is gone.
void follow_orders(const std::shared_ptr<Communicator>& group);

}  // namespace ferrum
