// The launch-parameter ABI of the in-stream kernels: every function of the kernel image takes
// exactly one parameter, an InStreamLaunchArgs by value. The client library fills it and passes
// it to cuLaunchKernelEx; the image's kernels read it. Both sides are compiled separately, so the
// layout is pinned here and its version and size travel in the attach blob (attach_abi.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/allreduce_fusion/allreduce_fusion.h"
#include "kernels/instream/attach_abi.h"

namespace arfuse::instream {

struct InStreamLaunchArgs {
  // The op, exactly as the sidecar's own launches fill it: peer_workspace from the client's
  // mappings, the client's tensors, host_abort null (the sidecar aborts through the workspace's
  // own abort word) and host_error the client's host-mapped error word.
  FusionParams fusion;
  // KernelConfig (fusion_device.cuh) as the attach blob gave it.
  uint32_t kernel_config[5];
  // kLaunchAbiVersion: a kernel that finds another value writes kErrorLaunchAbi and returns.
  uint32_t abi_version;
  // The workspace generation the client attached to (FusionControl::generation must match).
  uint64_t generation;
  // The attachment's slot of FusionControl::instream_ops (AttachHeader::counter_slot,
  // kernels/instream/op_counters.h), where the
  // kernel counts this launch. Written by the client, so the kernel trusts nothing in it: an
  // index of kInStreamAttachSlots or more is counted in kInStreamUnattributedSlot.
  uint32_t counter_slot;
  // The program key the client set (arfuse_set_program_key; 0 = none): its low 24 bits go into
  // the op descriptor, so ranks whose clients belong to different programs never pair an op
  // (fusion_sync.cuh). Keys above 24 bits are refused by the client library.
  uint32_t program_key;
};
static_assert(sizeof(InStreamLaunchArgs) == kLaunchArgsBytes);
static_assert(offsetof(InStreamLaunchArgs, kernel_config) == 328);
static_assert(offsetof(InStreamLaunchArgs, abi_version) == 348);
static_assert(offsetof(InStreamLaunchArgs, generation) == 352);
static_assert(offsetof(InStreamLaunchArgs, counter_slot) == 360);
static_assert(offsetof(InStreamLaunchArgs, program_key) == 364);

}  // namespace arfuse::instream
