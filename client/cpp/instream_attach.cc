#include "client/cpp/instream_attach.h"

#include "absl/strings/str_cat.h"
#include "common/fd/fd_channel_client.h"

namespace arfuse::client {

v1::AttachRequest InStreamAttachRequest(const std::vector<uint32_t>& hiddens) {
  v1::AttachRequest req;
  for (uint32_t h : hiddens) req.add_hidden(h);
  req.set_attach_abi_version(arfuse_client_abi_version());
  req.set_launch_abi_version(arfuse_launch_abi_version());
  req.set_launch_args_bytes(arfuse_launch_args_bytes());
  req.set_client_version(arfuse_client_version());
  return req;
}

absl::StatusOr<instream::InStreamContext> AttachInStream(Client& client,
                                                         const std::vector<uint32_t>& hiddens) {
  absl::StatusOr<v1::AttachResponse> resp = client.Attach(InStreamAttachRequest(hiddens));
  if (!resp.ok()) return resp.status();
  absl::StatusOr<instream::InStreamContext> ctx;
  if (resp->fd_count() > 0) {
    // The descriptors wait on the sidecar's fd channel under the attach's single-use ticket.
    absl::StatusOr<std::vector<UniqueFd>> fds = PickupFds(resp->fd_socket(), resp->fd_ticket());
    if (!fds.ok()) {
      ctx = fds.status();
    } else if (fds->size() != resp->fd_count()) {
      ctx = absl::InvalidArgumentError(absl::StrCat(
          "picked up ", fds->size(), " descriptors, the attach announced ", resp->fd_count()));
    } else {
      std::vector<int> raw;
      for (const UniqueFd& fd : *fds) raw.push_back(fd.get());
      ctx = instream::InStreamContext::Attach(resp->attach_blob(), raw);  // dups what it keeps
    }
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
