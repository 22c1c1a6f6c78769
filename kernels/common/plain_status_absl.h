// Conversions between plain::Status (plain_status.h: the vocabulary of the code libarfuse_client
// links) and absl::Status, for the server and the tests, which link abseil. Codes keep their
// numbers and messages their text.
#pragma once

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/common/plain_status.h"

namespace arfuse {

inline absl::Status ToAbsl(const plain::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.code()), s.message());
}

template <typename T>
absl::StatusOr<T> ToAbsl(plain::StatusOr<T> s) {
  if (!s.ok()) return ToAbsl(s.status());
  return std::move(*s);
}

inline plain::Status FromAbsl(const absl::Status& s) {
  if (s.ok()) return plain::OkStatus();
  return plain::Status(static_cast<plain::StatusCode>(s.code()), std::string(s.message()));
}

}  // namespace arfuse
