// UTF-8 validity, as the GGUF and JSON formats require of their strings.
#pragma once

#include <cstddef>
#include <string_view>

namespace ferrum {

// The offset of the first byte that does not begin or continue a well-formed UTF-8 character
// (overlong forms, surrogates and code points above U+10FFFF are ill-formed), or npos.
size_t invalid_utf8_at(std::string_view s);

}  // namespace ferrum
