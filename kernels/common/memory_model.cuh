// Memory-model helpers shared by the fused kernels (kernels/allreduce_fusion) and the doorbell
// kernels (kernels/doorbell, client/ring). CUDA only. Each helper is one PTX instruction with the
// scope and semantics in its name; the comments at the call sites say why that ordering is needed.
//   * .gpu scope: both sides are blocks of one grid (or of kernels of one device).
//   * .sys scope: the other side is another process (a client under MPS) or another GPU (peers
//     over NVLink).
#pragma once

#include <cstdint>

namespace arfuse {
namespace device_sync {

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Polls that must reach memory every time (no caching in L1, no reordering by the compiler).
__device__ __forceinline__ uint32_t LoadVolatile32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Four adjacent 32-bit words (16-byte aligned) in one access; each word single-copy atomic.
__device__ __forceinline__ void LoadVolatile32x4(const uint32_t* p, uint32_t (&w)[4]) {
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
               : "l"(p)
               : "memory");
}

// Two adjacent 32-bit words (8-byte aligned) in one access; each word single-copy atomic.
__device__ __forceinline__ void LoadVolatile32x2(const uint32_t* p, uint32_t& a, uint32_t& b) {
  asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "l"(p) : "memory");
}

__device__ __forceinline__ void StoreVolatile32(uint32_t* p, uint32_t v) {
  asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Two aligned 64-bit words in one access. The vector access as a whole is not single-copy
// atomic; each 64-bit element is, which is all a reader that validates every word needs.
__device__ __forceinline__ void LoadVolatile64x2(const uint64_t* p, uint64_t& a, uint64_t& b) {
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}

__device__ __forceinline__ void StoreVolatile64x2(uint64_t* p, uint64_t a, uint64_t b) {
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}

__device__ __forceinline__ uint32_t LoadRelaxedSys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreRelaxedSys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void StoreRelaxedSys64(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t LoadRelaxedSys64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t LoadAcquireGpu32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreReleaseGpu32(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint64_t LoadAcquireGpu64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreRelaxedGpu64(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// With a later strong store of this thread, a release pattern: a thread that acquires that store
// sees everything this thread wrote or observed before the fence. Issued ahead, it takes its wait
// for this thread's outstanding stores off the path of the store that follows.
__device__ __forceinline__ void FenceAcqRelGpu() {
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

__device__ __forceinline__ uint32_t LoadAcquireSys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
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

// Counting blocks of one grid: acq_rel at GPU scope, so the counting chain orders every block's
// earlier stores before the operations of the block that sees the last count.
__device__ __forceinline__ uint32_t AtomicAddAcqRelGpu(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(p), "r"(v)
               : "memory");
  return old;
}

// Programmatic dependent launch (sm_90+). Both are no-ops for a kernel that was not launched as a
// dependent (wait) or has no dependent launched that way (launch_dependents).
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

}  // namespace device_sync
}  // namespace arfuse
