// Backend, Tensor, Stream and the op set, for tests (every op against numpy, CPU vs OpenCL)
// and for tools. Each op takes an optional stream; without one it runs eagerly.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "backend/backend.h"
#include "core/error.h"

namespace py = pybind11;

namespace ferrum::bindings {

namespace {

Shape shape_of(const py::array& a) {
  Shape s;
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s.push_back(a.shape(i));
  return s;
}

Tensor tensor_from_numpy(Backend& be, py::array a) {
  DType dt;
  if (py::isinstance<py::array_t<float>>(a)) dt = DType::F32;
  else if (py::isinstance<py::array_t<int32_t>>(a)) dt = DType::I32;
  else if (a.dtype().kind() == 'f' && a.itemsize() == 2) dt = DType::F16;
  else if (a.dtype().kind() == 'i' && a.itemsize() == 1) dt = DType::I8;
  else throw ValueError("unsupported numpy dtype " + std::string(py::str(a.dtype())) +
                        " (use float32, int32, float16 or int8; tensor_raw for bf16 / quantized)");
  auto c = py::array::ensure(a, py::array::c_style);
  return be.from_host(c.data(), dt, shape_of(c));
}

py::array tensor_to_numpy(Backend& be, const Tensor& t) {
  py::array out;
  std::vector<py::ssize_t> shape(t.shape.begin(), t.shape.end());
  switch (t.dtype) {
    case DType::F32: out = py::array_t<float>(shape); break;
    case DType::I32: out = py::array_t<int32_t>(shape); break;
    case DType::I8: out = py::array_t<int8_t>(shape); break;
    case DType::F16: out = py::array(py::dtype("float16"), shape); break;
    case DType::BF16: out = py::array_t<uint16_t>(shape); break;
    default: out = py::array_t<uint8_t>({py::ssize_t(t.nbytes())}); break;  // raw blocks
  }
  {
    py::gil_scoped_release nogil;
    be.download(t, out.mutable_data(), t.nbytes());
  }
  return out;
}

// Runs fn on the given stream, or eagerly on a temporary one.
template <typename F>
void on_stream(Backend& be, Stream* s, F&& fn) {
  if (s) {
    fn(*s);
    return;
  }
  auto tmp = be.new_stream();
  fn(*tmp);
  py::gil_scoped_release nogil;
  tmp->submit();
  tmp->sync();
}

}  // namespace

void bind_backend(py::module_& m) {
  py::enum_<RopeLayout>(m, "RopeLayout")
      .value("half_split", RopeLayout::HalfSplit)
      .value("interleaved", RopeLayout::Interleaved);

  py::class_<Tensor>(m, "Tensor")
      .def_property_readonly("shape", [](const Tensor& t) { return t.shape; })
      .def_property_readonly("dtype", [](const Tensor& t) { return std::string(dtype_name(t.dtype)); })
      .def_property_readonly("nbytes", &Tensor::nbytes)
      .def("slice", &Tensor::slice, py::arg("begin"), py::arg("count"))
      .def("reshape", &Tensor::reshape)
      .def("numpy", [](const Tensor& t) { return tensor_to_numpy(*t.storage->backend, t); })
      .def("upload", [](const Tensor& t, py::array a) {
        auto c = py::array::ensure(a, py::array::c_style);
        FERRUM_CHECK(size_t(c.nbytes()) == t.nbytes(),
                     "upload: " + std::to_string(c.nbytes()) + " bytes for " + t.str());
        t.storage->backend->upload(t, c.data(), t.nbytes());
      })
      .def("__repr__", [](const Tensor& t) { return "Tensor(" + t.str() + ")"; });

  py::class_<Stream>(m, "Stream")
      .def("submit", &Stream::submit, py::call_guard<py::gil_scoped_release>())
      .def("sync", &Stream::sync, py::call_guard<py::gil_scoped_release>())
      .def("clear", &Stream::clear)
      .def_readwrite("decode_rows", &Stream::decode_rows,
                     "Set before recording: the stream is a batch of this many decodes (see backend.h).")
      .def_readwrite("float_activations", &Stream::float_activations,
                     "Set before recording: matmuls keep f32 activations (scoring; see backend.h).")
      .def("__len__", &Stream::size);

  py::class_<RopeTable>(m, "RopeTable")
      .def(py::init([](Tensor cos, Tensor sin, RopeLayout layout) { return RopeTable{cos, sin, layout}; }),
           py::arg("cos"), py::arg("sin"), py::arg("layout") = RopeLayout::HalfSplit);
  py::class_<AttnParams>(m, "AttnParams")
      .def(py::init([](int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, int64_t window) {
             return AttnParams{heads, kv_heads, head_dim, scale, window};
           }),
           py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("scale"),
           py::arg("window") = 0);
  py::class_<AttnBatch>(m, "AttnBatch")
      .def(py::init([](Tensor seq, Tensor pos, Tensor slots, Tensor tables) {
             return AttnBatch{seq, pos, slots, tables};
           }),
           py::arg("token_seq"), py::arg("token_pos"), py::arg("slot_mapping"), py::arg("block_tables"));
  py::class_<KvLayer>(m, "KvLayer")
      .def(py::init([](Tensor k, Tensor v, std::optional<Tensor> ks, std::optional<Tensor> vs) {
             return KvLayer{k, v, ks.value_or(Tensor{}), vs.value_or(Tensor{})};
           }),
           py::arg("k"), py::arg("v"), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());

  using OptT = std::optional<Tensor>;
  auto opt = [](const OptT& t) { return t.value_or(Tensor{}); };
  py::class_<Backend, std::shared_ptr<Backend>>(m, "Backend")
      .def_property_readonly("name", &Backend::name)
      .def("supports", [](Backend& b, const std::string& op, const std::string& dtype) {
        for (int i = 0; i <= static_cast<int>(Op::GroupOffsets); ++i)  // the last op
          if (op == op_name(static_cast<Op>(i))) return b.supports(static_cast<Op>(i), dtype_from_name(dtype));
        throw ValueError("unknown op '" + op + "'");
      }, py::arg("op"), py::arg("weight_dtype") = "f32")
      .def("tensor", &tensor_from_numpy, py::keep_alive<0, 1>(), "Copy a numpy array to the backend.")
      .def("tensor_raw", [](Backend& b, py::buffer data, const std::string& dtype, Shape shape) {
        py::buffer_info info = data.request();
        DType dt = dtype_from_name(dtype);
        Tensor probe;
        probe.dtype = dt;
        probe.shape = shape;
        FERRUM_CHECK(probe.cols() % dtype_info(dt).block_elems == 0, "last dim is not a multiple of the block size");
        FERRUM_CHECK(size_t(info.size * info.itemsize) == probe.nbytes(),
                     "tensor_raw: got " + std::to_string(info.size * info.itemsize) + " bytes, " +
                         probe.str() + " needs " + std::to_string(probe.nbytes()));
        return b.from_host(info.ptr, dt, shape);
      }, py::keep_alive<0, 1>(), py::arg("data"), py::arg("dtype"), py::arg("shape"),
         "A tensor from raw bytes (bf16 as uint16, quantized blocks as uint8).")
      .def("pack_weight", [](Backend& b, const Tensor& w) { return b.pack_weight(w, {}); },
           py::keep_alive<0, 1>(), py::arg("w"),
           "w as the loader leaves a linear / embedding weight: in the layout this backend reads fastest "
           "(a copy, w repacked in place, or w itself).")
      .def("empty", [](Backend& b, const std::string& dtype, Shape shape) {
        return b.alloc(dtype_from_name(dtype), shape);
      }, py::keep_alive<0, 1>(), py::arg("dtype"), py::arg("shape"))
      .def("stream", &Backend::new_stream, py::keep_alive<0, 1>())
      .def("embedding", [](Backend& b, Tensor ids, Tensor table, Tensor out, Stream* s) {
        on_stream(b, s, [&](Stream& st) { b.embedding(st, ids, table, out); });
      }, py::arg("ids"), py::arg("table"), py::arg("out"), py::arg("stream") = nullptr)
      .def("linear", [opt](Backend& b, Tensor x, Tensor w, OptT bias, Tensor out, int64_t out_col, Stream* s) {
        on_stream(b, s, [&](Stream& st) { b.linear(st, x, w, opt(bias), out, out_col); });
      }, py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("out"), py::arg("out_col") = 0,
         py::arg("stream") = nullptr)
      .def("rms_norm", [](Backend& b, Tensor x, Tensor w, float eps, Tensor out, Stream* s) {
        on_stream(b, s, [&](Stream& st) { b.rms_norm(st, x, w, eps, out); });
      }, py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("out"), py::arg("stream") = nullptr)
      .def("add_rms_norm", [](Backend& b, Tensor r, Tensor x, Tensor w, float eps, Tensor out, Stream* s) {
        on_stream(b, s, [&](Stream& st) { b.add_rms_norm(st, r, x, w, eps, out); });
      }, py::arg("residual"), py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("out"), py::arg("stream") = nullptr)
      .def("qkv_to_cache", [opt](Backend& b, Tensor qkv, OptT qn, OptT kn, float eps, const RopeTable& rope,
                              const AttnBatch& batch, const AttnParams& p, Tensor q_out, const KvLayer& kv, Stream* s) {
        on_stream(b, s, [&](Stream& st) { b.qkv_to_cache(st, qkv, opt(qn), opt(kn), eps, rope, batch, p, q_out, kv); });
      }, py::arg("qkv"), py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"), py::arg("rope"),
         py::arg("batch"), py::arg("params"), py::arg("q_out"), py::arg("kv"), py::arg("stream") = nullptr)
      .def("paged_attention", [](Backend& b, Tensor q, const KvLayer& kv, const AttnBatch& batch,
                                 const AttnParams& p, Tensor out, Stream* s) {
        on_stream(b, s, [&](Stream& st) { b.paged_attention(st, q, kv, batch, p, out); });
      }, py::arg("q"), py::arg("kv"), py::arg("batch"), py::arg("params"), py::arg("out"), py::arg("stream") = nullptr)
      .def("swiglu", [](Backend& b, Tensor gu, Tensor out, Stream* s) {
        on_stream(b, s, [&](Stream& st) { b.swiglu(st, gu, out); });
      }, py::arg("gate_up"), py::arg("out"), py::arg("stream") = nullptr)
      .def("gather_rows", [](Backend& b, Tensor x, Tensor idx, Tensor out, Stream* s) {
        on_stream(b, s, [&](Stream& st) { b.gather_rows(st, x, idx, out); });
      }, py::arg("x"), py::arg("idx"), py::arg("out"), py::arg("stream") = nullptr)
      .def("gather_columns", [](Backend& b, Tensor x, Tensor idx, Tensor out, Stream* s) {
        on_stream(b, s, [&](Stream& st) { b.gather_columns(st, x, idx, out); });
      }, py::arg("x"), py::arg("idx"), py::arg("out"), py::arg("stream") = nullptr)
      .def("add_group_offsets", [](Backend& b, Tensor x, Tensor block_groups, Tensor offsets, Tensor out, Stream* s) {
        on_stream(b, s, [&](Stream& st) { b.add_group_offsets(st, x, block_groups, offsets, out); });
      }, py::arg("x"), py::arg("block_groups"), py::arg("offsets"), py::arg("out"), py::arg("stream") = nullptr)
      .def("moe_route", [](Backend& b, Tensor logits, int64_t top_k, bool normalize, Tensor ids, Tensor weights,
                           Stream* s) {
        on_stream(b, s, [&](Stream& st) { b.moe_route(st, logits, top_k, normalize, ids, weights); });
      }, py::arg("logits"), py::arg("top_k"), py::arg("normalize"), py::arg("ids"), py::arg("weights"),
         py::arg("stream") = nullptr)
      .def("moe_experts", [](Backend& b, Tensor x, Tensor gate, Tensor up, Tensor down, Tensor ids, Tensor weights,
                             Tensor out, Stream* s, py::dict offsets, py::dict input_orders) {
        MoeExtras o;
        for (auto [name, into] : {std::pair{"gate", &o.gate}, std::pair{"up", &o.up}, std::pair{"down", &o.down}}) {
          if (!offsets.contains(name)) continue;
          const auto pair = offsets[name].cast<std::pair<Tensor, Tensor>>();
          *into = {pair.first, pair.second};
        }
        if (input_orders.contains("gate_up")) o.gate_up_order = input_orders["gate_up"].cast<Tensor>();
        if (input_orders.contains("down")) o.down_order = input_orders["down"].cast<Tensor>();
        on_stream(b, s, [&](Stream& st) { b.moe_experts(st, x, gate, up, down, ids, weights, out, o); });
      }, py::arg("x"), py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("ids"), py::arg("weights"),
         py::arg("out"), py::arg("stream") = nullptr, py::arg("offsets") = py::dict(),
         py::arg("input_orders") = py::dict(),
         "offsets: {'gate' | 'up' | 'down': (offsets f32 [E, G, N], block_groups i32 [K / 32])} for asymmetric "
         "8-bit experts; input_orders: {'gate_up': i32 [E, H], 'down': i32 [E, I]} for act-order ones "
         "(Backend::moe_experts)");

  m.def("make_backend", &make_backend, py::arg("device") = "cpu", py::arg("num_threads") = 0,
        py::arg("opencl_kernels") = "",
        "Create a backend: 'cpu' or 'opencl[:platform[:device]]'. opencl_kernels: the OpenCL kernel "
        "family, 'gpu' or 'cpu' (default: by device type, or FERRUM_OPENCL_KERNELS).");
}

}  // namespace ferrum::bindings
