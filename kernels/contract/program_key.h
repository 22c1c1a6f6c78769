// An in-stream launch's program key (InStreamLaunchArgs::program_key, set by every rank of one
// client program alike through arfuse_set_program_key; 0 = none). The kernels compare its low
// kProgramKeyBits bits in the op descriptor (fusion_sync.cuh's MakeOpDesc) and host mode compares
// it with the op (host_collective.h), so the ops of two programs never pair. The client library
// refuses a key with higher bits. CUDA-free: both sides include it.
#pragma once

#include <cstdint>

namespace arfuse {

inline constexpr uint32_t kProgramKeyBits = 24;
inline constexpr uint32_t kProgramKeyMax = (1u << kProgramKeyBits) - 1;

}  // namespace arfuse
