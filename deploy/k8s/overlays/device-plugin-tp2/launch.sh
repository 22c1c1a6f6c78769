#!/bin/bash
# The model server's entrypoint on clusters with NVIDIA's device plugin (nvidia.com/gpu), where a
# GPU belongs to one container only, so the sidecars run inside the model server's container:
#
#   /bin/bash /opt/arfuse/launch.sh <model server command...>
#
# 1. the MPS control daemon, when the image has it (the ranks share their GPUs' contexts);
# 2. one arfused per rank (ARFUSE_WORLD_SIZE of them; every other flag from ARFUSE_* variables):
#    rank r on GPU r, its health port 9310+r, its metrics port 9330+r, its socket arfused's default
#    (/run/arfuse/arfused.sock, .rank<r>);
# 3. the model server, once the whole group is ready (as the DRA layout's last sidecar gates it:
#    a framework that asked earlier would settle on the unfused path for its whole life);
# 4. then waits: the first of them to exit ends the container with its code, so that Kubernetes
#    restarts the lot. SIGTERM stops the model server first and the sidecars after it.
set -uo pipefail

world=${ARFUSE_WORLD_SIZE:?ARFUSE_WORLD_SIZE must be set (arfuse-config)}
if command -v nvidia-cuda-mps-control >/dev/null && [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "${CUDA_MPS_LOG_DIRECTORY:-/tmp/nvidia-mps-log}"
  nvidia-cuda-mps-control -d
fi

sidecars=()
for ((r = 0; r < world; r++)); do
  arfused --rank="$r" --gpu="$r" --health-port=$((9310 + r)) --metrics-port=$((9330 + r)) &
  sidecars+=($!)
done

stop() {
  [ -n "${server:-}" ] && kill -TERM "$server" 2>/dev/null && wait "$server"
  kill -TERM "${sidecars[@]}" 2>/dev/null
  wait "${sidecars[@]}" 2>/dev/null
}
trap 'stop; exit 143' TERM INT

until arfusectl health --all --service arfuse.v1.Fusion --timeout-ms 2000 >/dev/null 2>&1; do
  for pid in "${sidecars[@]}"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "launch.sh: an arfused exited before the group was ready" >&2
      stop
      exit 1
    fi
  done
  sleep 1
done
echo "launch.sh: the group of $world ranks is ready; starting: $*"

"$@" &
server=$!
wait -n "$server" "${sidecars[@]}"
code=$?
echo "launch.sh: a process of the group exited with $code; stopping the rest" >&2
stop
exit "$code"
