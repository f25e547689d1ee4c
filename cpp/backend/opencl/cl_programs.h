// Programs built from the embedded kernels/*.cl sources. A program is a list of source files
// (concatenated in order) plus build options (e.g. -DW_Q4_K); each distinct pair is built once per
// backend, and its binary is kept on disk under $FERRUM_HOME/opencl (default ~/.cache/ferrum/
// opencl) keyed by device, driver and a hash of sources and options, because pocl's LLVM
// compile takes seconds per program.
#pragma once
#include <CL/cl.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "backend/opencl/cl_device.h"

namespace ferrum::ocl {

// Every (sources, options) pair any backend of this process has asked for, in order of first
// request: what offline compilers (clang to PTX, tests/test_opencl_ptx.py) must build too.
struct ProgramRequest {
  std::vector<std::string> sources;
  std::string options;
};
std::vector<ProgramRequest> programs_requested();

class ProgramCache {
 public:
  explicit ProgramCache(const DeviceContext& dc);
  ~ProgramCache();
  ProgramCache(const ProgramCache&) = delete;
  ProgramCache& operator=(const ProgramCache&) = delete;

  // sources: names of kernels/*.cl without the extension.
  cl_program get(const std::vector<std::string>& sources, const std::string& options);
  // A new kernel object (each recorded launch owns one, with its arguments set).
  cl_kernel kernel(cl_program program, const char* name);

  int built_from_source() const { return built_from_source_; }
  int loaded_from_disk() const { return loaded_from_disk_; }

 private:
  cl_program build(const std::string& source, const std::string& options, const std::string& key);
  cl_program try_cached_binary(const std::string& path, const std::string& options);
  void store_binary(cl_program program, const std::string& path);

  const DeviceContext& dc_;
  std::string cache_dir_;  // empty: no disk cache (no writable home)
  std::mutex mu_;
  std::map<std::string, cl_program> programs_;
  int built_from_source_ = 0, loaded_from_disk_ = 0;
};

}  // namespace ferrum::ocl
