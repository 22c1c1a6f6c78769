// Status propagation helpers. abseil 20220623 (Debian 12) predates ABSL_RETURN_IF_ERROR, so arfuse
// defines its own, prefixed, with the same meaning.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define ARFUSE_STATUS_CONCAT_INNER(a, b) a##b
#define ARFUSE_STATUS_CONCAT(a, b) ARFUSE_STATUS_CONCAT_INNER(a, b)

// Returns the status of `expr` from the enclosing function when it is not OK.
#define ARFUSE_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::absl::Status arfuse_status_ = (expr);          \
    if (!arfuse_status_.ok()) return arfuse_status_; \
  } while (false)

// `lhs = value of expr` when OK; otherwise returns its status from the enclosing function.
#define ARFUSE_ASSIGN_OR_RETURN(lhs, expr) \
  ARFUSE_ASSIGN_OR_RETURN_IMPL(ARFUSE_STATUS_CONCAT(arfuse_statusor_, __LINE__), lhs, expr)
#define ARFUSE_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return std::move(tmp).status();     \
  lhs = std::move(tmp).value()
