// The collectives a tensor-parallel group needs, over the ranks that run one model: rank 0 leads
// (it runs the scheduler and tells the others each step), the others follow. The one
// implementation is MPI's (dist/mpi_communicator.h), built when CMake finds an MPI (FERRUM_MPI).
//
// Every call is collective: each rank makes it, in the same order. A rank that does not take part
// within the timeout (it exited, hangs, or its link is gone) ends the call with CommError on the
// ranks that wait for it; the communicator is then closed, and every later call throws that error
// at once, so a group with a lost rank never hangs.
#pragma once
#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>

namespace ferrum {

struct CommError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Ranks of this group on this machine (they share its cores).
  virtual int ranks_on_this_host() const = 0;

  // How long a rank waits for the others: up to the group's timeout, or without a deadline (a
  // follower waiting for rank 0's next order while it has nothing to run; ranks loading their
  // shards, which may take longer on one machine than on another).
  enum class Wait { Timeout, Forever };

  // data[0, count) = its sum over the ranks, on every rank.
  virtual void all_reduce_sum(float* data, size_t count) = 0;
  // recv[r * bytes, (r + 1) * bytes) = rank r's send[0, bytes), on every rank.
  virtual void all_gather(const void* send, size_t bytes, void* recv, Wait wait = Wait::Timeout) = 0;
  // As all_gather, but only rank `root` receives (recv is not touched elsewhere).
  virtual void gather(const void* send, size_t bytes, void* recv, int root) = 0;
  // data[0, bytes) = root's data, on every rank.
  virtual void broadcast(void* data, size_t bytes, int root, Wait wait = Wait::Timeout) = 0;
  virtual void barrier() = 0;

  // Point to point (pipeline parallelism's hand-offs between stages): data[0, bytes) to rank
  // `to`, which receives it with recv from this rank. Both wait up to the timeout.
  virtual void send(const void* data, size_t bytes, int to) = 0;
  virtual void recv(void* data, size_t bytes, int from) = 0;

  // A broadcast from this rank (the root), a send or a receive, started now and waited for later,
  // so that rank 0 of a pipeline computes its next step while the later stages run this one, and
  // the last stage its next while its rows travel. The buffer stays untouched (broadcast, send)
  // or is written (receive) until wait() returns; wait() polls against the timeout like every
  // call. One not waited for is waited for when it is destroyed.
  class Pending {
   public:
    virtual ~Pending() = default;
    virtual void wait() = 0;
  };
  virtual std::unique_ptr<Pending> start_broadcast(const void* data, size_t bytes) = 0;
  virtual std::unique_ptr<Pending> start_send(const void* data, size_t bytes, int to) = 0;
  virtual std::unique_ptr<Pending> start_recv(void* data, size_t bytes, int from) = 0;
  // Collective: the ranks of this group with the same color form a new group, ordered by key.
  // A failure in either ends both (a lost rank ends the whole group).
  virtual std::shared_ptr<Communicator> split(int color, int key) = 0;

  // False once closed: by close() (the group's work is over) or by a failed collective.
  virtual bool is_open() const = 0;
  // Leaves the group (collective while it is open; nothing when a collective failed).
  virtual void close() = 0;
};

}  // namespace ferrum
