// ferrum._core: one bind_* function per area, each in its own file.
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace ferrum::bindings {
void bind_core(py::module_& m);     // errors, dtypes, cpu features, thread pool
void bind_backend(py::module_& m);  // Backend, Tensor, Stream, ops
void bind_quant(py::module_& m);    // reference (de)quantizers and dot kernels
void bind_io(py::module_& m);       // GGUF / safetensors / llama2.c readers
void bind_model(py::module_& m);    // the decoder and its KV pool
void bind_opencl(py::module_& m);   // OpenCL device info and launch timings
void bind_engine(py::module_& m);   // the continuous-batching scheduler
void bind_dist(py::module_& m);     // tensor-parallel groups
}  // namespace ferrum::bindings

PYBIND11_MODULE(_core, m) {
  m.doc() = "ferrum's C++ engine";
  using namespace ferrum::bindings;
  bind_core(m);
  bind_backend(m);
  bind_quant(m);
  bind_io(m);
  bind_model(m);
  bind_opencl(m);
  bind_engine(m);
  bind_dist(m);
}
