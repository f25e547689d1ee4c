// ferrum._core.opencl: what only the OpenCL backend has: its device description, program cache
// counters and per-launch device timings (for bench/opencl_bench.py).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "backend/backend.h"
#include "core/error.h"
#if FERRUM_HAVE_OPENCL
#include "backend/opencl/cl_backend.h"
#endif

namespace py = pybind11;

namespace ferrum::bindings {

void bind_opencl(py::module_& parent) {
  py::module_ m = parent.def_submodule("opencl", "OpenCL backend introspection");
#if !FERRUM_HAVE_OPENCL
  m.attr("available") = false;
#else
  m.attr("available") = true;
  auto cl_backend = [](Backend& b) -> ocl::ClBackend& {
    auto* c = dynamic_cast<ocl::ClBackend*>(&b);
    if (!c) throw ValueError("not an OpenCL backend: " + b.name());
    return *c;
  };
  auto cl_stream = [](Stream& s) -> ocl::ClStream& {
    auto* c = dynamic_cast<ocl::ClStream*>(&s);
    if (!c) throw ValueError("not an OpenCL stream");
    return *c;
  };
  m.def("device_info", [cl_backend](Backend& b) {
    ocl::ClBackend& c = cl_backend(b);
    const ocl::DeviceInfo& i = c.device_info();
    py::dict d;
    d["platform"] = i.platform_name;
    d["device"] = i.device_name;
    d["driver_version"] = i.driver_version;
    d["device_version"] = i.device_version;
    d["max_alloc_bytes"] = i.max_alloc_bytes;
    d["global_mem_bytes"] = i.global_mem_bytes;
    d["compute_units"] = i.compute_units;
    d["kernels"] = ocl::family_name(c.family());
    d["gpu_defines"] = c.tuning().defines();  // the gpu family's sizes (and -DNV_ASM while it builds)
    d["gpu"] = i.gpu;
    d["command_buffer"] = i.command_buffer;
    d["local_mem_bytes"] = i.local_mem_bytes;
    d["programs_built"] = c.programs().built_from_source();
    d["programs_from_cache"] = c.programs().loaded_from_disk();
    return d;
  }, py::arg("backend"), "Device and program-cache facts of an OpenCL backend.");
  m.def("set_profiling", [cl_stream](Stream& s, bool on) { cl_stream(s).set_profiling(on); },
        py::arg("stream"), py::arg("on"), "Record an event per launch on later submits.");
  m.def("set_command_buffer", [cl_stream](Stream& s, bool on) { cl_stream(s).set_command_buffer(on); },
        py::arg("stream"), py::arg("on"),
        "Replay the stream through a cl_khr_command_buffer where the device has one (default: on "
        "for the gpu kernel family).");
  m.def("uses_command_buffer", [cl_stream](Stream& s) { return cl_stream(s).uses_command_buffer(); },
        py::arg("stream"), "Whether submit() replays the stream as one command buffer.");
  m.def("submit_counters", [] {
    const ocl::SubmitCounters c = ocl::submit_counters();
    py::dict d;
    d["submits"] = c.submits;
    d["launches"] = c.launches;
    d["command_buffer_submits"] = c.command_buffer_submits;
    d["host_seconds"] = c.host_seconds;
    return d;
  }, "Totals over every OpenCL stream of the process: submit() calls, the launches they enqueued, "
     "how many went as one command buffer, and the host seconds spent in submit().");
  m.def("programs_requested", [] {
    py::list out;
    for (const ocl::ProgramRequest& r : ocl::programs_requested()) out.append(py::make_tuple(r.sources, r.options));
    return out;
  }, "[(kernel source names, build options)] of every program this process's OpenCL backends asked for.");
  m.def("kernel_times", [cl_stream](Stream& s) {
    ocl::ClStream& c = cl_stream(s);
    py::gil_scoped_release nogil;
    return c.kernel_times();
  }, py::arg("stream"), "[(launch name, device ns)] of the profiled submits since the last call.");
#endif
}

}  // namespace ferrum::bindings
