#include "io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace ferrum {

std::shared_ptr<MappedFile> MappedFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw FormatError(path + ": cannot open (" + std::strerror(errno) + ")");
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw FormatError(path + ": not a regular file");
  }
  std::shared_ptr<MappedFile> f(new MappedFile());
  f->path_ = path;
  f->size_ = size_t(st.st_size);
  if (f->size_ > 0) {
    void* p = mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      throw FormatError(path + ": mmap failed (" + std::strerror(errno) + ")");
    }
    // 4 KiB mappings even where the page cache holds the file in 2 MiB pages (khugepaged
    // collapses a file another process maps, such as llama.cpp): mapped whole, they counted
    // pages this process never touches or has released (release_pages) in its RSS, up to 8%
    // over the file + KV + 15% bound on SmolLM2-shape Q4_K_M.
    madvise(p, f->size_, MADV_NOHUGEPAGE);
    f->data_ = static_cast<const char*>(p);
  }
  ::close(fd);
  return f;
}

std::shared_ptr<MappedFile> MappedFile::anonymous(const std::string& name, size_t bytes) {
  std::shared_ptr<MappedFile> f(new MappedFile());
  f->path_ = name;
  f->size_ = bytes;
  if (bytes > 0) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw ResourceError(name + ": cannot map " + std::to_string(bytes) + " bytes");
    f->data_ = static_cast<const char*>(p);
  }
  return f;
}

MappedFile::~MappedFile() {
  if (data_) munmap(const_cast<char*>(data_), size_);
}

void MappedFile::release_pages(const void* begin, size_t bytes) const {
  const long page = sysconf(_SC_PAGESIZE);
  uintptr_t b = reinterpret_cast<uintptr_t>(begin), e = b + bytes;
  b = (b + page - 1) / page * page;  // only whole pages inside the range
  e = e / page * page;
  if (e > b) madvise(reinterpret_cast<void*>(b), e - b, MADV_DONTNEED);
}

}  // namespace ferrum
