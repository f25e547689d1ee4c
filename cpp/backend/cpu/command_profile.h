// Opt-in timing of the CPU stream's commands, for finding where a step's time goes:
// FERRUM_PROFILE=1 sums the wall time of every command by name (barrier wait included) and
// prints the table to stderr when the process exits. Off, it costs one branch per command.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace ferrum {

class CommandProfile {
 public:
  // The process-wide profile, or nullptr when FERRUM_PROFILE is unset.
  static CommandProfile* enabled();
  static int64_t now();  // nanoseconds, monotonic
  void add(const char* name, int64_t ns);
  ~CommandProfile();

 private:
  struct Entry {
    int64_t ns = 0;
    int64_t calls = 0;
  };
  std::mutex mu_;
  std::map<std::string, Entry> entries_;
};

}  // namespace ferrum
