// In-process Exchange for tests of other layers: one Exchange per rank, used from one thread per
// rank, backed by the same Coordinator logic as the sockets (same matching, deadlines and
// failure messages). Destroying a rank's Exchange is that rank going away: the group breaks and
// pending and later collectives on the other ranks fail with UNAVAILABLE naming it.
#pragma once

#include <memory>
#include <vector>

#include "server/peers/exchange.h"

namespace arfuse {

class LocalExchangeGroup {
 public:
  // Returns world_size exchanges, index = rank, already joined. Descriptors are passed by dup().
  static std::vector<std::unique_ptr<Exchange>> Create(int world_size, int nnodes = 1);
};

}  // namespace arfuse
