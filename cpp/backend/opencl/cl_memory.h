// Device memory: a Storage is one or more cl_mem buffers (more than one only when the tensor is
// larger than the device's max allocation; it is then split at row boundaries), and a pool that
// keeps released buffers for reuse by the next allocation of the same size (step buffers are
// re-created whenever the runner records a new step shape).
#pragma once
#include <CL/cl.h>

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "backend/opencl/cl_device.h"
#include "core/tensor.h"

namespace ferrum::ocl {

class BufferPool {
 public:
  BufferPool(std::shared_ptr<DeviceContext> dc, size_t max_cached_bytes);
  ~BufferPool();
  cl_mem acquire(size_t bytes);
  void release(cl_mem m, size_t bytes);
  size_t bytes_in_use();  // held by live tensors (cached buffers not counted)

 private:
  std::shared_ptr<DeviceContext> dc_;
  size_t max_cached_, cached_ = 0, created_ = 0;  // created_: every buffer not yet released
  std::mutex mu_;
  std::multimap<size_t, cl_mem> free_;
};

// Bytes [begin, begin + bytes) of a storage live in `mem` from its offset 0.
struct BufferChunk {
  cl_mem mem;
  size_t begin, bytes, alloc_bytes;
};

struct ClStorage : Storage {
  ClStorage(Backend* b, size_t bytes, std::vector<BufferChunk> chunks, std::shared_ptr<BufferPool> pool);
  ~ClStorage() override;
  std::vector<BufferChunk> chunks;
  std::shared_ptr<BufferPool> pool;
  // Weight rows in the gpu family's flat layout (cl_weight_layout.h), set by pack_weight.
  bool flat_rows = false;
};
const ClStorage& cl_storage(const Tensor& t, const char* op);  // ValueError if not an OpenCL tensor

// Allocates `bytes` for a tensor whose rows are row_bytes long, split into buffers of at most
// max_alloc bytes (whole rows each). Throws ResourceError when it cannot fit, or when it would
// take the buffers in use past the device's global memory (drivers that back buffers only at
// first use would fail later, in the middle of a step).
std::shared_ptr<ClStorage> allocate_storage(Backend* owner, const std::shared_ptr<BufferPool>& pool,
                                            const DeviceInfo& info, size_t bytes, size_t row_bytes);

// A tensor that lies inside one buffer: the buffer and its offset there in bytes.
struct BufferView {
  cl_mem mem;
  size_t byte_offset;
};
BufferView single_buffer(const Tensor& t, const char* op);

// The rows of a (possibly split) tensor, one piece per buffer it spans.
struct RowSegment {
  cl_mem mem;
  size_t byte_offset;
  int64_t first_row, rows;
};
std::vector<RowSegment> row_segments(const Tensor& t, const char* op);

}  // namespace ferrum::ocl
