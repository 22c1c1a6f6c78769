// The JSON text rules of every writer (common/json.h).
#include "common/json.h"

#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace arfuse {
namespace {

TEST(JsonQuote, EscapesWhatWouldBreakTheText) {
  EXPECT_EQ(JsonQuote("plain"), "\"plain\"");
  EXPECT_EQ(JsonQuote("a\"b\\c\nd\te"), "\"a\\\"b\\\\c\\nd\\te\"");
  EXPECT_EQ(JsonQuote(std::string("\x01", 1)), "\"\\u0001\"");
  EXPECT_EQ(JsonQuote("\xff"), "\"\\ufffd\"");  // not UTF-8
  EXPECT_EQ(JsonQuote("\xc3\xa9"), "\"\xc3\xa9\"");
}

TEST(JsonNumber, PrintsAsPrintfWould) {
  EXPECT_EQ(JsonNumber(4.2, 3), "4.200");
  EXPECT_EQ(JsonNumber(0.000123456, 3, 'g'), "0.000123");
  EXPECT_EQ(JsonNumber(-1.5, 0), "-2");
}

// printf writes "nan", "inf" and "-inf", which no JSON reader takes: a row whose figure could not
// be measured (NaN) or whose result overflowed made the whole document unreadable. They are null.
TEST(JsonNumber, NotANumberAndInfinityAreNull) {
  EXPECT_EQ(JsonNumber(std::nan(""), 3), "null");
  EXPECT_EQ(JsonNumber(-std::nan(""), 3, 'g'), "null");
  EXPECT_EQ(JsonNumber(std::numeric_limits<double>::infinity(), 2), "null");
  EXPECT_EQ(JsonNumber(-std::numeric_limits<double>::infinity(), 3, 'g'), "null");
  // A row as arfuse-demo --json writes it, with a NaN error: valid JSON, the error null.
  const std::string row = absl::StrCat("{\"us_per_op\":", JsonNumber(12.5, 2),
                                       ",\"max_error\":", JsonNumber(std::nan(""), 3, 'g'), "}");
  EXPECT_EQ(row, "{\"us_per_op\":12.50,\"max_error\":null}");
}

TEST(JsonBool, Literals) {
  EXPECT_STREQ(JsonBool(true), "true");
  EXPECT_STREQ(JsonBool(false), "false");
}

}  // namespace
}  // namespace arfuse
