// CUDA IPC regions: a client's legacy cudaIpcMemHandle_t opened on this sidecar's device, sized
// with cuMemGetAddressRange (the true allocation, not the client's claim). Built only with the
// CUDA toolkit.
#pragma once

#include <memory>

#include "server/registry/opener.h"

namespace arfuse {

namespace cuda_opener_internal {
struct Cache;
}

class CudaIpcOpener final : public MemoryOpener {
 public:
  explicit CudaIpcOpener(int32_t device_id);
  ~CudaIpcOpener() override;
  MemoryKind kind() const override { return MemoryKind::kCudaIpc; }
  int32_t device_id() const override { return device_id_; }
  absl::StatusOr<std::unique_ptr<Mapping>> Open(const RegionSpec& spec) override;

 private:
  const int32_t device_id_;
  // A process may open one handle once per context: sessions registering the same allocation
  // share one opened pointer, closed when the last of their mappings goes.
  std::shared_ptr<cuda_opener_internal::Cache> cache_;
};

}  // namespace arfuse
