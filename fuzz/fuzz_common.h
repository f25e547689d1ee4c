// What every file-format target does with an input: write it where the reader expects a file,
// open it as a model, and accept exactly two outcomes: a clean FormatError / ValueError, or a
// model whose every tensor lies inside its mapped file (each byte of it is read, so ASan sees
// any that does not). Any other exception escapes and libFuzzer reports it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace ferrum::fuzz {

// A file (or a directory) in this process's scratch directory (tmpfs where there is one),
// rewritten per input and removed at exit.
std::string scratch_path(const std::string& name);
std::string scratch_dir(const std::string& name);
void write_file(const std::string& path, const uint8_t* data, size_t size);
// Opens `path` with open_model_file under the rule above.
void open_and_check(const std::string& path);

}  // namespace ferrum::fuzz
