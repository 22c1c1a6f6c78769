// The unfused path's NCCL communicator, one per group. Created collectively through Exchange
// (rank 0's unique id travels with Allgather), nonblocking so that initialization and every
// call are bounded by a deadline instead of hanging on a missing rank. NCCL refuses two ranks on
// one GPU ("Duplicate GPU detected"), so Create checks device identities first and fails the
// same way on every rank (FAILED_PRECONDITION) rather than letting NCCL hang or abort.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/common/op_types.h"

namespace arfuse {

class Exchange;

class NcclComm {
 public:
  // Collective. FAILED_PRECONDITION when two ranks share a GPU; DEADLINE_EXCEEDED when the group
  // did not form in time (the half-built communicator is aborted).
  // `blocking`: a blocking communicator (used for symmetric windows: their registration failed
  // on a nonblocking one on our H200s and left it unusable). Created only after a nonblocking
  // one succeeded, so every peer is known to be alive.
  static absl::StatusOr<std::unique_ptr<NcclComm>> Create(Exchange& exchange, absl::Time deadline,
                                                          bool blocking = false);

  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  // Aborts the communicator (never waits for peers or outstanding work), then frees the
  // symmetric buffers.
  ~NcclComm();

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

  // Enqueues a sum allreduce of `count` elements on `stream` (capturable in a CUDA graph).
  absl::Status AllReduce(const void* send, void* recv, size_t count, DType dtype,
                         cudaStream_t stream, absl::Time deadline);

  // Collective: `bytes` of NCCL memory (ncclMemAlloc) registered as a symmetric window, so
  // allreduces whose buffers both lie in windows may run NCCL's symmetric kernels. Owned by
  // this communicator; valid until it is destroyed.
  absl::StatusOr<void*> AllocSymmetric(size_t bytes, absl::Time deadline);

 private:
  NcclComm(ncclComm_t comm, int rank, int world_size)
      : comm_(comm), rank_(rank), world_size_(world_size) {}
  // A nonblocking communicator may answer ncclInProgress: wait (bounded) until it settles.
  absl::Status WaitReady(ncclResult_t started, const char* what, absl::Time deadline);

  ncclComm_t comm_;
  int rank_;
  int world_size_;
  std::vector<void*> symmetric_;
};

}  // namespace arfuse
