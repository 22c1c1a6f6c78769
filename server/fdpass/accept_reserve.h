// A descriptor kept in reserve for accept loops. A listening socket whose process is out of
// descriptors (EMFILE/ENFILE) stays readable while accept() keeps failing, so a loop that polls
// it spins at 100% of a core and the clients wait in the backlog. Shed() gives the spare back,
// accepts the pending connection and closes it at once (its client sees the connection close),
// then takes the spare again; the loop should also pause before the next accept (ShedPause()).
// A listener whose connections are cheap to serve and must be answered even then (the health
// port) serves the connection instead: AcceptWithSpare(), and Replenish() once one is free.
#pragma once

#include "absl/time/time.h"
#include "common/fd/unique_fd.h"

namespace arfuse {

class AcceptReserve {
 public:
  AcceptReserve();
  // After accept() on `listen_fd` failed with EMFILE or ENFILE: whether a pending connection was
  // accepted and closed.
  bool Shed(int listen_fd);
  // After accept() on `listen_fd` failed with EMFILE or ENFILE: gives the spare back and accepts
  // the pending connection (non-blocking, close-on-exec) into its place, for the caller to serve.
  // Invalid when there was no spare or nothing was pending. The spare is taken again at once if
  // a descriptor is free, else by a later Replenish().
  UniqueFd AcceptWithSpare(int listen_fd);
  // Takes the spare again if it was given away; whether it is held now.
  bool Replenish();
  bool held() const { return spare_.valid(); }
  // How long to leave the listener alone after a shed (short: the backlog shrank) or a failed one
  // (longer: the descriptors are not back yet).
  static absl::Duration ShedPause(bool shed) {
    return shed ? absl::Milliseconds(10) : absl::Milliseconds(200);
  }

 private:
  UniqueFd spare_;
};

}  // namespace arfuse
