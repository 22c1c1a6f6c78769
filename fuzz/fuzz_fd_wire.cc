// libFuzzer: bytes (and descriptors) arriving on arfused's fd channel (common/fd/fd_wire.h;
// any allowed local user can connect to <socket>.fd) -> TakeFdMessage -> AnswerFdRequest against
// a real FdTicketBroker, as FdChannelServer does for each request.
//
// Input: byte 0 = how many descriptors arrive with the bytes (low 5 bits, at most 20) and, in bit
// 7, whether a PICKUP is answered for a ticket the broker really offered (so the success path is
// reached); the rest is the byte stream. Oracles besides ASan/UBSan: every reply decodes as one
// message of an answer op; DEPOSIT_OK carries a well-formed ticket that its owner claims, with as
// many descriptors as were deposited; PICKUP_OK announces exactly the descriptors it carries;
// pending tickets stay within the broker's caps; and no descriptor is leaked (the process holds
// the same descriptors before and after the input).
#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>

#include "common/fd/fd_wire.h"
#include "server/fdpass/fd_channel_server.h"
#include "server/fdpass/ticket_broker.h"
#include "spdlog/spdlog.h"

namespace {

using namespace arfuse;

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

int OpenFds() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return -1;
  while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.' ? 1 : 0;
  ::closedir(d);
  return n;
}

// One reply as the client would read it.
void CheckReply(const FdReply& reply, FdOp request_op, size_t request_fds, FdTicketBroker& broker,
                uid_t uid) {
  std::string bytes = reply.bytes;
  std::deque<UniqueFd> fds;
  for (size_t i = 0; i < reply.fds.size(); ++i) fds.emplace_back(::dup(reply.fds[i].get()));
  absl::StatusOr<std::optional<FdMessage>> m = TakeFdMessage(bytes, fds);
  Check(m.ok() && m->has_value() && bytes.empty() && fds.empty());
  const FdMessage& msg = **m;
  switch (msg.op) {
    case FdOp::kDepositOk: {
      Check(request_op == FdOp::kDeposit && IsWellFormedFdTicket(msg.body));
      absl::StatusOr<std::vector<UniqueFd>> claimed = broker.Claim(msg.body, uid + 1);
      Check(claimed.status().code() == absl::StatusCode::kPermissionDenied);
      claimed = broker.Claim(msg.body, uid);
      Check(claimed.ok() && claimed->size() == request_fds);
      break;
    }
    case FdOp::kPickupOk:
      Check(request_op == FdOp::kPickup && msg.fds.size() == reply.fds.size() && !msg.fds.empty() &&
            msg.body.empty());
      break;
    case FdOp::kError:
      Check(!DecodeFdError(msg.body).ok());
      break;
    default:
      Check(false);
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int fds_before = OpenFds();
  {
    const int arriving = std::min(data[0] & 0x1f, 20);
    const bool real_offer = (data[0] & 0x80) != 0;
    std::string buf(reinterpret_cast<const char*>(data + 1), size - 1);
    std::deque<UniqueFd> fds;
    for (int i = 0; i < arriving; ++i) fds.emplace_back(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    FdTicketBrokerOptions caps;
    caps.max_fds_per_uid = 20;
    caps.max_fds = 24;
    FdTicketBroker broker(caps);
    SocketCredentials client;
    client.uid = 1000;
    for (int i = 0; i < 32; ++i) {
      absl::StatusOr<std::optional<FdMessage>> m = TakeFdMessage(buf, fds);
      if (!m.ok()) {
        // What the server answers before it closes the connection.
        std::string err = EncodeFdError(m.status());
        std::deque<UniqueFd> none;
        auto back = TakeFdMessage(err, none);
        Check(back.ok() && back->has_value() && (*back)->op == FdOp::kError);
        break;
      }
      if (!m->has_value()) break;
      FdMessage request = std::move(**m);
      const FdOp op = request.op;
      const size_t nfds = request.fds.size();
      if (op == FdOp::kPickup && real_offer && request.fds.empty()) {
        std::vector<UniqueFd> offered;
        offered.emplace_back(::open("/dev/null", O_RDONLY | O_CLOEXEC));
        absl::StatusOr<std::string> t =
            broker.Offer(client.uid, std::move(offered), absl::Seconds(30));
        if (t.ok()) request.body = *t;
      }
      FdReply reply = AnswerFdRequest(broker, client, std::move(request), absl::Seconds(30));
      CheckReply(reply, op, nfds, broker, client.uid);
      Check(broker.charged() <= caps.max_fds);
      if (reply.close_after) break;
    }
  }
  Check(OpenFds() == fds_before);
  return 0;
}
