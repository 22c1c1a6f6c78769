#include "client/cpp/instream_attach.h"

#include "absl/strings/str_cat.h"

namespace arfuse::client {

v1::AttachRequest InStreamAttachRequest(const std::vector<uint32_t>& hiddens) {
  v1::AttachRequest req;
  for (uint32_t h : hiddens) req.add_hidden(h);
  req.set_attach_abi_version(arfuse_client_abi_version());
  req.set_launch_abi_version(arfuse_launch_abi_version());
  req.set_launch_args_bytes(arfuse_launch_args_bytes());
  return req;
}

absl::StatusOr<instream::InStreamContext> AttachInStream(Client& client,
                                                         const std::vector<uint32_t>& hiddens) {
  absl::StatusOr<v1::AttachResponse> resp = client.Attach(InStreamAttachRequest(hiddens));
  if (!resp.ok()) return resp.status();
  absl::StatusOr<instream::InStreamContext> ctx;
  if (resp->fd_count() > 0) {
    ctx = absl::UnimplementedError(absl::StrCat(
        "the sidecar hands this attach's ", resp->fd_count(), " descriptor(s) (",
        resp->memory_kind(), ") over its fd socket, which the C++ client cannot pick up yet"));
  } else {
    ctx = instream::InStreamContext::Attach(resp->attach_blob());
  }
  if (!ctx.ok()) {
    // The sidecar keeps nothing for an attachment that never came to be (best effort: the
    // session's end releases it too).
    client.Detach(resp->attach_id()).IgnoreError();
  }
  return ctx;
}

}  // namespace arfuse::client
