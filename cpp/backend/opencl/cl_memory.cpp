#include "backend/opencl/cl_memory.h"

#include <algorithm>

#include "backend/opencl/cl_error.h"
#include "core/error.h"

namespace ferrum::ocl {

namespace {
constexpr size_t kMinBufferBytes = 64;  // zero-sized tensors still get a valid cl_mem
}

BufferPool::BufferPool(std::shared_ptr<DeviceContext> dc, size_t max_cached_bytes)
    : dc_(std::move(dc)), max_cached_(max_cached_bytes) {}

BufferPool::~BufferPool() {
  for (auto& [size, m] : free_) clReleaseMemObject(m);
}

cl_mem BufferPool::acquire(size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.find(bytes);
    if (it != free_.end()) {
      cl_mem m = it->second;
      free_.erase(it);
      cached_ -= bytes;
      return m;
    }
  }
  cl_int st = CL_SUCCESS;
  cl_mem m = clCreateBuffer(dc_->context(), CL_MEM_READ_WRITE, bytes, nullptr, &st);
  if (st != CL_SUCCESS) {
    std::lock_guard<std::mutex> lock(mu_);  // give cached buffers back to the device and retry once
    for (auto& [size, b] : free_) clReleaseMemObject(b);
    free_.clear();
    created_ -= cached_;
    cached_ = 0;
    m = clCreateBuffer(dc_->context(), CL_MEM_READ_WRITE, bytes, nullptr, &st);
  }
  if (st != CL_SUCCESS)
    throw_cl_error(st, ("clCreateBuffer(" + std::to_string(bytes) + " bytes)").c_str());
  std::lock_guard<std::mutex> lock(mu_);
  created_ += bytes;
  return m;
}

size_t BufferPool::bytes_in_use() {
  std::lock_guard<std::mutex> lock(mu_);
  return created_ - cached_;
}

void BufferPool::release(cl_mem m, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (bytes > max_cached_) {
    clReleaseMemObject(m);
    created_ -= bytes;
    return;
  }
  while (cached_ + bytes > max_cached_ && !free_.empty()) {  // evict the largest cached buffers
    auto last = std::prev(free_.end());
    cached_ -= last->first;
    created_ -= last->first;
    clReleaseMemObject(last->second);
    free_.erase(last);
  }
  free_.emplace(bytes, m);
  cached_ += bytes;
}

ClStorage::ClStorage(Backend* b, size_t bytes, std::vector<BufferChunk> c, std::shared_ptr<BufferPool> p)
    : Storage(b, bytes), chunks(std::move(c)), pool(std::move(p)) {}

ClStorage::~ClStorage() {
  for (const BufferChunk& c : chunks) pool->release(c.mem, c.alloc_bytes);
}

std::shared_ptr<ClStorage> allocate_storage(Backend* owner, const std::shared_ptr<BufferPool>& pool,
                                            const DeviceInfo& info, size_t bytes, size_t row_bytes) {
  const size_t in_use = pool->bytes_in_use();
  if (bytes > info.global_mem_bytes || in_use > info.global_mem_bytes - bytes)
    throw ResourceError("OpenCL device '" + info.device_name + "' has " + std::to_string(info.global_mem_bytes) +
                        " bytes of memory, " + std::to_string(in_use) + " in use; cannot allocate " +
                        std::to_string(bytes));
  size_t per_chunk = bytes;
  if (bytes > info.max_alloc_bytes) {
    if (row_bytes == 0 || row_bytes > info.max_alloc_bytes)
      throw ResourceError("a row of " + std::to_string(row_bytes) + " bytes exceeds the OpenCL device's maximum allocation of " +
                          std::to_string(info.max_alloc_bytes) + " bytes");
    per_chunk = info.max_alloc_bytes / row_bytes * row_bytes;
  }
  std::vector<BufferChunk> chunks;
  try {
    size_t begin = 0;
    do {
      size_t n = std::min(per_chunk, bytes - begin);
      size_t alloc = std::max(n, kMinBufferBytes);
      chunks.push_back({pool->acquire(alloc), begin, n, alloc});
      begin += n;
    } while (begin < bytes);
  } catch (...) {
    for (const BufferChunk& c : chunks) pool->release(c.mem, c.alloc_bytes);
    throw;
  }
  return std::make_shared<ClStorage>(owner, bytes, std::move(chunks), pool);
}

const ClStorage& cl_storage(const Tensor& t, const char* op) {
  const auto* s = dynamic_cast<const ClStorage*>(t.storage.get());
  if (!s) throw ValueError(std::string(op) + ": tensor " + (t.defined() ? t.str() : "(undefined)") +
                           " is not an OpenCL tensor");
  return *s;
}

BufferView single_buffer(const Tensor& t, const char* op) {
  const ClStorage& s = cl_storage(t, op);
  const size_t begin = t.offset, end = t.offset + t.nbytes();
  for (const BufferChunk& c : s.chunks)
    if (begin >= c.begin && (end <= c.begin + c.bytes || (c.bytes == 0 && end == begin)))
      return {c.mem, begin - c.begin};
  throw ValueError(std::string(op) + ": tensor " + t.str() +
                   " spans several device buffers (it is larger than the device's maximum allocation); "
                   "only linear and embedding weights may be split");
}

std::vector<RowSegment> row_segments(const Tensor& t, const char* op) {
  const ClStorage& s = cl_storage(t, op);
  const size_t row_bytes = t.row_bytes(), begin = t.offset, end = t.offset + t.nbytes();
  std::vector<RowSegment> out;
  for (const BufferChunk& c : s.chunks) {
    const size_t lo = std::max(begin, c.begin), hi = std::min(end, c.begin + c.bytes);
    if (lo >= hi) continue;
    if ((lo - begin) % row_bytes != 0 || (hi - lo) % row_bytes != 0)
      throw ValueError(std::string(op) + ": tensor " + t.str() + " is split inside a row");
    out.push_back({c.mem, lo - c.begin, int64_t((lo - begin) / row_bytes), int64_t((hi - lo) / row_bytes)});
  }
  if (out.empty()) out.push_back({s.chunks.front().mem, begin - s.chunks.front().begin, 0, 0});
  return out;
}

}  // namespace ferrum::ocl
