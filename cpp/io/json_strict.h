// JSON as the weight formats read it: a key that appears twice in one object is an error (a
// plain parse would keep one of the two values silently).
#pragma once
#include <nlohmann/json.hpp>
#include <string>

namespace ferrum {

// FormatError "<what>: not valid JSON (...)" or "<what>: key 'k' appears twice".
nlohmann::json parse_json_strict(const char* begin, const char* end, const std::string& what);

}  // namespace ferrum
