#include "fuzz_common.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "core/error.h"
#include "model/model_file.h"

namespace ferrum::fuzz {

namespace {
std::string& root() {
  static std::string dir;
  return dir;
}
void remove_scratch() { std::system(("rm -rf '" + root() + "'").c_str()); }
}  // namespace

std::string scratch_path(const std::string& name) {
  if (root().empty()) {
    struct stat st;
    const std::string base = stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) ? "/dev/shm" : "/tmp";
    root() = base + "/ferrum-fuzz-" + std::to_string(getpid());
    mkdir(root().c_str(), 0700);
    std::atexit(remove_scratch);
  }
  return root() + "/" + name;
}

std::string scratch_dir(const std::string& name) {
  std::string d = scratch_path(name);
  mkdir(d.c_str(), 0700);
  return d;
}

void write_file(const std::string& path, const uint8_t* data, size_t size) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
}

void open_and_check(const std::string& path) {
  ModelFile m;
  try {
    m = open_model_file(path);
  } catch (const ValueError&) {  // FormatError too: the clean refusal
    return;
  }
  volatile uint8_t sink = 0;
  for (const auto& [name, t] : m.weights.tensors)
    for (size_t i = 0; i < t.nbytes; i += 4096) sink = sink ^ uint8_t(t.data[i]) ^ uint8_t(t.data[t.nbytes - 1]);
  (void)sink;
}

}  // namespace ferrum::fuzz
