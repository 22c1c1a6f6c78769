// arfuse.v1 messages to the registry's plain types and back. Enum values are passed through raw,
// so a newer client's unknown values reach validation and get a clear INVALID_ARGUMENT.
#pragma once

#include "arfuse/v1/fusion.pb.h"
#include "server/registry/registry.h"
#include "server/registry/types.h"

namespace arfuse {

RegionSpec ToRegionSpec(const v1::RegisterRegionRequest& req);
OpRequest ToOpRequest(const v1::OpSpec& op);
void ToRegionInfoProto(const RegionInfo& info, v1::RegionInfo* out);

}  // namespace arfuse
