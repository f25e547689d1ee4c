// A build without MPI (FERRUM_MPI off or no MPI found): tensor parallelism is not there.
#include "core/error.h"
#include "dist/mpi_communicator.h"

namespace ferrum {

namespace {
[[noreturn]] void unavailable() {
  throw ValueError("this ferrum was built without MPI, so it has no tensor parallelism (install OpenMPI, e.g. "
                   "Debian's libopenmpi-dev and openmpi-bin, and rebuild: docs/distributed.md)");
}
}  // namespace

bool mpi_available() { return false; }
std::shared_ptr<Communicator> mpi_world(double) { unavailable(); }
std::shared_ptr<Communicator> mpi_spawn(int, const std::string&, const std::vector<std::string>&, double) {
  unavailable();
}
std::shared_ptr<Communicator> mpi_parent(double) { unavailable(); }
void mpi_finalize() {}

}  // namespace ferrum
