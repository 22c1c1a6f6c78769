// The data planes a CudaEngine holds, behind one member: every plane's lifecycle hooks
// (server/engine_api/plane_hooks.h) run from here, in the order the planes are listed, so the
// engine says when (an eager op, a re-initialization, a dropped workspace, its own end) and names
// no plane. What is one plane's own (the doorbell plans: DoorbellHost) reaches that plane through
// its accessor. The in-stream plane's engine side has no hook: its clients run their ops in
// their own processes, and the engine's in-stream calls are InStreamHost's
// (server/engine_api/instream_host.h). A new plane's hooks are one more entry of hooks_.
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/doorbell/engine_doorbell.h"
#include "server/engine_api/plane_hooks.h"

namespace arfuse {

class EnginePlanes final : public PlaneHooks {
 public:
  // `rank` names the engine in logs; `spin_timeout` bounds how long a plane's pause waits.
  EnginePlanes(int rank, absl::Duration spin_timeout);
  EnginePlanes(const EnginePlanes&) = delete;
  EnginePlanes& operator=(const EnginePlanes&) = delete;

  // PlaneHooks, over every plane. BeforeOp stops at the first plane that refuses, after running
  // AfterOp on those it already asked, so an op refused by one plane leaves every plane serving.
  absl::Status BeforeOp(absl::Time deadline) override;
  void AfterOp() override;
  void BeforeReinitialize(absl::Time deadline) override;
  void Reinitialized(absl::Time deadline) override;
  void WorkspaceDropped(const char* why) override;
  void EngineClosing() override;
  void DeviceWedged() override;

  // The doorbell plane's engine side (its plans: DoorbellHost).
  EngineDoorbell& doorbell() { return doorbell_; }
  const EngineDoorbell& doorbell() const { return doorbell_; }

 private:
  EngineDoorbell doorbell_;
  // Every plane's hooks, in the order they run.
  const std::vector<PlaneHooks*> hooks_;
};

}  // namespace arfuse
