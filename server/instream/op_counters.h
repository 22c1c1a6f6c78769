// The sidecar's side of an attachment's op counter page (kernels/instream/op_counters.h): the
// sealed shared-memory object the attached client counts its ops in, and the bounded reading of
// it. No gRPC, no CUDA.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "common/fd/unique_fd.h"
#include "kernels/instream/op_counters.h"
#include "server/instream/op_counts.h"

namespace arfuse {

// One attachment's counter page: a memfd of instream::kOpCounterObjectBytes sealed against
// shrinking and growing (a client that could shrink it would fault the sidecar's mapping), mapped
// read-only here. The client writes every slot; Sample() reads each as one aligned word and adds
// what it advanced since the last read, within instream::kMaxOpCounterDelta, so nothing the
// client writes reaches beyond this attachment's numbers.
class InStreamOpCounterPage {
 public:
  // FAILED_PRECONDITION when the object cannot be created, sized, sealed or mapped.
  static absl::StatusOr<std::unique_ptr<InStreamOpCounterPage>> Create();
  ~InStreamOpCounterPage();
  InStreamOpCounterPage(const InStreamOpCounterPage&) = delete;
  InStreamOpCounterPage& operator=(const InStreamOpCounterPage&) = delete;

  // The descriptor to hand the client (duplicated by the fd channel's offer; the page keeps it).
  int fd() const { return fd_.get(); }

  // This attachment's counts so far: every slot read once more, each advance within the bound
  // added. A slot that moved by more (garbage, or lowered) adds nothing and is read from its new
  // value on. Not thread-safe (the attachments' table calls it under its lock).
  const InStreamOpCounts& Sample();
  // How many slot reads were refused as garbage.
  uint64_t refused_reads() const { return refused_; }

 private:
  InStreamOpCounterPage(UniqueFd fd, const void* map) : fd_(std::move(fd)), map_(map) {}

  UniqueFd fd_;
  const void* map_;
  instream::OpCounterPage last_{};  // the slots as last read (zero: the page starts zeroed)
  InStreamOpCounts counted_;
  uint64_t refused_ = 0;
};

}  // namespace arfuse
