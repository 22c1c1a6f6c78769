// Who made a call: the credentials of the process at the other end of the connection that
// carried it, for the services that act on a caller's behalf (RegisterRegion of host memory,
// claiming an fd ticket). The daemon accepts its Unix sockets itself and records each
// connection's SO_PEERCRED (ConnectionTable); services ask by the connection's name as gRPC
// reports it (ServerContext::peer()), so nothing below the services knows gRPC.
#pragma once

#include <optional>

#include "absl/strings/string_view.h"
#include "server/fdpass/socket_credentials.h"

namespace arfuse {

class CallerCredentials {
 public:
  virtual ~CallerCredentials() = default;
  // The credentials of the connection gRPC names `peer`, while a call on it is in progress;
  // nullopt when they are not known (a TCP client, a connection the daemon did not accept).
  virtual std::optional<SocketCredentials> ForPeer(absl::string_view peer) const = 0;
};

// Every caller is this process (in-process servers and their tests).
class OwnProcessCredentials final : public CallerCredentials {
 public:
  std::optional<SocketCredentials> ForPeer(absl::string_view) const override;
};

}  // namespace arfuse
