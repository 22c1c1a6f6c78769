#include "server/instream/cuda/workspace_export.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "server/cuda_device/cuda_status.h"

namespace arfuse {

absl::StatusOr<InStreamExport> ExportWorkspaceInStream(const FusionWorkspace& workspace,
                                                       InStreamKernelImage& image,
                                                       const InStreamExportSpec& spec,
                                                       const std::vector<uint32_t>& hiddens) {
  const WorkspaceLayout& layout = workspace.layout();
  std::vector<uint32_t> wanted = hiddens.empty() ? std::vector<uint32_t>{layout.hidden} : hiddens;
  if (wanted.size() > instream::kMaxAttachHiddens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "at most ", instream::kMaxAttachHiddens, " hidden sizes per attach, got ", wanted.size()));
  }
  for (uint32_t h : wanted) {
    if (h > layout.hidden) {
      return absl::InvalidArgumentError(absl::StrCat(
          "hidden ", h, " exceeds the workspace's hidden ", layout.hidden, " (--hidden)"));
    }
  }
  InStreamExport e;
  e.device = instream::DeviceKind::kCuda;
  e.rank = static_cast<uint32_t>(spec.rank);
  e.world_size = static_cast<uint32_t>(spec.world_size);
  e.generation = workspace.generation();
  cudaDeviceProp prop;
  ARFUSE_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, spec.device));
  static_assert(sizeof(prop.uuid.bytes) == sizeof(e.gpu_uuid));
  std::memcpy(e.gpu_uuid, prop.uuid.bytes, sizeof(e.gpu_uuid));
  e.sm = static_cast<uint32_t>(spec.sm);
  e.sm_budget = workspace.options().sm_budget;
  e.spin_timeout_ns =
      static_cast<uint64_t>(absl::ToInt64Nanoseconds(workspace.options().spin_timeout));
  bool pdl = false;
  CurrentFusionKernelConfig(e.kernel_config, &pdl);
  // As the sidecar's own launches: programmatic dependents only on a GPU of one rank.
  e.pdl = pdl && e.sm_budget == 0;
  e.dtype = spec.dtype;
  switch (spec.forced) {
    case ForcedPath::kOneShot:
      e.oneshot_max_bytes = e.twoshot_max_bytes = UINT64_MAX;
      break;
    case ForcedPath::kTwoShot:
      e.twoshot_max_bytes = UINT64_MAX;
      break;
    case ForcedPath::kUnfused:
      return absl::FailedPreconditionError(
          "the dispatch is forced to the unfused path: no op would run in-stream");
    case ForcedPath::kAuto: {
      const DispatchEntry* entry = spec.table->Find(spec.sm, spec.world_size);
      if (entry == nullptr || (entry->oneshot_max_bytes == 0 && entry->twoshot_max_bytes == 0)) {
        return absl::FailedPreconditionError(
            absl::StrCat("the dispatch table has no fused range for sm_", spec.sm,
                         " at world size ", spec.world_size, ": every op would run unfused"));
      }
      e.oneshot_max_bytes = entry->oneshot_max_bytes;
      e.twoshot_max_bytes = std::max(entry->oneshot_max_bytes, entry->twoshot_max_bytes);
      break;
    }
  }
  static_assert(sizeof(WorkspaceLayout) == sizeof(e.layout));
  std::memcpy(e.layout, &layout, sizeof(e.layout));
  e.max_tokens = layout.max_tokens;
  e.hidden = layout.hidden;
  int sms = 0;
  ARFUSE_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, spec.device));
  ARFUSE_ASSIGN_OR_RETURN(e.entries,
                          image.Entries(spec.dtype, spec.world_size, wanted, e.sm_budget, sms));
  for (int r = 0; r < spec.world_size; ++r) {
    ARFUSE_ASSIGN_OR_RETURN(InStreamRankMemory m, workspace.ExportForClient(r));
    e.ranks.push_back(std::move(m));
  }
  e.image = image.bytes();
  e.image_bytes = image.size();
  return e;
}

}  // namespace arfuse
