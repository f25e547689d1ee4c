// A read-only memory map of a whole file. Tensors point into it; whoever holds a tensor
// wrapping these bytes holds a shared_ptr to the map, so weights are never copied to RAM.
#pragma once
#include <cstddef>
#include <memory>
#include <string>

namespace ferrum {

class MappedFile {
 public:
  static std::shared_ptr<MappedFile> open(const std::string& path);  // FormatError if unreadable
  // Zeroed anonymous memory standing in for a file: the home of tensors made at load (a quantized
  // checkpoint's modules translated to a block type), released page by page as a file's are.
  static std::shared_ptr<MappedFile> anonymous(const std::string& name, size_t bytes);
  char* writable() { return const_cast<char*>(data_); }
  ~MappedFile();
  const char* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // Tells the kernel these pages won't be read again (after their bytes were copied elsewhere).
  void release_pages(const void* begin, size_t bytes) const;

 private:
  MappedFile() = default;
  std::string path_;
  const char* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace ferrum
