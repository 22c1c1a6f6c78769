// The JSON text rules every JSON writer of arfuse uses (logs, arfusectl, arfuse-demo, the benches):
// one quoting rule, safe for any input, and one number rule, valid for any double. Writers that
// hold a protobuf message print it with google::protobuf::util::MessageToJsonString instead.
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace arfuse {

// `text` as a JSON string literal, quotes included. Quotes, backslashes and control characters
// are escaped; bytes that are not valid UTF-8 become U+FFFD, so the result is always valid JSON
// (a client-supplied name or an OS error text cannot break a log line or a CLI reply).
std::string JsonQuote(absl::string_view text);

// `value` as a JSON number, printed as printf's "%.<precision>f" ('f') or "%.<precision>g" ('g')
// would. JSON has no NaN or infinity (printf's "nan" and "inf" make a reader refuse the whole
// document), so those become null: a figure that could not be measured or a result that is not a
// number reads as missing, never as a number.
std::string JsonNumber(double value, int precision, char style = 'f');

// "true" or "false".
inline const char* JsonBool(bool value) { return value ? "true" : "false"; }

}  // namespace arfuse
