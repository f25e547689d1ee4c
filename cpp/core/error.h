// Exceptions that the bindings map to Python: ValueError (bad input), FormatError (a file that
// does not parse; also ValueError in Python), ResourceError (KV pool / memory exhausted ->
// MemoryError), and std::runtime_error for everything else.
#pragma once
#include <stdexcept>
#include <string>

namespace ferrum {

struct ValueError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
struct FormatError : ValueError {
  using ValueError::ValueError;
};
struct ResourceError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

#define FERRUM_CHECK(cond, msg)                                   \
  do {                                                            \
    if (!(cond)) throw ::ferrum::ValueError(std::string() + msg); \
  } while (0)

}  // namespace ferrum
