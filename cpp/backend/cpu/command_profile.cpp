#include "backend/cpu/command_profile.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace ferrum {

CommandProfile* CommandProfile::enabled() {
  static CommandProfile* profile = [] {
    const char* v = std::getenv("FERRUM_PROFILE");
    return v && *v && std::string(v) != "0" ? new CommandProfile : nullptr;
  }();
  return profile;
}

int64_t CommandProfile::now() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void CommandProfile::add(const char* name, int64_t wall_ns, int64_t max_work_ns, int64_t min_work_ns) {
  static const bool registered = [] {
    std::atexit([] { delete enabled(); });
    return true;
  }();
  (void)registered;
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = entries_[name];
  e.wall += wall_ns;
  e.max_work += max_work_ns;
  e.min_work += min_work_ns;
  e.calls += 1;
}

CommandProfile::~CommandProfile() {
  std::vector<std::pair<std::string, Entry>> rows(entries_.begin(), entries_.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.wall > b.second.wall; });
  int64_t total = 0;
  for (const auto& r : rows) total += r.second.wall;
  std::fprintf(stderr, "ferrum CPU command profile (FERRUM_PROFILE): %.1f ms in all\n", total / 1e6);
  std::fprintf(stderr, "%-20s %10s %8s %10s %12s %12s %6s\n", "command", "ms", "calls", "us/call",
               "slowest us", "fastest us", "%");
  for (const auto& [name, e] : rows) {
    const double calls = double(e.calls);
    std::fprintf(stderr, "%-20s %10.2f %8lld %10.2f %12.2f %12.2f %6.1f\n", name.c_str(), e.wall / 1e6,
                 static_cast<long long>(e.calls), e.wall / 1e3 / calls, e.max_work / 1e3 / calls,
                 e.min_work / 1e3 / calls, 100.0 * e.wall / double(total));
  }
}

}  // namespace ferrum
