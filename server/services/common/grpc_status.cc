#include "server/services/common/grpc_status.h"

#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/version.h"

namespace arfuse {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl::StatusCode and grpc::StatusCode share their numbering (both follow google.rpc.Code).
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::Status CheckClientApiVersion(const grpc::ServerContextBase& context) {
  const auto& md = context.client_metadata();
  auto it = md.find(kApiVersionMetadataKey);
  if (it == md.end()) return absl::OkStatus();
  std::string value(it->second.data(), it->second.size());
  std::vector<std::string> parts = absl::StrSplit(value, '.');
  unsigned major = 0;
  unsigned minor = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &major) ||
      !absl::SimpleAtoi(parts[1], &minor)) {
    return absl::FailedPreconditionError(
        absl::StrCat("client API version \"", value.substr(0, 32),
                     "\" is not MAJOR.MINOR; server API version is ", kApiMajor, ".", kApiMinor));
  }
  if (major != kApiMajor) {
    return absl::FailedPreconditionError(absl::StrCat("client API version ", value.substr(0, 32),
                                                      " is not supported by server API version ",
                                                      kApiMajor, ".", kApiMinor));
  }
  return absl::OkStatus();
}

}  // namespace arfuse
