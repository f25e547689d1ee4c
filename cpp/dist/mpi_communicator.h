// Tensor-parallel groups over MPI (OpenMPI). A process joins MPI at its first group, as one of:
//  - mpi_world(): the ranks an `mpirun -np N` started, this process among them;
//  - mpi_spawn(n, program, args): this process (not started by mpirun: an MPI singleton) as rank 0
//    and n - 1 processes of `program args` that it starts on this machine, each of which joins
//    with mpi_parent().
// Collectives poll non-blocking MPI calls against a deadline of timeout_s seconds. In a spawned
// group every rank also watches the others' processes (they are on this machine): one that exited
// ends the collective at once, and when a collective fails rank 0 kills the rest. Under mpirun,
// mpirun itself ends the job when a rank exits.
//
// Without MPI (FERRUM_MPI off) mpi_available() is false and the others throw ValueError.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "dist/communicator.h"

namespace ferrum {

bool mpi_available();
std::shared_ptr<Communicator> mpi_world(double timeout_s);
std::shared_ptr<Communicator> mpi_spawn(int ranks, const std::string& program, const std::vector<std::string>& args,
                                        double timeout_s);
std::shared_ptr<Communicator> mpi_parent(double timeout_s);
// Ends MPI in this process, after its groups are closed. A group whose collective failed cannot
// be left cleanly: MPI is then left as it is (the process is about to exit).
void mpi_finalize();

}  // namespace ferrum
