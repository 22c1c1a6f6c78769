#include "server/cuda_engine/engine_planes.h"

namespace arfuse {

EnginePlanes::EnginePlanes(int rank, absl::Duration spin_timeout)
    : doorbell_(rank, spin_timeout), hooks_{&doorbell_} {}

absl::Status EnginePlanes::BeforeOp(absl::Time deadline) {
  for (size_t i = 0; i < hooks_.size(); ++i) {
    absl::Status ready = hooks_[i]->BeforeOp(deadline);
    if (!ready.ok()) {
      while (i-- > 0) hooks_[i]->AfterOp();
      return ready;
    }
  }
  return absl::OkStatus();
}

void EnginePlanes::AfterOp() {
  for (PlaneHooks* hooks : hooks_) hooks->AfterOp();
}

void EnginePlanes::BeforeReinitialize(absl::Time deadline) {
  for (PlaneHooks* hooks : hooks_) hooks->BeforeReinitialize(deadline);
}

void EnginePlanes::Reinitialized(absl::Time deadline) {
  for (PlaneHooks* hooks : hooks_) hooks->Reinitialized(deadline);
}

void EnginePlanes::WorkspaceDropped(const char* why) {
  for (PlaneHooks* hooks : hooks_) hooks->WorkspaceDropped(why);
}

void EnginePlanes::EngineClosing() {
  for (PlaneHooks* hooks : hooks_) hooks->EngineClosing();
}

void EnginePlanes::DeviceWedged() {
  for (PlaneHooks* hooks : hooks_) hooks->DeviceWedged();
}

}  // namespace arfuse
