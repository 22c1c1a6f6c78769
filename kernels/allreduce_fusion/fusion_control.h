// The control block at the start of every rank's workspace (WorkspaceLayout::control_offset).
// Shared between host code (sizes, word addresses) and the kernels; peers write into it over
// NVLink, so its layout is fixed by static_asserts.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/allreduce_fusion/allreduce_fusion.h"

namespace arfuse {

struct FusionControl {
  // First FusionError of this workspace; sticky until LaunchWorkspaceInit.
  uint32_t error;
  // Nonzero makes every spin on this rank exit: the host writes it (any value), and a failing
  // peer writes FusionError::kPeerAbort into it.
  uint32_t abort;
  // One-shot: number of calls so far; buffer epoch % 3 receives this call's data.
  uint32_t lamport_epoch;
  // One-shot: blocks of the current call that finished; the last one advances the epoch.
  uint32_t lamport_arrived;
  // Two-shot: barrier sequence; a call's two barriers wait for seq + 1 and seq + 2.
  uint32_t twoshot_seq;
  uint32_t twoshot_arrived;
  uint32_t reserved0[2];
  // One-shot: elements per rank slot the call that used buffer i wrote (what to clear later).
  uint64_t lamport_used_elems[3];
  uint8_t reserved1[256 - 56];
  // Two-shot barrier: barrier[b][r] is written by block b of rank r (st.release.sys) and polled
  // by block b of this rank (ld.acquire.sys).
  uint32_t barrier[kMaxFusionBlocks][kMaxWorldSize];
};
static_assert(offsetof(FusionControl, error) == 0);
static_assert(offsetof(FusionControl, abort) == 4);
static_assert(offsetof(FusionControl, lamport_used_elems) == 32);
static_assert(offsetof(FusionControl, barrier) == 256);
static_assert(sizeof(FusionControl) == 256 + kMaxFusionBlocks * kMaxWorldSize * 4);

}  // namespace arfuse
