#include "common/random_id.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdlib>

namespace arfuse {

void FillRandomBytes(void* out, size_t n) {
  auto* p = static_cast<uint8_t*>(out);
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::getrandom(p + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      std::abort();
    }
    got += static_cast<size_t>(r);
  }
}

uint64_t RandomNonZeroId() {
  for (;;) {
    uint64_t v = 0;
    FillRandomBytes(&v, sizeof(v));
    if (v != 0) return v;
  }
}

std::string NewSessionToken() {
  uint8_t raw[kSessionTokenBytes];
  FillRandomBytes(raw, sizeof(raw));
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out(kSessionTokenChars, '0');
  for (size_t i = 0; i < sizeof(raw); ++i) {
    out[2 * i] = kHex[raw[i] >> 4];
    out[2 * i + 1] = kHex[raw[i] & 0xf];
  }
  return out;
}

bool IsWellFormedSessionToken(absl::string_view token) {
  if (token.size() != kSessionTokenChars) return false;
  for (char c : token) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace arfuse
