// Copies to and from client memory that may vanish under the copy. A client can shrink the POSIX
// shared-memory object behind a region registered by name (ftruncate) at any moment, even between
// the registry's size check and the access; touching a page past the new end raises SIGBUS, which
// would kill the daemon and every session of its rank. Every CPU access of the host engine to
// client memory goes through GuardedCopy: a fault there becomes an error for that op only.
//
// How: a process-wide SIGBUS handler, installed once, jumps back (siglongjmp) into the copy that
// faulted when the faulting thread is inside one (a thread-local marker); a SIGBUS anywhere else
// goes to the handler that was there before (the default: the process dies, as it should on a
// bug). Only plain memcpy runs inside the guard: nothing with a destructor is skipped by the jump.
#pragma once

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace arfuse {

// memcpy(dst, src, n), or FAILED_PRECONDITION "<what>: ..." when the memory faulted (then dst
// holds part of the bytes).
absl::Status GuardedCopy(void* dst, const void* src, size_t n, absl::string_view what);

}  // namespace arfuse
