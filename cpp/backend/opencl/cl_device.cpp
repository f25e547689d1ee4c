#include "backend/opencl/cl_device.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "backend/opencl/cl_error.h"
#include "core/error.h"

namespace ferrum::ocl {

namespace {

std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool is_index(const std::string& s) {
  return !s.empty() && s.size() < 6 && std::all_of(s.begin(), s.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
}

std::string platform_str(cl_platform_id p, cl_platform_info what) {
  size_t n = 0;
  if (clGetPlatformInfo(p, what, 0, nullptr, &n) != CL_SUCCESS || n == 0) return "";
  std::string s(n, '\0');
  clGetPlatformInfo(p, what, n, s.data(), nullptr);
  return s.c_str();  // drop the terminating NUL
}

std::string device_str(cl_device_id d, cl_device_info what) {
  size_t n = 0;
  if (clGetDeviceInfo(d, what, 0, nullptr, &n) != CL_SUCCESS || n == 0) return "";
  std::string s(n, '\0');
  clGetDeviceInfo(d, what, n, s.data(), nullptr);
  return s.c_str();
}

template <typename T>
T device_value(cl_device_id d, cl_device_info what) {
  T v{};
  cl_check(clGetDeviceInfo(d, what, sizeof(T), &v, nullptr), "clGetDeviceInfo");
  return v;
}

std::vector<cl_platform_id> platforms() {
  cl_uint n = 0;
  cl_int st = clGetPlatformIDs(0, nullptr, &n);
  if (st == -1001 /* CL_PLATFORM_NOT_FOUND_KHR */ || (st == CL_SUCCESS && n == 0))
    throw ValueError("no OpenCL platform is installed (the ICD loader found none)");
  cl_check(st, "clGetPlatformIDs");
  std::vector<cl_platform_id> ids(n);
  cl_check(clGetPlatformIDs(n, ids.data(), nullptr), "clGetPlatformIDs");
  return ids;
}

std::vector<cl_device_id> devices(cl_platform_id p) {
  cl_uint n = 0;
  cl_int st = clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, 0, nullptr, &n);
  if (st == CL_DEVICE_NOT_FOUND || n == 0) return {};
  cl_check(st, "clGetDeviceIDs");
  std::vector<cl_device_id> ids(n);
  cl_check(clGetDeviceIDs(p, CL_DEVICE_TYPE_ALL, n, ids.data(), nullptr), "clGetDeviceIDs");
  return ids;
}

// Index or name substring `want` among `names`; -1 when nothing matches.
int pick(const std::vector<std::string>& names, const std::string& want) {
  if (is_index(want)) {
    size_t i = std::stoul(want);
    return i < names.size() ? int(i) : -1;
  }
  for (size_t i = 0; i < names.size(); ++i)
    if (lower(names[i]).find(lower(want)) != std::string::npos) return int(i);
  return -1;
}

std::string listing(const std::vector<std::string>& names) {
  std::string s;
  for (size_t i = 0; i < names.size(); ++i) s += (i ? ", " : "") + std::to_string(i) + ": '" + names[i] + "'";
  return s.empty() ? "none" : s;
}

// FERRUM_OPENCL_MAX_ALLOC_BYTES lowers the per-buffer limit, so tests can exercise tensors split
// over several buffers on a device whose real limit is gigabytes.
size_t max_alloc_override() {
  const char* v = std::getenv("FERRUM_OPENCL_MAX_ALLOC_BYTES");
  if (!v || !*v) return 0;
  char* end = nullptr;
  unsigned long long n = std::strtoull(v, &end, 10);
  if (*end != '\0' || n < 1024) throw ValueError("FERRUM_OPENCL_MAX_ALLOC_BYTES must be an integer >= 1024, got '" + std::string(v) + "'");
  return size_t(n);
}

// cl_khr_command_buffer is provisional: its entry points kept their signatures through the 0.9
// versions (the ones drivers ship), so only those are used. The version query is OpenCL 3.0's
// (the backend builds against 1.2 headers: the constants are spelled out).
bool command_buffer_version_supported(cl_device_id d) {
  constexpr cl_device_info kExtensionsWithVersion = 0x1060;  // CL_DEVICE_EXTENSIONS_WITH_VERSION
  struct NameVersion {
    cl_uint version;  // major << 22 | minor << 12 | patch
    char name[64];
  };
  size_t n = 0;
  if (clGetDeviceInfo(d, kExtensionsWithVersion, 0, nullptr, &n) != CL_SUCCESS || n == 0) return false;
  std::vector<NameVersion> exts(n / sizeof(NameVersion));
  if (clGetDeviceInfo(d, kExtensionsWithVersion, n, exts.data(), nullptr) != CL_SUCCESS) return false;
  for (const NameVersion& e : exts)
    if (std::string(e.name, strnlen(e.name, sizeof(e.name))) == "cl_khr_command_buffer")
      return (e.version >> 22) == 0 && ((e.version >> 12) & 0x3ff) == 9;
  return false;
}

}  // namespace

bool DeviceInfo::has_extension(const std::string& name) const {
  size_t at = extensions.find(name);
  while (at != std::string::npos) {
    const size_t end = at + name.size();
    if ((at == 0 || extensions[at - 1] == ' ') && (end == extensions.size() || extensions[end] == ' ')) return true;
    at = extensions.find(name, end);
  }
  return false;
}

DeviceContext::DeviceContext(const std::string& selector) {
  std::vector<std::string> parts;
  if (!selector.empty()) {
    size_t start = 1;  // after the leading ':'
    if (selector[0] != ':') throw ValueError("bad OpenCL device spec 'opencl" + selector + "'");
    for (;;) {
      size_t colon = selector.find(':', start);
      parts.push_back(selector.substr(start, colon == std::string::npos ? std::string::npos : colon - start));
      if (colon == std::string::npos) break;
      start = colon + 1;
    }
  }
  if (parts.size() > 2 || std::any_of(parts.begin(), parts.end(), [](const std::string& p) { return p.empty(); }))
    throw ValueError("bad OpenCL device spec 'opencl" + selector + "' (expected opencl[:platform[:device]], each an index or a name)");

  std::vector<cl_platform_id> plats = platforms();
  std::vector<std::string> plat_names;
  for (cl_platform_id p : plats) plat_names.push_back(platform_str(p, CL_PLATFORM_NAME));
  cl_platform_id platform = nullptr;
  if (parts.empty()) {
    for (cl_platform_id p : plats)
      if (!devices(p).empty()) {
        platform = p;
        break;
      }
    if (!platform) throw ValueError("no OpenCL device found on any platform (" + listing(plat_names) + ")");
  } else {
    int i = pick(plat_names, parts[0]);
    if (i < 0) throw ValueError("no OpenCL platform matches '" + parts[0] + "'; platforms: " + listing(plat_names));
    platform = plats[size_t(i)];
  }

  std::vector<cl_device_id> devs = devices(platform);
  std::vector<std::string> dev_names;
  for (cl_device_id d : devs) dev_names.push_back(device_str(d, CL_DEVICE_NAME));
  if (devs.empty()) throw ValueError("OpenCL platform '" + platform_str(platform, CL_PLATFORM_NAME) + "' has no devices");
  int di = parts.size() == 2 ? pick(dev_names, parts[1]) : 0;
  if (di < 0) throw ValueError("no OpenCL device matches '" + parts[1] + "'; devices: " + listing(dev_names));
  device_ = devs[size_t(di)];

  info_.platform_name = platform_str(platform, CL_PLATFORM_NAME);
  info_.device_name = dev_names[size_t(di)];
  info_.vendor = device_str(device_, CL_DEVICE_VENDOR);
  info_.driver_version = device_str(device_, CL_DRIVER_VERSION);
  info_.device_version = device_str(device_, CL_DEVICE_VERSION);
  info_.max_alloc_bytes = size_t(device_value<cl_ulong>(device_, CL_DEVICE_MAX_MEM_ALLOC_SIZE));
  info_.global_mem_bytes = size_t(device_value<cl_ulong>(device_, CL_DEVICE_GLOBAL_MEM_SIZE));
  info_.max_work_group = device_value<size_t>(device_, CL_DEVICE_MAX_WORK_GROUP_SIZE);
  info_.compute_units = device_value<cl_uint>(device_, CL_DEVICE_MAX_COMPUTE_UNITS);
  info_.local_mem_bytes = size_t(device_value<cl_ulong>(device_, CL_DEVICE_LOCAL_MEM_SIZE));
  info_.extensions = device_str(device_, CL_DEVICE_EXTENSIONS);
  info_.gpu = (device_value<cl_device_type>(device_, CL_DEVICE_TYPE) & CL_DEVICE_TYPE_GPU) != 0;
  info_.nvidia = lower(info_.vendor).find("nvidia") != std::string::npos;
  info_.command_buffer = command_buffer_version_supported(device_);
  if (size_t cap = max_alloc_override()) info_.max_alloc_bytes = std::min(info_.max_alloc_bytes, cap);

  cl_int st = CL_SUCCESS;
  context_ = clCreateContext(nullptr, 1, &device_, nullptr, nullptr, &st);
  cl_check(st, "clCreateContext");
  queue_ = clCreateCommandQueue(context_, device_, CL_QUEUE_PROFILING_ENABLE, &st);
  if (st != CL_SUCCESS) {
    clReleaseContext(context_);
    cl_check(st, "clCreateCommandQueue");
  }
  if (info_.command_buffer) command_buffers_ = load_command_buffer_api(platform, device_, CL_QUEUE_PROFILING_ENABLE);
  info_.command_buffer = command_buffers_ != nullptr;
}

DeviceContext::~DeviceContext() {
  if (queue_) {
    clFinish(queue_);
    clReleaseCommandQueue(queue_);
  }
  if (context_) clReleaseContext(context_);
}

}  // namespace ferrum::ocl
