// Memory-model helpers of the doorbell kernels (CUDA only, internal to kernels/doorbell and
// client/ring). System scope everywhere: the other side of every word is another process (the
// client's kernels run in its own context, under MPS on the same GPU).
#pragma once

#include <cstdint>

namespace arfuse {
namespace doorbell_device {

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A poll that must reach memory every time; ordering comes from the acquire that follows a hit.
__device__ __forceinline__ uint32_t LoadRelaxedSys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t LoadAcquireSys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreRelaxedSys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Everything this thread wrote or observed before (including, through kernel-boundary ordering,
// what earlier kernels of its stream wrote) is visible to a thread that acquires this store.
__device__ __forceinline__ void StoreReleaseSys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Compare-and-swap that, when it succeeds, acquires what the writer of `expected` released.
__device__ __forceinline__ uint32_t CasAcquireSys(uint32_t* p, uint32_t expected,
                                                  uint32_t desired) {
  uint32_t old;
  asm volatile("atom.acquire.sys.global.cas.b32 %0, [%1], %2, %3;"
               : "=r"(old)
               : "l"(p), "r"(expected), "r"(desired)
               : "memory");
  return old;
}

__device__ __forceinline__ uint32_t CasRelaxedSys(uint32_t* p, uint32_t expected,
                                                  uint32_t desired) {
  uint32_t old;
  asm volatile("atom.relaxed.sys.global.cas.b32 %0, [%1], %2, %3;"
               : "=r"(old)
               : "l"(p), "r"(expected), "r"(desired)
               : "memory");
  return old;
}

// Programmatic dependent launch (sm_90+); no-ops for kernels not launched that way.
__device__ __forceinline__ void WaitForPrerequisiteGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void AllowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace doorbell_device
}  // namespace arfuse
