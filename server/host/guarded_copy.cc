#include "server/host/guarded_copy.h"

#include <setjmp.h>
#include <signal.h>

#include <atomic>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace arfuse {
namespace {

// The copy in progress on this thread, if any. Plain pointer in static TLS: reading it in the
// signal handler allocates nothing.
thread_local sigjmp_buf* t_guard = nullptr;
struct sigaction g_previous {};

void OnSigbus(int sig, siginfo_t* info, void* /*context*/) {
  if (sigjmp_buf* jump = t_guard) {
    t_guard = nullptr;
    siglongjmp(*jump, 1);
  }
  // Not a guarded copy: put the previous disposition back. Returning re-runs the faulting access,
  // which now reaches it; a SIGBUS sent by kill() is raised again instead.
  sigaction(SIGBUS, &g_previous, nullptr);
  if (info == nullptr || info->si_code <= 0) raise(sig);
}

void InstallHandler() {
  struct sigaction sa {};
  sa.sa_sigaction = OnSigbus;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGBUS, &sa, &g_previous);
}

}  // namespace

absl::Status GuardedCopy(void* dst, const void* src, size_t n, absl::string_view what) {
  static std::once_flag once;
  std::call_once(once, InstallHandler);
  sigjmp_buf jump;
  // savemask 1: the jump out of the handler restores the signal mask, so SIGBUS is not left
  // blocked on this thread.
  if (sigsetjmp(jump, 1) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        what,
        ": the client's memory faulted (SIGBUS): its shared-memory object shrank under "
        "the op; the op did not complete on this rank. Unregister the region (a memfd "
        "sealed with F_SEAL_SHRINK, registered as host_fd, cannot shrink)"));
  }
  t_guard = &jump;
  // The marker is set before the first access and cleared after the last, as the handler on this
  // thread sees them.
  std::atomic_signal_fence(std::memory_order_seq_cst);
  std::memcpy(dst, src, n);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  t_guard = nullptr;
  return absl::OkStatus();
}

}  // namespace arfuse
