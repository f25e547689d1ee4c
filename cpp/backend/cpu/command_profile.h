// Opt-in timing of the CPU stream's commands, for finding where a step's time goes:
// FERRUM_PROFILE=1 sums, per command name, the wall time (barrier included), the slowest
// thread's work and the fastest thread's work, and prints the table to stderr when the process
// exits. Wall minus slowest work is barrier cost; slowest minus fastest is imbalance (or a
// thread that lost its core). Off, it costs one branch per submit.
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
  void add(const char* name, int64_t wall_ns, int64_t max_work_ns, int64_t min_work_ns);
  ~CommandProfile();

 private:
  struct Entry {
    int64_t wall = 0, max_work = 0, min_work = 0;
    int64_t calls = 0;
  };
  std::mutex mu_;
  std::map<std::string, Entry> entries_;
};

}  // namespace ferrum
