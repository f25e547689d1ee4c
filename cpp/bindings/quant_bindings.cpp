// ferrum._core.quant: the reference (de)quantizers and the dot kernels, for tests and tools.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "quant/quant.h"

namespace py = pybind11;

namespace ferrum::bindings {

namespace {

// Raw bytes from a bytes / bytearray / uint8 array argument.
std::string as_bytes(const py::object& data) {
  if (py::isinstance<py::bytes>(data)) return data.cast<std::string>();
  if (py::isinstance<py::bytearray>(data)) return std::string(data.cast<py::bytearray>());
  if (py::isinstance<py::array>(data)) {
    auto arr = py::array_t<uint8_t, py::array::c_style>::ensure(data);
    if (!arr || !py::isinstance<py::array_t<uint8_t>>(data))
      throw ValueError("expected bytes or a uint8 array");
    return std::string(reinterpret_cast<const char*>(arr.data()), size_t(arr.size()));
  }
  throw ValueError("expected bytes or a uint8 array");
}

void check_multiple(DType t, int64_t n) {
  const int block = dtype_info(t).block_elems;
  FERRUM_CHECK(n >= 0 && n % block == 0, std::string("n=") + std::to_string(n) +
                                             " is not a multiple of the " + dtype_name(t) +
                                             " block size " + std::to_string(block));
}

py::array_t<float> dequantize(const std::string& dtype, const py::object& data, int64_t n) {
  const DType t = dtype_from_name(dtype);
  check_multiple(t, n);
  const std::string bytes = as_bytes(data);
  FERRUM_CHECK(bytes.size() == dtype_bytes(t, n),
               "dequantize: " + std::to_string(n) + " " + dtype + " elements need " +
                   std::to_string(dtype_bytes(t, n)) + " bytes, got " +
                   std::to_string(bytes.size()));
  py::array_t<float> out(n);
  quant::dequantize_row(t, bytes.data(), out.mutable_data(), n);
  return out;
}

py::array_t<uint8_t> quantize(const std::string& dtype,
                              py::array_t<float, py::array::c_style | py::array::forcecast> x) {
  const DType t = dtype_from_name(dtype);
  FERRUM_CHECK(x.ndim() == 1, "quantize: x must be 1-D");
  const int64_t n = x.shape(0);
  check_multiple(t, n);
  py::array_t<uint8_t> out(py::ssize_t(dtype_bytes(t, n)));
  quant::quantize_row(t, x.data(), out.mutable_data(), n);
  return out;
}

py::array_t<float> dot(const std::string& dtype, const py::object& w,
                       py::array_t<float, py::array::c_style | py::array::forcecast> act,
                       int64_t rows, int64_t n, const std::string& isa) {
  const DType t = dtype_from_name(dtype);
  check_multiple(t, n);
  FERRUM_CHECK(rows >= 0, "dot: rows must be >= 0");
  FERRUM_CHECK(act.ndim() == 1 && act.shape(0) == n,
               "dot: act must be a 1-D array of n=" + std::to_string(n) + " floats");
  const quant::DotKernel* k = nullptr;
  if (isa == "best") {
    if (quant::dot_kernel_isas(t).empty())
      throw ValueError("dot: no dot kernel for dtype " + dtype);
    k = &quant::dot_kernel(t);
  } else {
    k = quant::dot_kernel_for_isa(t, isa.c_str());
    FERRUM_CHECK(k != nullptr, "dot: no '" + isa + "' kernel for " + dtype + " on this CPU");
  }
  const std::string wb = as_bytes(w);
  const size_t row_bytes = dtype_bytes(t, n);
  FERRUM_CHECK(wb.size() == row_bytes * size_t(rows),
               "dot: w must hold rows * " + std::to_string(row_bytes) + " bytes, got " +
                   std::to_string(wb.size()));
  std::vector<uint8_t> aq(dtype_bytes(k->act_type, n));
  quant::quantize_row(k->act_type, act.data(), aq.data(), n);
  py::array_t<float> out(rows);
  {
    py::gil_scoped_release release;
    k->dot_rows(n, wb.data(), row_bytes, rows, aq.data(), out.mutable_data());
  }
  return out;
}

std::vector<std::string> isas(const std::string& dtype) {
  std::vector<std::string> out;
  for (const char* i : quant::dot_kernel_isas(dtype_from_name(dtype))) out.emplace_back(i);
  return out;
}

}  // namespace

void bind_quant(py::module_& m) {
  py::module_ q = m.def_submodule("quant", "GGUF block formats and dot kernels");
  q.def("dequantize", &dequantize, py::arg("dtype"), py::arg("data"), py::arg("n"),
        "Decode n elements of a dtype ('q4_k', 'f16', ...) from bytes / a uint8 array to f32.");
  q.def("quantize", &quantize, py::arg("dtype"), py::arg("x"),
        "Round-to-nearest reference quantization of a 1-D f32 array; returns the bytes.");
  q.def("dot", &dot, py::arg("dtype"), py::arg("w"), py::arg("act"), py::arg("rows"),
        py::arg("n"), py::arg("isa") = "best",
        "rows dot products of consecutive weight rows with act (quantized to the kernel's "
        "activation type first); isa is 'best', 'avx512', 'avx2' or 'scalar'.");
  q.def("isas", &isas, py::arg("dtype"), "ISAs with a dot kernel for dtype on this CPU.");
  q.def("has_gemm", [](const std::string& dtype) { return quant::gemm_kernel(dtype_from_name(dtype)) != nullptr; },
        py::arg("dtype"),
        "Whether prefill matmuls with dtype weights run the int8 GEMM (8-bit activations) on this CPU.");
}

}  // namespace ferrum::bindings
