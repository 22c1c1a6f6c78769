// What one in-stream attach hands a client library about a fused workspace (docs/instream.md):
// the workspace's mappings for every rank, its layout and generation, the kernel configuration
// and the dispatch the sidecar's own ops would use, and the kernel image's entries sized for this
// GPU. The engine decides whether its workspace may be exported (initialized, fused, healthy);
// this file knows what an export holds. CUDA only.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/common/op_types.h"
#include "server/collective/dispatch_table.h"
#include "server/cuda_device/fusion_workspace.h"
#include "server/engine_api/instream_host.h"
#include "server/instream/cuda/kernel_image.h"

namespace arfuse {

// Who exports, and the dispatch its own ops follow.
struct InStreamExportSpec {
  int device = 0;  // CUDA device ordinal of the workspace
  int sm = 0;      // its compute capability, major * 10 + minor
  int rank = 0;
  int world_size = 1;
  DType dtype = DType::kBF16;
  ForcedPath forced = ForcedPath::kAuto;
  const DispatchTable* table = nullptr;  // not owned; required with ForcedPath::kAuto
};

// Describes `workspace` for a client that will run ops of these hidden sizes (empty: the
// workspace's), with `image` loaded on this GPU. INVALID_ARGUMENT (too many hiddens, one above
// the workspace's or one the kernels cannot run), FAILED_PRECONDITION (the dispatch sends every op
// to the unfused path).
absl::StatusOr<InStreamExport> ExportWorkspaceInStream(const FusionWorkspace& workspace,
                                                       InStreamKernelImage& image,
                                                       const InStreamExportSpec& spec,
                                                       const std::vector<uint32_t>& hiddens);

}  // namespace arfuse
