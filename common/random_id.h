// Identifiers that are capabilities or that name another caller's object: drawn from the kernel's
// random pool (getrandom), never derived from a counter or a clock, so that no id a caller holds
// says anything about the ids of others.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace arfuse {

// Fills `out` with `n` random bytes from the kernel (getrandom). Aborts if the kernel cannot give
// them: that happens only before its pool is initialized, which a running daemon is long past, and
// a guessable id must never stand in.
void FillRandomBytes(void* out, size_t n);

// 64 random bits, never 0 (0 means "none" on the wire).
uint64_t RandomNonZeroId();

// Bytes of a session token: 128 random bits.
inline constexpr size_t kSessionTokenBytes = 16;
// Characters of its text form: lowercase hex.
inline constexpr size_t kSessionTokenChars = 2 * kSessionTokenBytes;

// kSessionTokenBytes random bytes as kSessionTokenChars lowercase hex characters.
std::string NewSessionToken();

// kSessionTokenChars lowercase hex characters.
bool IsWellFormedSessionToken(absl::string_view token);

}  // namespace arfuse
