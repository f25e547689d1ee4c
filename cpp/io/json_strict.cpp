#include "io/json_strict.h"

#include <set>
#include <vector>

#include "core/error.h"

namespace ferrum {

nlohmann::json parse_json_strict(const char* begin, const char* end, const std::string& what) {
  using json = nlohmann::json;
  std::vector<std::set<std::string>> keys;  // one set per object being parsed
  std::string duplicate;
  auto on_event = [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      keys.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      keys.pop_back();
    } else if (event == json::parse_event_t::key && !keys.back().insert(parsed.get<std::string>()).second &&
               duplicate.empty()) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  json j;
  try {
    j = json::parse(begin, end, on_event);
  } catch (const json::exception& e) {
    throw FormatError(what + ": not valid JSON (" + e.what() + ")");
  }
  if (!duplicate.empty()) throw FormatError(what + ": key '" + duplicate + "' appears twice");
  return j;
}

}  // namespace ferrum
