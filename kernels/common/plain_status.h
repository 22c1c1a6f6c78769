// A header-only status vocabulary for code that must not link abseil: libarfuse_client (the
// in-stream plane's client library, client/instream) and what it runs (kernels/host's collective
// and CPU op). That library is loaded into framework processes (torch, SGLang, vLLM) on machines
// that have no abseil, so it may need nothing beyond glibc, libstdc++ and libgcc_s; Debian's
// static abseil archives cannot be linked into a shared object (their TLS is local-exec), so the
// library carries this small subset of absl::Status instead.
//
// The names and meanings follow abseil's (absl::Status, absl::StatusOr, absl::StrCat): codes have
// abseil's numbers (and so the C ABI's ARFUSE_* values and gRPC's), messages the same text, and
// plain_status_absl.h converts both ways where abseil is linked (the server, the tests).
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace arfuse::plain {

// absl::StatusCode's values.
enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
  kUnauthenticated = 16,
};

// "INVALID_ARGUMENT", as absl::StatusCodeToString names it.
inline const char* StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kCancelled:
      return "CANCELLED";
    case StatusCode::kUnknown:
      return "UNKNOWN";
    case StatusCode::kInvalidArgument:
      return "INVALID_ARGUMENT";
    case StatusCode::kDeadlineExceeded:
      return "DEADLINE_EXCEEDED";
    case StatusCode::kNotFound:
      return "NOT_FOUND";
    case StatusCode::kAlreadyExists:
      return "ALREADY_EXISTS";
    case StatusCode::kPermissionDenied:
      return "PERMISSION_DENIED";
    case StatusCode::kResourceExhausted:
      return "RESOURCE_EXHAUSTED";
    case StatusCode::kFailedPrecondition:
      return "FAILED_PRECONDITION";
    case StatusCode::kAborted:
      return "ABORTED";
    case StatusCode::kOutOfRange:
      return "OUT_OF_RANGE";
    case StatusCode::kUnimplemented:
      return "UNIMPLEMENTED";
    case StatusCode::kInternal:
      return "INTERNAL";
    case StatusCode::kUnavailable:
      return "UNAVAILABLE";
    case StatusCode::kDataLoss:
      return "DATA_LOSS";
    case StatusCode::kUnauthenticated:
      return "UNAUTHENTICATED";
  }
  return "UNKNOWN";
}

// A code and a message; the message of an OK status is always empty (as abseil's).
class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string_view message)
      : code_(code), message_(code == StatusCode::kOk ? std::string_view() : message) {}

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  // A std::string (not a view) so that callers with abseil's own string_view (Debian's build)
  // pass it on without conversion.
  const std::string& message() const { return message_; }
  // "OK", or "INVALID_ARGUMENT: <message>".
  std::string ToString() const {
    if (ok()) return "OK";
    std::string s = StatusCodeName(code_);
    s += ": ";
    s += message_;
    return s;
  }

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }
  friend bool operator!=(const Status& a, const Status& b) { return !(a == b); }
  friend std::ostream& operator<<(std::ostream& os, const Status& s) { return os << s.ToString(); }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status OkStatus() { return Status(); }
inline Status AbortedError(std::string_view m) { return Status(StatusCode::kAborted, m); }
inline Status DeadlineExceededError(std::string_view m) {
  return Status(StatusCode::kDeadlineExceeded, m);
}
inline Status FailedPreconditionError(std::string_view m) {
  return Status(StatusCode::kFailedPrecondition, m);
}
inline Status InternalError(std::string_view m) { return Status(StatusCode::kInternal, m); }
inline Status InvalidArgumentError(std::string_view m) {
  return Status(StatusCode::kInvalidArgument, m);
}
inline Status OutOfRangeError(std::string_view m) { return Status(StatusCode::kOutOfRange, m); }
inline Status ResourceExhaustedError(std::string_view m) {
  return Status(StatusCode::kResourceExhausted, m);
}
inline Status UnavailableError(std::string_view m) { return Status(StatusCode::kUnavailable, m); }
inline Status UnimplementedError(std::string_view m) {
  return Status(StatusCode::kUnimplemented, m);
}

// A value or the non-OK status saying why there is none. Constructed from an OK status it holds
// INTERNAL (as abseil's does), so ok() always means a value is there.
template <typename T>
class StatusOr {
 public:
  StatusOr(const Status& status) : status_(status) {  // NOLINT: implicit, as absl::StatusOr
    if (status_.ok()) status_ = InternalError("OK status given to StatusOr without a value");
  }
  StatusOr(Status&& status) : status_(std::move(status)) {  // NOLINT
    if (status_.ok()) status_ = InternalError("OK status given to StatusOr without a value");
  }
  template <typename U = T, typename = std::enable_if_t<std::is_constructible_v<T, U&&> &&
                                                        !std::is_same_v<std::decay_t<U>, Status> &&
                                                        !std::is_same_v<std::decay_t<U>, StatusOr>>>
  StatusOr(U&& value) : value_(std::forward<U>(value)) {}  // NOLINT

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  // The value; only when ok().
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }
  T&& operator*() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }

 private:
  Status status_;  // OK when value_ holds a value
  std::optional<T> value_;
};

namespace internal {

inline void Append(std::string* out, std::string_view s) { out->append(s.data(), s.size()); }
inline void Append(std::string* out, const char* s) { out->append(s == nullptr ? "" : s); }
inline void Append(std::string* out, const std::string& s) { out->append(s); }
inline void Append(std::string* out, char c) = delete;  // as abseil: a char is not a number
inline void Append(std::string* out, bool b) { out->append(b ? "true" : "false"); }

template <typename T>
std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>>
Append(std::string* out, T v) {
  // uint8_t and int8_t are numbers here, as in absl::StrCat.
  if constexpr (std::is_signed_v<T>) {
    out->append(std::to_string(static_cast<long long>(v)));
  } else {
    out->append(std::to_string(static_cast<unsigned long long>(v)));
  }
}

template <typename T>
std::enable_if_t<std::is_floating_point_v<T>> Append(std::string* out, T v) {
  // Six significant digits, as absl::StrCat formats a float or double.
  char buf[32];
  const int n = std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
  if (n > 0) out->append(buf, static_cast<size_t>(n) < sizeof(buf) ? n : sizeof(buf) - 1);
}

}  // namespace internal

// The arguments' text, concatenated: strings as they are, integers in decimal, floating point
// with six significant digits (absl::StrCat's rules).
template <typename... Args>
std::string StrCat(const Args&... args) {
  std::string out;
  (internal::Append(&out, args), ...);
  return out;
}

template <typename... Args>
void StrAppend(std::string* out, const Args&... args) {
  (internal::Append(out, args), ...);
}

// The elements of `range` (each something StrCat takes) with `sep` between them.
template <typename Range>
std::string StrJoin(const Range& range, std::string_view sep) {
  std::string out;
  bool first = true;
  for (const auto& e : range) {
    if (!first) internal::Append(&out, sep);
    first = false;
    internal::Append(&out, e);
  }
  return out;
}

// `v` as two lowercase hex digits ("0a"): absl::Hex(v, absl::kZeroPad2).
inline std::string Hex2(uint8_t v) {
  static constexpr char kDigits[] = "0123456789abcdef";
  return std::string{kDigits[v >> 4], kDigits[v & 0xf]};
}

}  // namespace arfuse::plain
