#include "common/version.h"

#include "absl/strings/str_format.h"
#include "common/git_revision.h"

namespace arfuse {

const char kGitRevision[] = ARFUSE_GIT_REVISION;

std::string VersionLine(std::string_view program) {
  return absl::StrFormat("%s %s (git %s, api %u.%u)", program, kVersion, kGitRevision, kApiMajor,
                         kApiMinor);
}

}  // namespace arfuse
