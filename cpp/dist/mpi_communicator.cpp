#include "dist/mpi_communicator.h"

#include <mpi.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>
#include <thread>

#include "core/error.h"

namespace ferrum {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// A group whose collective failed still has that request pending, so MPI cannot be finalized.
bool g_abandoned = false;

void init_mpi() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) return;
  int provided = 0;
  // SERIALIZED: a server may drive the model from any thread, one call at a time.
  if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS)
    throw std::runtime_error("MPI_Init_thread failed");
  if (provided < MPI_THREAD_SERIALIZED) throw std::runtime_error("this MPI does not take calls from several threads");
  MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN);
}

// What the communicators of one group share (the group first made and those split from it): a
// failure in any of them ends them all, and the processes to watch are the whole group's.
struct GroupState {
  bool spawned = false;
  int rank = 0;                // this process's, in the whole group
  std::vector<int64_t> pids;   // by rank in the whole group
  bool failed = false;
  std::string error;
};

class MpiCommunicator : public Communicator {
 public:
  // inter: the intercommunicator of a spawned group (MPI_COMM_NULL for mpirun's world and for a
  // group split from another). state: the group this one was split from (null for a new group).
  MpiCommunicator(MPI_Comm comm, MPI_Comm inter, double timeout_s, std::shared_ptr<GroupState> state = nullptr)
      : comm_(comm), inter_(inter), timeout_s_(timeout_s), state_(std::move(state)) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    MPI_Comm local;
    MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local);
    MPI_Comm_size(local, &on_host_);
    MPI_Comm_free(&local);
    if (state_) return;
    state_ = std::make_shared<GroupState>();
    state_->spawned = inter != MPI_COMM_NULL;
    state_->rank = rank_;
    const int64_t pid = getpid();
    std::vector<int64_t> pids(static_cast<size_t>(size_));
    all_gather(&pid, sizeof pid, pids.data(), Wait::Forever);
    state_->pids = std::move(pids);
  }
  ~MpiCommunicator() override {
    try {
      close();
    } catch (...) {  // closing is best effort: the group's processes are ending anyway
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int ranks_on_this_host() const override { return on_host_; }
  bool is_open() const override { return open_ && !state_->failed; }

  void all_reduce_sum(float* data, size_t count) override {
    check(count);
    MPI_Request r;
    call(MPI_Iallreduce(MPI_IN_PLACE, data, int(count), MPI_FLOAT, MPI_SUM, comm_, &r), "all-reduce");
    wait(r, "an all-reduce", Wait::Timeout);
  }
  void all_gather(const void* send, size_t bytes, void* recv, Wait wait_for) override {
    check(bytes);
    MPI_Request r;
    call(MPI_Iallgather(send, int(bytes), MPI_BYTE, recv, int(bytes), MPI_BYTE, comm_, &r), "all-gather");
    wait(r, "an all-gather", wait_for);
  }
  void gather(const void* send, size_t bytes, void* recv, int root) override {
    check(bytes);
    MPI_Request r;
    call(MPI_Igather(send, int(bytes), MPI_BYTE, recv, int(bytes), MPI_BYTE, root, comm_, &r), "gather");
    wait(r, "a gather", Wait::Timeout);
  }
  void broadcast(void* data, size_t bytes, int root, Wait wait_for) override {
    check(bytes);
    MPI_Request r;
    call(MPI_Ibcast(data, int(bytes), MPI_BYTE, root, comm_, &r), "broadcast");
    wait(r, "a broadcast", wait_for);
  }
  void barrier() override {
    check(0);
    MPI_Request r;
    call(MPI_Ibarrier(comm_, &r), "barrier");
    wait(r, "a barrier", Wait::Timeout);
  }
  void send(const void* data, size_t bytes, int to) override {
    check(bytes);
    MPI_Request r;
    call(MPI_Isend(data, int(bytes), MPI_BYTE, to, 0, comm_, &r), "send");
    wait(r, "a send to the next stage", Wait::Timeout);
  }
  void recv(void* data, size_t bytes, int from) override {
    check(bytes);
    MPI_Request r;
    call(MPI_Irecv(data, int(bytes), MPI_BYTE, from, 0, comm_, &r), "receive");
    wait(r, "a receive from another stage", Wait::Timeout);
  }
  std::unique_ptr<Pending> start_broadcast(const void* data, size_t bytes) override {
    check(bytes);
    auto p = std::make_unique<MpiPending>(*this, "a broadcast");
    call(MPI_Ibcast(const_cast<void*>(data), int(bytes), MPI_BYTE, rank_, comm_, &p->request), "broadcast");
    return p;
  }
  std::unique_ptr<Pending> start_send(const void* data, size_t bytes, int to) override {
    check(bytes);
    auto p = std::make_unique<MpiPending>(*this, "a send to another stage");
    call(MPI_Isend(data, int(bytes), MPI_BYTE, to, 0, comm_, &p->request), "send");
    return p;
  }
  std::unique_ptr<Pending> start_recv(void* data, size_t bytes, int from) override {
    check(bytes);
    auto p = std::make_unique<MpiPending>(*this, "a receive from another stage");
    call(MPI_Irecv(data, int(bytes), MPI_BYTE, from, 0, comm_, &p->request), "receive");
    return p;
  }
  std::shared_ptr<Communicator> split(int color, int key) override {
    check(0);
    MPI_Comm comm;
    call(MPI_Comm_split(comm_, color, key, &comm), "split");
    return std::make_shared<MpiCommunicator>(comm, MPI_COMM_NULL, timeout_s_, state_);
  }

  void close() override {
    if (!open_) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized || state_->failed) {
      open_ = false;
      return;
    }
    barrier();  // every rank is here: nothing is in flight
    open_ = false;
    MPI_Comm_free(&comm_);
    if (inter_ != MPI_COMM_NULL) MPI_Comm_disconnect(&inter_);
  }

 private:
  struct MpiPending : Pending {
    MpiPending(MpiCommunicator& c, const char* w) : comm(c), what(w) {}
    ~MpiPending() override {
      try {
        wait();
      } catch (...) {  // the group has failed: its requests are abandoned with it
      }
    }
    void wait() override {
      if (request == MPI_REQUEST_NULL) return;
      if (comm.state_->failed) throw CommError(comm.state_->error);
      comm.wait(request, what, Wait::Timeout);
    }
    MpiCommunicator& comm;
    const char* what;
    MPI_Request request = MPI_REQUEST_NULL;
  };

  void check(size_t count) const {
    if (state_->failed) throw CommError(state_->error);
    if (!open_) throw CommError("the tensor-parallel group is closed");
    if (count > size_t(INT_MAX)) throw ValueError("a collective of more than 2^31 elements");
  }
  void call(int status, const char* what) {
    if (status != MPI_SUCCESS) fail(std::string("tensor parallelism: MPI could not start a ") + what);
  }

  // Polls r until it completes: tightly at first (a step's collectives take microseconds), then
  // yielding the core, then sleeping, so that a rank waiting for a slower one does not take the
  // core that one computes on.
  void wait(MPI_Request& r, const char* what, Wait wait_for) {
    const double start = now_s();
    double next_look = start + 0.1;
    for (int polls = 0;; ++polls) {
      int done = 0;
      if (MPI_Test(&r, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS)
        fail(std::string("tensor parallelism: ") + what + " failed (a rank is gone)");
      if (done) return;
      if (polls < 64) continue;
      const double t = now_s();
      if (t - start < 0.002) {
        sched_yield();
        continue;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(t - start < 0.1 ? 50 : 1000));
      if (t >= next_look) {
        next_look = t + 0.1;
        look_for_exited_ranks(what);
      }
      if (wait_for == Wait::Timeout && t - start > timeout_s_)
        fail("tensor parallelism: no rank answered " + std::string(what) + " within " + seconds(timeout_s_) +
             " (a rank exited, hangs, or lost its link); the group is ended");
    }
  }

  // Spawned ranks are processes of this machine: one that exited is seen without waiting for the
  // deadline. (The request it left pending stays so: its buffers are never written once the
  // group has failed, as no rank can complete it.)
  void look_for_exited_ranks(const char* what) {
    const GroupState& g = *state_;
    if (!g.spawned) return;
    for (size_t r = 0; r < g.pids.size(); ++r)
      if (int(r) != g.rank && kill(pid_t(g.pids[r]), 0) != 0 && errno == ESRCH)
        fail("tensor parallelism: rank " + std::to_string(r) + " (pid " + std::to_string(g.pids[r]) +
             ") exited during " + what + "; the group is ended");
  }

  [[noreturn]] void fail(const std::string& message) {
    GroupState& g = *state_;
    g.failed = true;
    g.error = message;
    g_abandoned = true;
    if (g.spawned && g.rank == 0)  // the followers this process started end with it
      for (size_t r = 1; r < g.pids.size(); ++r) kill(pid_t(g.pids[r]), SIGKILL);
    throw CommError(message);
  }

  static std::string seconds(double s) {
    std::string t = std::to_string(s);
    t.erase(t.find_last_not_of('0') + 1);
    if (t.back() == '.') t.pop_back();
    return t + " s";
  }

  MPI_Comm comm_, inter_;
  double timeout_s_;
  std::shared_ptr<GroupState> state_;
  int rank_ = 0, size_ = 1, on_host_ = 1;
  bool open_ = true;
};

void check_timeout(double timeout_s) {
  if (!(timeout_s > 0)) throw ValueError("the tensor-parallel timeout must be positive seconds");
}

}  // namespace

