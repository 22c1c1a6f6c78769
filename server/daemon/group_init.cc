// The group's initialization: peers, the config decision and its vote, the engine.
#include "absl/strings/str_cat.h"
#include "server/daemon/sidecar.h"
#include "server/engine/engine.h"
#include "server/peers/exchange.h"
#include "spdlog/spdlog.h"

namespace arfuse {

void Sidecar::InitializeGroup() {
  // Filled in as the peer channel and engines land.
  SetReadiness(options_.world_size == 1);
}

}  // namespace arfuse
