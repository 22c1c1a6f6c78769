// libarfuse_ring: the C ABI around the ring kernel (kernels/doorbell/doorbell_ring.cu).
#include "client/ring/arfuse_ring.h"

#include <cuda_runtime_api.h>

#include <array>
#include <cstring>
#include <map>
#include <mutex>

#include "kernels/doorbell/doorbell.h"

#define ARFUSE_RING_API extern "C" __attribute__((visibility("default")))

namespace {

using Key = std::array<unsigned char, sizeof(cudaIpcMemHandle_t)>;

struct Mapping {
  char* base = nullptr;
  int slots = 0;  // open slots of this block
  // The GPU that holds the block (DoorbellSlot::owner_uuid, read once at open): rings on a
  // stream of that GPU order the op at GPU scope.
  uint8_t owner_uuid[16] = {};
};

// One mapping per IPC handle: a legacy IPC handle may be opened only once per process and
// device, and every plan of a sidecar shares its block.
struct Registry {
  std::mutex mu;
  std::map<Key, Mapping> by_handle;
};

Registry& GetRegistry() {
  static Registry* registry = new Registry;  // never destroyed: rings may outlive statics
  return *registry;
}

// The mapping whose block holds `p`, or end().
std::map<Key, Mapping>::iterator FindBlock(Registry& r, const void* p) {
  const char* c = static_cast<const char*>(p);
  for (auto it = r.by_handle.begin(); it != r.by_handle.end(); ++it) {
    if (c >= it->second.base && c < it->second.base + sizeof(arfuse::DoorbellBlock)) return it;
  }
  return r.by_handle.end();
}

int FromCuda(cudaError_t err) {
  if (err == cudaSuccess) return ARFUSE_RING_OK;
  cudaGetLastError();  // do not leave it for the caller's next unrelated check
  return static_cast<int>(err);
}

}  // namespace

ARFUSE_RING_API int arfuse_open_doorbell(const void* ipc_handle64, uint64_t offset,
                                         void** slot_ptr) {
  if (ipc_handle64 == nullptr || slot_ptr == nullptr ||
      offset % sizeof(arfuse::DoorbellSlot) != 0 || offset >= sizeof(arfuse::DoorbellBlock)) {
    return ARFUSE_RING_EINVAL;
  }
  Key key;
  std::memcpy(key.data(), ipc_handle64, key.size());
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_handle.find(key);
  if (it == r.by_handle.end()) {
    // Load the ring kernel now: the first ring may be inside a graph capture.
    if (cudaError_t err = arfuse::PrepareDoorbellRing(); err != cudaSuccess) return FromCuda(err);
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, key.data(), sizeof(handle));
    void* base = nullptr;
    const cudaError_t err = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) return FromCuda(err);
    Mapping m{static_cast<char*>(base), 0};
    const auto* slot0 = reinterpret_cast<const arfuse::DoorbellSlot*>(base);
    if (cudaError_t read = cudaMemcpy(m.owner_uuid, slot0->owner_uuid, sizeof(m.owner_uuid),
                                      cudaMemcpyDeviceToHost);
        read != cudaSuccess) {
      cudaIpcCloseMemHandle(base);
      return FromCuda(read);
    }
    it = r.by_handle.emplace(key, m).first;
  }
  ++it->second.slots;
  *slot_ptr = it->second.base + offset;
  return ARFUSE_RING_OK;
}

ARFUSE_RING_API int arfuse_close_doorbell(void* slot_ptr) {
  if (slot_ptr == nullptr) return ARFUSE_RING_EINVAL;
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = FindBlock(r, slot_ptr);
  if (it == r.by_handle.end()) return ARFUSE_RING_ENOTOPEN;
  if (--it->second.slots > 0) return ARFUSE_RING_OK;
  const cudaError_t err = cudaIpcCloseMemHandle(it->second.base);
  r.by_handle.erase(it);
  return FromCuda(err);
}

ARFUSE_RING_API int arfuse_ring(void* stream, void* slot_ptr, uint32_t num_tokens,
                                uint64_t timeout_ns) {
  // The kernel launcher refuses null, misaligned slots and a zero timeout without touching the
  // device. The scope: GPU scope when the current device (the one a launch on `stream` runs on)
  // holds the slot's block: a lookup in the few open blocks and a thread-local device query,
  // nothing a capture forbids. A slot not opened here rings at system scope, right from any GPU.
  arfuse::DoorbellScope scope = arfuse::DoorbellScope::kSystem;
  uint8_t owner[16];
  bool known = false;
  {
    Registry& r = GetRegistry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = FindBlock(r, slot_ptr);
    if (it != r.by_handle.end()) {
      std::memcpy(owner, it->second.owner_uuid, sizeof(owner));
      known = true;
    }
  }
  if (known && arfuse::DoorbellRingScopeFor(owner, &scope) != cudaSuccess) {
    cudaGetLastError();
    scope = arfuse::DoorbellScope::kSystem;
  }
  const cudaError_t err =
      arfuse::LaunchDoorbellRing(static_cast<arfuse::DoorbellSlot*>(slot_ptr), num_tokens,
                                 timeout_ns, static_cast<cudaStream_t>(stream), scope);
  if (err == cudaErrorInvalidValue &&
      arfuse::CheckDoorbellRingArgs(static_cast<arfuse::DoorbellSlot*>(slot_ptr), timeout_ns) !=
          cudaSuccess) {
    return ARFUSE_RING_EINVAL;
  }
  return FromCuda(err);
}

ARFUSE_RING_API int arfuse_doorbell_error(void* slot_ptr, uint32_t* code) {
  if (slot_ptr == nullptr || code == nullptr) return ARFUSE_RING_EINVAL;
  {
    Registry& r = GetRegistry();
    std::lock_guard<std::mutex> lock(r.mu);
    if (FindBlock(r, slot_ptr) == r.by_handle.end()) return ARFUSE_RING_ENOTOPEN;
  }
  auto* slot = static_cast<arfuse::DoorbellSlot*>(slot_ptr);
  return FromCuda(cudaMemcpy(code, &slot->error, sizeof(*code), cudaMemcpyDeviceToHost));
}

ARFUSE_RING_API const char* arfuse_doorbell_error_name(uint32_t code) {
  return arfuse::DoorbellErrorName(code);
}

ARFUSE_RING_API int arfuse_doorbell_check_values(uint32_t request_value, uint32_t complete_value,
                                                 uint32_t reset_value) {
  return request_value == arfuse::kDoorbellRequest && complete_value == arfuse::kDoorbellComplete &&
                 reset_value == arfuse::kDoorbellReset
             ? ARFUSE_RING_OK
             : ARFUSE_RING_EVERSION;
}

ARFUSE_RING_API const char* arfuse_ring_strerror(int rc) {
  switch (rc) {
    case ARFUSE_RING_OK:
      return "ok";
    case ARFUSE_RING_EINVAL:
      return "invalid argument (null or misaligned slot, offset outside the doorbell block, zero "
             "timeout)";
    case ARFUSE_RING_ENOTOPEN:
      return "slot was not opened with arfuse_open_doorbell";
    case ARFUSE_RING_EVERSION:
      return "doorbell handshake values differ from this library's (client and sidecar versions "
             "differ)";
    default:
      break;
  }
  if (rc > 0) return cudaGetErrorString(static_cast<cudaError_t>(rc));
  return "unknown arfuse_ring error";
}
