// Input: a whole GGUF file.
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = ferrum::fuzz::scratch_path("model.gguf");
  ferrum::fuzz::write_file(path, data, size);
  ferrum::fuzz::open_and_check(path);
  return 0;
}
