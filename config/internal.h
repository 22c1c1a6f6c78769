// Text helpers the config rules' files share; not part of the library's interface.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace arfuse::config::internal {

// A value echoed back in a message: bounded, and kept on one line.
inline std::string Quoted(const std::string& text) {
  return absl::StrCat("\"", absl::CHexEscape(text.substr(0, 64)), text.size() > 64 ? "..." : "",
                      "\"");
}

inline bool Contains(const std::vector<std::string>& list, const std::string& item) {
  return std::find(list.begin(), list.end(), item) != list.end();
}

}  // namespace arfuse::config::internal
