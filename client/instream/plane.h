// The device half of an attachment (arfuse_ctx): the CUDA plane (mapped GPU workspaces and the
// sidecar's kernel image, cuda_plane.h) or the host plane (the host workspace and the CPU
// collective, host_plane.h). The device-independent half (the blob, the dispatch, the tensor
// rules, the disabled state) lives in the ctx (arfuse_client.cc, op_rules.h).
#pragma once

#include <cstdint>

#include "kernels/common/op_types.h"
#include "kernels/common/plain_status.h"
#include "kernels/instream/attach_abi.h"

namespace arfuse::instream::lib {

// One op as the caller asked for it (the C ABI's arguments).
using OpRequest = FusedOpArgs;

// What the dispatch chose for an op: the algorithm (kAlgoOneShot, kAlgoTwoShot) and its entry.
struct Dispatch {
  const KernelEntry* entry = nullptr;
  uint32_t entry_index = 0;  // in the blob's entry order
  uint8_t algo = 0;
  uint64_t payload = 0;  // tokens x hidden x dtype size
};

class Plane {
 public:
  virtual ~Plane() = default;

  // OUT_OF_RANGE ("fusion unavailable for this op: ...") when tokens x hidden does not fit the
  // device's buffers (the GPU workspace's Lamport and two-shot slots, the host workspace's slot).
  virtual plain::Status CheckCapacity(uint32_t tokens, uint32_t hidden, DType dtype) const = 0;

  // INVALID_ARGUMENT naming the tensor when the device cannot use `ptr` (CUDA: not device memory
  // of the attachment's GPU). Must not break a graph capture.
  virtual plain::Status CheckPointer(const void* ptr, const char* name) = 0;

  // Runs the checked op: one kernel launch on `stream` (CUDA), or the host collective. FAILED_
  // PRECONDITION for a stale workspace; host mode also DEADLINE_EXCEEDED / ABORTED.
  // `program_key`: the ctx's (arfuse_set_program_key; 0 = none), published with the op so that
  // ranks of different programs never pair it.
  virtual plain::Status Run(const OpRequest& op, const Dispatch& d, uint32_t program_key,
                            void* stream) = 0;

  // The attachment's error word: 0 healthy, else a FusionError code or kErrorStaleGeneration /
  // kErrorLaunchAbi. No CUDA call.
  virtual uint32_t ErrorCode() const = 0;

  // Compute capability x 10 of the attachment's GPU (0 in host mode).
  virtual uint32_t sm() const = 0;
};

}  // namespace arfuse::instream::lib
