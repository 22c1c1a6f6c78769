"""arfuse: client of the arfused sidecar (fused allreduce + residual add + RMSNorm).

    from arfuse import Client, FusionWorkspace, HostShmBuffer, allreduce_fusion
"""
from .client import (API_VERSION, ArfuseError, Client, OpSpec, Plan, Region, TensorLoc,
                     common_pb2, fusion_pb2, fusion_pb2_grpc)
from .fusion import AllReduceFusionPattern, FusionWorkspace, allreduce_fusion
from .regions import CudaBuffer, HostShmBuffer, IpcEvent, TensorView

__all__ = ["API_VERSION", "ArfuseError", "AllReduceFusionPattern", "Client", "CudaBuffer",
           "FusionWorkspace", "HostShmBuffer", "IpcEvent", "OpSpec", "Plan", "Region",
           "TensorLoc", "TensorView", "allreduce_fusion", "common_pb2", "fusion_pb2", "fusion_pb2_grpc"]
