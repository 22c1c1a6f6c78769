// libFuzzer: bytes arriving on the peer channel (server/peers/wire.h; the coordinator reads
// them from any process that can reach the peer socket, or from the network across nodes) ->
// TakeFrame -> the frame bodies (JoinBody + JoinRequest, CollectiveRequest/Response,
// LeaveRequest, error records, heartbeats). Oracles besides ASan/UBSan: frames re-encode to the
// same frame; a join body re-encodes to the same group and request.
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>

#include "arfuse/v1/peer.pb.h"
#include "server/peers/wire.h"

namespace {

using namespace arfuse;
using namespace arfuse::peers;

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

void Body(const Frame& f) {
  switch (f.type) {
    case FrameType::kJoin: {
      std::string group, join;
      if (DecodeJoinBody(f.body, &group, &join).ok()) {
        v1::JoinRequest req;
        (void)req.ParseFromString(join);
        std::string group2, join2;
        Check(DecodeJoinBody(EncodeJoinBody(group, join), &group2, &join2).ok());
        Check(group2 == group && join2 == join);
      }
      break;
    }
    case FrameType::kJoinOk: {
      v1::JoinResponse resp;
      (void)resp.ParseFromString(f.body);
      break;
    }
    case FrameType::kCollective:
    case FrameType::kCollectiveFd: {
      v1::CollectiveRequest req;
      (void)req.ParseFromString(f.body);
      break;
    }
    case FrameType::kCollectiveOk: {
      v1::CollectiveResponse resp;
      (void)resp.ParseFromString(f.body);
      break;
    }
    case FrameType::kError:
      (void)DecodeError(f.body);
      break;
    case FrameType::kLeave: {
      v1::LeaveRequest req;
      (void)req.ParseFromString(f.body);
      break;
    }
    case FrameType::kHeartbeat:
      break;  // no body to decode
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string buf(reinterpret_cast<const char*>(data), size);
  std::deque<UniqueFd> fds;  // no descriptors: frames announcing some must be refused
  for (int i = 0; i < 16; ++i) {
    absl::StatusOr<std::optional<Frame>> f = TakeFrame(buf, fds);
    if (!f.ok() || !f->has_value()) break;
    const Frame& frame = **f;
    Body(frame);
    // Re-encoding gives back the same frame.
    std::string again = EncodeFrame(frame.type, frame.seq, frame.timeout_ms, frame.body);
    std::deque<UniqueFd> none;
    absl::StatusOr<std::optional<Frame>> g = TakeFrame(again, none);
    Check(g.ok() && g->has_value());
    Check((*g)->type == frame.type && (*g)->seq == frame.seq &&
          (*g)->timeout_ms == frame.timeout_ms && (*g)->body == frame.body && again.empty());
  }
  return 0;
}
