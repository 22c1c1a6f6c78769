// arfuse-bench sidecar: a client process (this binary again, with --client_rank): it connects to
// its rank's sidecar, runs every row of every shape (the eager plane against a gRPC echo, the
// in-process op, and with CUDA the doorbell, in-stream and layer-loop rows) and writes its figures
// to <dir>/result.<rank> (bench/sidecar_rows.h).
#pragma once

#include "bench/sidecar_flags.h"

namespace arfuse::bench::sidecar {

// The process's exit code: 0 when every shape ran.
int ClientMain(const SidecarFlags& f);

}  // namespace arfuse::bench::sidecar
