#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/cpu_features.h"
#include "core/dtype.h"
#include "core/error.h"

namespace py = pybind11;

namespace ferrum::bindings {

void bind_core(py::module_& m) {
  // ferrum::ValueError / FormatError derive from std::invalid_argument, which pybind11 already
  // maps to ValueError; ResourceError becomes MemoryError.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ResourceError& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    }
  });
  cpu_features();  // reads FERRUM_CPU_ISA now: a bad value fails the import, not a kernel call
  m.def("cpu_features", [] { return cpu_features().str(); },
        "The x86 features detected at run time, space separated.");
  m.def("dtype_names", [] {
    std::vector<std::string> names;
    for (int i = 0; i <= static_cast<int>(kLastType); ++i) names.push_back(dtype_name(static_cast<DType>(i)));
    return names;
  });
  m.def("dtype_block", [](const std::string& name) {
    const DTypeInfo& i = dtype_info(dtype_from_name(name));
    return py::make_tuple(i.block_elems, i.block_bytes);
  }, "(elements, bytes) of one block of the named dtype.");
}

}  // namespace ferrum::bindings
