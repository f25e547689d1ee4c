// INTERIM: replaced by the quant branch's bindings.
#include <pybind11/pybind11.h>
namespace ferrum::bindings {
void bind_quant(pybind11::module_&) {}
}  // namespace ferrum::bindings
