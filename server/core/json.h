// JSON text for the hand-written JSON of logs and the CLI: one quoting rule, safe for any input.
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace arfuse {

// `text` as a JSON string literal, quotes included. Quotes, backslashes and control characters
// are escaped; bytes that are not valid UTF-8 become U+FFFD, so the result is always valid JSON
// (a client-supplied name or an OS error text cannot break a log line or a CLI reply).
std::string JsonQuote(absl::string_view text);

}  // namespace arfuse
