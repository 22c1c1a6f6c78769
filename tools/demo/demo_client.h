// arfuse-demo's client process (this binary again, with --client_rank): it connects to its rank's
// sidecar, runs every shape on the planes --planes selects (in-stream, eager and, with
// --device=cuda, doorbell), checks every output against the CPU reference and writes
// <work dir>/result.<rank>.
#pragma once

namespace arfuse::demo {

// The process's exit code: 0 when every shape ran and matched the reference.
int ClientMain(int rank);

}  // namespace arfuse::demo
