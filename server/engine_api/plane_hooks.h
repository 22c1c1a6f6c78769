// What a data plane's engine side does at the engine's lifecycle points (docs/contributing.md, "A
// plane hook"). An engine holds its planes behind one member that runs every plane's hooks
// (CudaEngine: EnginePlanes, server/cuda_engine/engine_planes.h), so the eager op and the rest of
// the engine name no plane. The doorbell plane's engine side implements it (EngineDoorbell,
// server/doorbell/engine_doorbell.h). The engine calls the hooks under the lock that serializes
// its ops, so an implementation needs no lock of its own for them. CUDA-free: only interfaces.
#pragma once

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace arfuse {

class PlaneHooks {
 public:
  virtual ~PlaneHooks() = default;

  // Before an eager op is enqueued on the engine's stream: work of the plane queued ahead on that
  // stream, which would hold the op back, steps aside. An error means the op must not run
  // (nothing was launched; the plane serves on). After OK, AfterOp follows once the op is
  // enqueued, or failed to be (AfterOpScope).
  virtual absl::Status BeforeOp(absl::Time deadline) = 0;
  // The eager op is enqueued: the plane's work queues again behind it.
  virtual void AfterOp() = 0;

  // Before the workspace is re-initialized: nothing of the plane touches it meanwhile. A slow
  // step is logged, not returned: the re-initialization aborts the workspace, which ends any op
  // of the plane that waits for a peer.
  virtual void BeforeReinitialize(absl::Time deadline) = 0;
  // After the re-initialization (in place, rebuilt or dropped): the plane serves again over the
  // workspace that is there, or lets go of what cannot serve.
  virtual void Reinitialized(absl::Time deadline) = 0;

  // The workspace (already aborted) is about to be rebuilt or freed: the plane lets go of it, and
  // what it served over it is gone.
  virtual void WorkspaceDropped(const char* why) = 0;

  // The engine goes away in order: the plane stops (bounded).
  virtual void EngineClosing() = 0;
  // The engine's device holds work that can never finish: the plane is left as it is and never
  // freed (freeing would wait for that work; the process exits to be restarted).
  virtual void DeviceWedged() = 0;
};

// Runs AfterOp once, when told (Now) or at scope exit, after Arm: the eager op arms it right
// after a BeforeOp that succeeded.
class AfterOpScope {
 public:
  AfterOpScope() = default;
  AfterOpScope(const AfterOpScope&) = delete;
  AfterOpScope& operator=(const AfterOpScope&) = delete;
  ~AfterOpScope() { Now(); }

  void Arm(PlaneHooks* hooks) { hooks_ = hooks; }
  void Now() {
    PlaneHooks* hooks = hooks_;
    hooks_ = nullptr;
    if (hooks != nullptr) hooks->AfterOp();
  }

 private:
  PlaneHooks* hooks_ = nullptr;
};

}  // namespace arfuse
