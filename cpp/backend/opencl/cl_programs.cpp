#include "backend/opencl/cl_programs.h"

#include <sys/stat.h>
#include <cerrno>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "backend/opencl/cl_error.h"
#include "core/error.h"

namespace ferrum::ocl {

namespace {

struct EmbeddedSource {
  const char* name;
  const char* text;
};
const EmbeddedSource kSources[] = {
#include "cl_kernels.inc"
};

const char* source_text(const std::string& name) {
  for (const EmbeddedSource& s : kSources)
    if (name == s.name) return s.text;
  throw std::logic_error("no embedded kernel source kernels/" + name + ".cl");
}

uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

bool make_dirs(const std::string& path) {
  for (size_t i = 1; i <= path.size(); ++i)
    if (i == path.size() || path[i] == '/') {
      std::string p = path.substr(0, i);
      if (mkdir(p.c_str(), 0755) != 0 && errno != EEXIST) return false;
    }
  return true;
}

std::string default_cache_dir() {
  const char* home = std::getenv("FERRUM_HOME");
  std::string base;
  if (home && *home) base = home;
  else if (const char* h = std::getenv("HOME")) base = std::string(h) + "/.cache/ferrum";
  else return "";
  std::string dir = base + "/opencl";
  return make_dirs(dir) ? dir : "";
}

std::string build_log(cl_program p, cl_device_id d) {
  size_t n = 0;
  clGetProgramBuildInfo(p, d, CL_PROGRAM_BUILD_LOG, 0, nullptr, &n);
  std::string log(n, '\0');
  clGetProgramBuildInfo(p, d, CL_PROGRAM_BUILD_LOG, n, log.data(), nullptr);
  return log.c_str();
}

}  // namespace

namespace {
std::mutex requested_mu;
std::vector<ProgramRequest> requested;  // (first requests only; ProgramCache::get keeps them unique per key)
std::set<std::string> requested_keys;
}  // namespace

std::vector<ProgramRequest> programs_requested() {
  std::lock_guard<std::mutex> lock(requested_mu);
  return requested;
}

ProgramCache::ProgramCache(const DeviceContext& dc) : dc_(dc), cache_dir_(default_cache_dir()) {}

ProgramCache::~ProgramCache() {
  for (auto& [key, p] : programs_) clReleaseProgram(p);
}

cl_program ProgramCache::get(const std::vector<std::string>& sources, const std::string& options) {
  std::string names;
  for (const std::string& s : sources) names += s + ",";
  const std::string key = names + "|" + options;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = programs_.find(key);
  if (it != programs_.end()) return it->second;
  {
    std::lock_guard<std::mutex> requested_lock(requested_mu);
    if (requested_keys.insert(key).second) requested.push_back({sources, options});
  }
  std::string text;
  for (const std::string& s : sources) text += std::string(source_text(s)) + "\n";
  cl_program p = build(text, "-cl-std=CL1.2 " + options, key);
  programs_[key] = p;
  return p;
}

cl_program ProgramCache::build(const std::string& source, const std::string& options, const std::string& key) {
  const DeviceInfo& info = dc_.info();
  uint64_t h = fnv1a(info.device_name + "|" + info.driver_version + "|" + info.device_version + "|" +
                     options + "|" + source);
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  const std::string path = cache_dir_.empty() ? "" : cache_dir_ + "/" + hex + ".bin";
  if (!path.empty())
    if (cl_program p = try_cached_binary(path, options)) {
      ++loaded_from_disk_;
      return p;
    }

  const char* text = source.c_str();
  size_t len = source.size();
  cl_int st = CL_SUCCESS;
  cl_program p = clCreateProgramWithSource(dc_.context(), 1, &text, &len, &st);
  cl_check(st, "clCreateProgramWithSource");
  cl_device_id dev = dc_.device();
  st = clBuildProgram(p, 1, &dev, options.c_str(), nullptr, nullptr);
  if (st != CL_SUCCESS) {
    std::string log = build_log(p, dev);
    clReleaseProgram(p);
    throw std::runtime_error("OpenCL program '" + key + "' failed to build (" + cl_status_name(st) + "):\n" +
                             log.substr(0, 4000));
  }
  ++built_from_source_;
  if (!path.empty()) store_binary(p, path);
  return p;
}

cl_program ProgramCache::try_cached_binary(const std::string& path, const std::string& options) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return nullptr;
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string bin = ss.str();
  if (bin.empty()) return nullptr;
  const unsigned char* data = reinterpret_cast<const unsigned char*>(bin.data());
  size_t len = bin.size();
  cl_int bin_st = CL_SUCCESS, st = CL_SUCCESS;
  cl_device_id dev = dc_.device();
  cl_program p = clCreateProgramWithBinary(dc_.context(), 1, &dev, &len, &data, &bin_st, &st);
  if (st != CL_SUCCESS || bin_st != CL_SUCCESS) {
    if (p) clReleaseProgram(p);
    return nullptr;
  }
  if (clBuildProgram(p, 1, &dev, options.c_str(), nullptr, nullptr) != CL_SUCCESS) {
    clReleaseProgram(p);  // stale or foreign binary: rebuild from source
    return nullptr;
  }
  return p;
}

void ProgramCache::store_binary(cl_program p, const std::string& path) {
  size_t size = 0;
  if (clGetProgramInfo(p, CL_PROGRAM_BINARY_SIZES, sizeof(size), &size, nullptr) != CL_SUCCESS || size == 0) return;
  std::string bin(size, '\0');
  unsigned char* ptr = reinterpret_cast<unsigned char*>(bin.data());
  if (clGetProgramInfo(p, CL_PROGRAM_BINARIES, sizeof(ptr), &ptr, nullptr) != CL_SUCCESS) return;
  // Write then rename, so a concurrent reader never sees half a file.
  const std::string tmp = path + ".tmp" + std::to_string(getpid());
  {
    std::ofstream f(tmp, std::ios::binary);
    if (!f) return;
    f.write(bin.data(), std::streamsize(bin.size()));
    if (!f) return;
  }
  std::rename(tmp.c_str(), path.c_str());
}

cl_kernel ProgramCache::kernel(cl_program program, const char* name) {
  cl_int st = CL_SUCCESS;
  cl_kernel k = clCreateKernel(program, name, &st);
  cl_check(st, "clCreateKernel");
  return k;
}

}  // namespace ferrum::ocl
