"""arfuse: client of the arfused sidecar (fused allreduce + residual add + RMSNorm).

    from arfuse import Client, FusionWorkspace, HostShmBuffer, allreduce_fusion

arfuse.ring (ring a doorbell plan inside CUDA graph capture) and arfuse.pool (static tensors
carved out of one registered buffer) are imported on demand.
"""
from .client import (API_VERSION, ArfuseError, Client, Negotiation, OpSpec, Plan, Region,
                     SidecarLost, TensorLoc, common_pb2, config_pb2, fusion_pb2, fusion_pb2_grpc)
from .fusion import (AllReduceFusionPattern, FusionUnavailableWarning, FusionWorkspace,
                     allreduce_fusion)
from .regions import CudaBuffer, HostShmBuffer, IpcEvent, TensorView

__all__ = ["API_VERSION", "ArfuseError", "AllReduceFusionPattern", "Client", "CudaBuffer",
           "FusionUnavailableWarning", "FusionWorkspace", "HostShmBuffer", "IpcEvent", "Negotiation", "OpSpec", "Plan",
           "Region", "SidecarLost", "TensorLoc", "TensorView", "allreduce_fusion", "common_pb2",
           "config_pb2", "fusion_pb2", "fusion_pb2_grpc"]
