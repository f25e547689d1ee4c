// File readers exposed for the Python layer (an opened model file, whose GGUF metadata feeds the
// tokenizer) and tests.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/error.h"
#include "io/gguf.h"
#include "io/llama2c.h"
#include "io/safetensors.h"
#include "model/model_file.h"
#include "quant/quant.h"

namespace py = pybind11;

namespace ferrum::bindings {

namespace {
py::object to_python(const GgufValue& v) {
  switch (v.kind) {
    case GgufValue::Kind::Int: return py::int_(v.i);
    case GgufValue::Kind::UInt: return py::int_(v.u);
    case GgufValue::Kind::Float: return py::float_(v.f);
    case GgufValue::Kind::Bool: return py::bool_(v.b);
    case GgufValue::Kind::String: {
      // A new reference: stolen, not borrowed (py::str(PyObject*) would keep every string alive).
      // Strict: the reader has refused strings that are not UTF-8.
      PyObject* s = PyUnicode_DecodeUTF8(v.s.data(), py::ssize_t(v.s.size()), "strict");
      if (!s) throw py::error_already_set();
      return py::reinterpret_steal<py::str>(s);
    }
    case GgufValue::Kind::Array: {
      py::list l(v.array.size());
      for (size_t i = 0; i < v.array.size(); ++i) l[i] = to_python(v.array[i]);
      return std::move(l);
    }
  }
  return py::none();
}

py::dict tensor_table(const WeightSource& ws) {
  py::dict d;
  for (auto& [name, t] : ws.tensors) d[py::str(name)] = py::make_tuple(std::string(dtype_name(t.dtype)), t.shape);
  return d;
}

py::dict metadata_dict(const std::map<std::string, GgufValue>& metadata) {
  py::dict d;
  for (auto& [k, v] : metadata) d[py::str(k)] = to_python(v);
  return d;
}
}  // namespace

void bind_io(py::module_& m) {
  py::class_<ModelFile>(m, "ModelFile",
                        "A model file opened and checked (format, config, tensor table), before its weights load: "
                        "ModelRunner(model_file, ...) loads them from the same open file.")
      .def(py::init([](const std::string& path) {
             py::gil_scoped_release nogil;
             return open_model_file(path);
           }),
           py::arg("path"))
      .def_readonly("path", &ModelFile::path)
      .def_readonly("format", &ModelFile::format)
      .def_property_readonly("vocab_size", [](const ModelFile& f) { return f.config.vocab; })
      .def_property_readonly("tensors", [](const ModelFile& f) { return tensor_table(f.weights); },
                             "{name: (dtype, shape)} of the weights as ferrum holds them (a quantized checkpoint's "
                             "modules translated to block types).")
      .def("dequantized", [](const ModelFile& f, const std::string& name) {
        const TensorInfo* t = f.weights.find(name);
        if (!t) throw ValueError("no tensor '" + name + "' in " + f.path);
        int64_t n = 1;
        for (int64_t d : t->shape) n *= d;
        py::array_t<float> out(std::vector<py::ssize_t>(t->shape.begin(), t->shape.end()));
        quant::dequantize_row(t->dtype, t->data, out.mutable_data(), n);
        if (const GroupOffsets* go = t->group_offsets.get()) {  // s (q - 128) + s (128 - z): exact
          const int64_t K = t->shape[1];
          for (int64_t r = 0; r < t->shape[0]; ++r)
            for (int64_t j = 0; j < K; ++j)
              out.mutable_data()[r * K + j] += go->offsets[size_t(r * go->groups + go->block_groups[size_t(j / 32)])];
        }
        if (!t->input_order) return out;
        const std::vector<int32_t>& order = *t->input_order;  // back into the inputs' order
        const int64_t K = int64_t(order.size()), rows = n / K;
        py::array_t<float> ordered(std::vector<py::ssize_t>(t->shape.begin(), t->shape.end()));
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < K; ++j) ordered.mutable_data()[r * K + order[size_t(j)]] = out.data()[r * K + j];
        return ordered;
      }, py::arg("name"), "A weight as f32, dequantized from the type ferrum holds it in (columns in the inputs' order).")
      .def("input_order", [](const ModelFile& f, const std::string& name) -> py::object {
        const TensorInfo* t = f.weights.find(name);
        if (!t) throw ValueError("no tensor '" + name + "' in " + f.path);
        if (!t->input_order) return py::none();
        return py::cast(*t->input_order);
      }, py::arg("name"), "The order of the inputs a weight's columns hold (GPTQ act-order), or None: in order.")
      .def_property_readonly("file_bytes", [](const ModelFile& f) { return f.weights.file_bytes(); },
                             "The sizes of the files the weights live in, added up.")
      .def("pop_tokenizer_metadata", [](ModelFile& f) {
        py::dict d = metadata_dict(f.tokenizer_metadata);
        f.tokenizer_metadata.clear();
        return d;
      }, "GGUF's tokenizer.* metadata as Python values (arrays become lists), dropped from the file object.");

  m.def("gguf_metadata", [](const std::string& path) {
    GgufFile g;
    {
      py::gil_scoped_release nogil;
      g = GgufFile::open(path);
    }
    return metadata_dict(g.metadata);
  }, py::arg("path"), "GGUF metadata as a dict of Python values (arrays become lists).");
  m.def("gguf_tensors", [](const std::string& path) { return tensor_table(GgufFile::open(path).weights); },
        py::arg("path"), "{name: (dtype, shape)} of a GGUF file.");
  m.def("gguf_read", [](const std::string& path) {
    GgufFile g;
    {
      py::gil_scoped_release nogil;
      g = GgufFile::open(path);
    }
    py::dict tensors;
    for (auto& [name, t] : g.weights.tensors) {
      int64_t n = 1;
      for (int64_t d : t.shape) n *= d;
      py::array_t<float> a(std::vector<py::ssize_t>(t.shape.begin(), t.shape.end()));
      quant::dequantize_row(t.dtype, t.data, a.mutable_data(), n);
      tensors[py::str(name)] = py::make_tuple(std::string(dtype_name(t.dtype)), a);
    }
    return py::make_tuple(metadata_dict(g.metadata), tensors);
  }, py::arg("path"),
        "(metadata, {name: (dtype, f32 array)}) of a GGUF file, every tensor dequantized (for small files: "
        "adapters).");
  m.def("safetensors_tensors", [](const std::string& dir) { return tensor_table(open_safetensors_dir(dir)); },
        py::arg("dir"), "{name: (dtype, shape)} of a safetensors model directory.");
  m.def("llama2c_tensors", [](const std::string& path) {
    Llama2cHeader h;
    return tensor_table(open_llama2c(path, &h));
  }, py::arg("path"));
}

}  // namespace ferrum::bindings
