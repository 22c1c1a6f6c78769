// Device code of the fused allreduce (+ residual add + RMSNorm, + FP8 quantization) kernels:
// the bodies every kernel that runs an op includes. CUDA only; included by kernels/allreduce_fusion
// (the by-value and indirect kernels), kernels/instream (the in-stream image) and kernels/doorbell
// (the serving kernel that runs one-shot ops in place).
//   fusion_sync.cuh      knobs, error words, spins, op agreement, Lamport waits
//   fusion_epilogue.cuh  a row's norm store and FP8 quantization
//   fusion_oneshot.cuh   OneShotBody
//   fusion_twoshot.cuh   TwoShotBody
// docs/kernels.md has the protocol and the memory-ordering argument.
#pragma once

#include "kernels/allreduce_fusion/fusion_oneshot.cuh"
#include "kernels/allreduce_fusion/fusion_twoshot.cuh"