bool mpi_available() { return true; }

std::shared_ptr<Communicator> mpi_world(double timeout_s) {
  check_timeout(timeout_s);
  init_mpi();
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  return std::make_shared<MpiCommunicator>(comm, MPI_COMM_NULL, timeout_s);
}

std::shared_ptr<Communicator> mpi_spawn(int ranks, const std::string& program, const std::vector<std::string>& args,
                                        double timeout_s) {
  check_timeout(timeout_s);
  if (ranks < 2) throw ValueError("a spawned tensor-parallel group needs at least 2 ranks");
  init_mpi();
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  MPI_Info info;
  MPI_Info_create(&info);
  MPI_Info_set(info, "map_by", ":OVERSUBSCRIBE");  // more ranks than cores is the caller's choice
  // Not pinned to a core (rank 0, the caller's process, is not either): a pinned rank waits
  // whenever another process runs on its core, and the whole group with it.
  MPI_Info_set(info, "bind_to", "none");
  MPI_Comm inter;
  std::vector<int> errors(size_t(ranks - 1));
  const int status = MPI_Comm_spawn(program.c_str(), argv.data(), ranks - 1, info, 0, MPI_COMM_SELF, &inter,
                                    errors.data());
  MPI_Info_free(&info);
  if (status != MPI_SUCCESS)
    throw std::runtime_error("tensor parallelism: could not start " + std::to_string(ranks - 1) + " worker processes of " +
                             program);
  MPI_Comm comm;
  MPI_Intercomm_merge(inter, 0, &comm);  // this process first: rank 0
  return std::make_shared<MpiCommunicator>(comm, inter, timeout_s);
}

std::shared_ptr<Communicator> mpi_parent(double timeout_s) {
  check_timeout(timeout_s);
  init_mpi();
  MPI_Comm parent;
  MPI_Comm_get_parent(&parent);
  if (parent == MPI_COMM_NULL) throw ValueError("this process was not started by mpi_spawn");
  MPI_Comm comm;
  MPI_Intercomm_merge(parent, 1, &comm);
  return std::make_shared<MpiCommunicator>(comm, parent, timeout_s);
}

void mpi_finalize() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized && !g_abandoned) MPI_Finalize();
}

}  // namespace ferrum
