// Input: a model directory packed as [u32 length of config.json][config.json][model.safetensors].
#include <cstring>

#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ferrum::fuzz;
  uint32_t config_len;
  if (size < 4) return -1;
  std::memcpy(&config_len, data, 4);
  if (config_len > size - 4) return -1;
  static const std::string dir = scratch_dir("hf");
  write_file(dir + "/config.json", data + 4, config_len);
  write_file(dir + "/model.safetensors", data + 4 + config_len, size - 4 - config_len);
  open_and_check(dir);
  return 0;
}
