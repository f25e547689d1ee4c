// ferrum._cpu_check: imported before ferrum._core, it fails with an ImportError that says why on
// a CPU below the level the build was compiled for (FERRUM_BASELINE_V3: the portable build's
// x86-64-v3), where loading _core could stop the process on an illegal instruction. It is
// compiled for plain x86-64 (CMakeLists.txt), so it runs on any CPU.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

namespace {

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_cpu_check",
                          "Checks the CPU against the level ferrum._core was compiled for.", -1,
                          nullptr, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__cpu_check() {
#if FERRUM_BASELINE_V3
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("x86-64-v3")) {
    PyErr_SetString(PyExc_ImportError,
                    "this ferrum build needs an x86-64-v3 CPU (AVX2, FMA, F16C, BMI2, MOVBE, LZCNT: "
                    "Intel Haswell, AMD Excavator / Zen or later), and this CPU is older; build "
                    "ferrum from source for it (docs/install.md)");
    return nullptr;
  }
#endif
  return PyModule_Create(&module_def);
}
