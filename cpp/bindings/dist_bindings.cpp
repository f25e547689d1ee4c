// Tensor parallelism's groups (MPI) and the followers' loop; python/ferrum/dist.py builds on them.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "dist/mpi_communicator.h"
#include "engine/follower.h"
#include "engine/rank_orders.h"

namespace py = pybind11;

namespace ferrum::bindings {

void bind_dist(py::module_& m) {
  py::class_<Communicator, std::shared_ptr<Communicator>>(
      m, "Communicator", "The ranks of a tensor-parallel group (pass it to ModelRunner as group=).")
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("ranks_on_this_host", &Communicator::ranks_on_this_host)
      .def_property_readonly("is_open", &Communicator::is_open)
      .def("close", &Communicator::close, py::call_guard<py::gil_scoped_release>(),
           "Leaves the group (a collective while it is open).")
      .def("all_reduce_sum", [](Communicator& c, py::array_t<float, py::array::c_style> a) {
             py::buffer_info b = a.request(true);
             py::gil_scoped_release nogil;
             c.all_reduce_sum(static_cast<float*>(b.ptr), size_t(b.size));
           }, py::arg("a"),
           "a (float32, in place) = its sum over the ranks; every rank calls it. For benchmarks and tests: "
           "not on a group that runs a model.");
  m.def("mpi_available", &mpi_available, "Whether this build has tensor parallelism over MPI.");
  m.def("mpi_world", &mpi_world, py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>(),
        "The ranks mpirun started, as one group.");
  m.def("mpi_spawn", &mpi_spawn, py::arg("ranks"), py::arg("program"), py::arg("args"), py::arg("timeout_s"),
        py::call_guard<py::gil_scoped_release>(),
        "This process as rank 0 and ranks - 1 processes of `program args` started on this machine, "
        "which join with mpi_parent().");
  m.def("mpi_parent", &mpi_parent, py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>(),
        "The group of the process that spawned this one.");
  m.def("mpi_finalize", &mpi_finalize, py::call_guard<py::gil_scoped_release>());
  m.def("follow_orders", &follow_orders, py::arg("group"), py::call_guard<py::gil_scoped_release>(),
        "A rank other than 0: loads and runs the models rank 0 orders until it ends the group.");
  m.def("end_group", &end_group, py::arg("group"), py::call_guard<py::gil_scoped_release>(),
        "Rank 0: ends the other ranks' loops and closes the group.");
}

}  // namespace ferrum::bindings
