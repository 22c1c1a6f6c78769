"""arfuse: client of the arfused sidecar (fused allreduce + residual add + RMSNorm).

    from arfuse import Client, FusionWorkspace, HostShmBuffer, allreduce_fusion

Imported with the package: arfuse.instream (the in-stream plane: libarfuse_client through ctypes,
loaded at the first attach; Client.attach() returns its context). Imported on demand: arfuse.torch (the in-stream plane as torch ops),
arfuse.integrations.sglang (in SGLang's place for FlashInfer's fused op), arfuse.ring (ring a
doorbell plan inside CUDA graph capture) and arfuse.pool (static tensors carved out of one
registered buffer). docs/integration.md walks through them.
"""
try:
    from ._version import __version__  # written into the wheel from the repository's VERSION
except ImportError:  # a checkout used in place
    import pathlib as _pathlib

    __version__ = (_pathlib.Path(__file__).resolve().parents[3] / "VERSION").read_text().strip()

from .client import (API_VERSION, ArfuseError, Client, Negotiation, OpSpec, Plan, Region,
                     SidecarLost, TensorLoc, common_pb2, config_pb2, fusion_pb2, fusion_pb2_grpc)
from .fusion import (AllReduceFusionPattern, FusionUnavailableWarning, FusionWorkspace,
                     allreduce_fusion)
from .regions import CudaBuffer, HostShmBuffer, IpcEvent, TensorView
from . import instream  # noqa: F401,E402  (registers Client.attach; loads no library yet)

__all__ = ["__version__", "API_VERSION", "ArfuseError", "AllReduceFusionPattern", "Client", "CudaBuffer",
           "FusionUnavailableWarning", "FusionWorkspace", "HostShmBuffer", "IpcEvent", "Negotiation", "OpSpec", "Plan",
           "Region", "SidecarLost", "TensorLoc", "TensorView", "allreduce_fusion", "common_pb2",
           "config_pb2", "fusion_pb2", "fusion_pb2_grpc"]
