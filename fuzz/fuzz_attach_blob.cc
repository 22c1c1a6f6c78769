// libFuzzer: the attach blob a sidecar hands libarfuse_client (kernels/instream/attach_abi.h) ->
// ParseAttachBlob (client/instream/blob_reader.h), the checks arfuse_attach makes before it maps
// or loads anything. A client should never trust its sidecar's bytes blindly: a blob of another
// build, or a corrupted one, must be refused, never read out of bounds.
//
// Input: byte 0 = how many descriptors the caller says it picked up (low 5 bits); the rest is the
// blob. Oracles besides ASan/UBSan: an accepted blob's entries and ranks are as many as its
// header says, every rank's descriptor index is below the descriptor count or -1, and the image
// lies inside the input.
#include <cstddef>
#include <cstdint>

#include "client/instream/blob_reader.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const size_t num_fds = data[0] & 0x1f;
  const uint8_t* blob = data + 1;
  const size_t bytes = size - 1;
  auto parsed = arfuse::instream::lib::ParseAttachBlob(blob, bytes, num_fds);
  if (!parsed.ok()) return 0;
  Check(parsed->entries.size() == parsed->header.num_entries);
  Check(parsed->ranks.size() == parsed->header.world_size);
  for (const auto& r : parsed->ranks) {
    Check(r.fd_index == -1 || (r.fd_index >= 0 && static_cast<size_t>(r.fd_index) < num_fds));
  }
  if (parsed->image_bytes != 0) {
    Check(parsed->image >= blob && parsed->image + parsed->image_bytes <= blob + bytes);
  }
  return 0;
}
