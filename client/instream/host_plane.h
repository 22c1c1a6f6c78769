// Host mode of libarfuse_client: the group's host workspace (kernels/host/host_workspace.h),
// mapped from the descriptor the sidecar handed out, and the CPU collective run synchronously
// in the caller's thread (kernels/host/host_collective.h), taking turns with this rank's host
// engine.
#pragma once

#include <atomic>
#include <memory>

#include "client/instream/blob_reader.h"
#include "client/instream/plane.h"
#include "kernels/common/plain_status.h"
#include "kernels/host/host_collective.h"

namespace arfuse::instream::lib {

class HostPlane final : public Plane {
 public:
  // Maps fds[rank's fd_index] and checks the workspace's header against the blob: FAILED_
  // PRECONDITION for another layout, or "stale generation" for another generation or a retired
  // workspace.
  static plain::StatusOr<std::unique_ptr<HostPlane>> Attach(const ParsedBlob& blob, const int* fds);

  plain::Status CheckCapacity(uint32_t tokens, uint32_t hidden, DType dtype) const override;
  plain::Status CheckPointer(const void*, const char*) override { return plain::OkStatus(); }
  plain::Status Run(const OpRequest& op, const Dispatch& d, uint32_t program_key,
                    void* stream) override;
  uint32_t ErrorCode() const override;
  uint32_t sm() const override { return 0; }

 private:
  HostPlane(const ParsedBlob& blob, host::HostWsMapping mapping);

  const AttachHeader header_;
  host::HostWsMapping mapping_;
  host::HostCollective collective_;
  // The first failure of an op of this attachment (HostWsError or kErrorStaleGeneration).
  std::atomic<uint32_t> error_{0};
};

}  // namespace arfuse::instream::lib
