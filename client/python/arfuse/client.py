"""gRPC client of one arfused sidecar (the Fusion service).

A Client opens a Session stream and keeps it open: the sidecar releases the session's regions
and plans when the stream ends (close(), garbage collection, or the process dying). Every call
carries the API version and the session id in metadata, and a deadline.
"""
import dataclasses
import queue
import threading
from typing import Optional

import grpc

from . import _proto

common_pb2, fusion_pb2, fusion_pb2_grpc = _proto.load()

API_VERSION = "1.0"
API_VERSION_KEY = "arfuse-api-version"
SESSION_KEY = "arfuse-session"

# Plain names for the proto enums.
DTYPES = {"bf16": common_pb2.DTYPE_BF16, "fp16": common_pb2.DTYPE_FP16,
          "fp32": common_pb2.DTYPE_FP32}
DTYPE_BYTES = {common_pb2.DTYPE_BF16: 2, common_pb2.DTYPE_FP16: 2, common_pb2.DTYPE_FP32: 4}
PATTERNS = {"allreduce": common_pb2.PATTERN_ALLREDUCE,
            "allreduce_residual_rmsnorm": common_pb2.PATTERN_ALLREDUCE_RESIDUAL_RMSNORM}


class ArfuseError(Exception):
    """A call the sidecar refused or that failed; `code` is a grpc.StatusCode."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def grpc_target(target: str) -> str:
    """'unix:/p', '/p' or 'host:port' to a gRPC target."""
    if target.startswith(("unix:", "unix-abstract:")):
        return target
    if target.startswith(("/", ".")):
        return "unix:" + target
    return target


@dataclasses.dataclass(frozen=True)
class Region:
    id: int
    generation: int
    name: str
    byte_size: int


@dataclasses.dataclass(frozen=True)
class TensorLoc:
    region: Region
    offset: int = 0


@dataclasses.dataclass(frozen=True)
class Plan:
    id: int
    generation: int
    path: int
    reason: str


@dataclasses.dataclass
class OpSpec:
    pattern: str = "allreduce_residual_rmsnorm"
    dtype: str = "bf16"
    hidden: int = 0
    max_tokens: int = 0
    eps: Optional[float] = None
    input: Optional[TensorLoc] = None
    output: Optional[TensorLoc] = None
    residual_in: Optional[TensorLoc] = None
    residual_out: Optional[TensorLoc] = None
    norm_out: Optional[TensorLoc] = None
    gamma: Optional[TensorLoc] = None

    def to_proto(self):
        op = fusion_pb2.OpSpec(
            pattern=PATTERNS[self.pattern] if isinstance(self.pattern, str) else self.pattern,
            dtype=DTYPES[self.dtype] if isinstance(self.dtype, str) else self.dtype,
            hidden=self.hidden, max_tokens=self.max_tokens)
        if self.eps is not None:
            op.eps = self.eps
        for field in ("input", "output", "residual_in", "residual_out", "norm_out", "gamma"):
            loc = getattr(self, field)
            if loc is not None:
                getattr(op, field).CopyFrom(fusion_pb2.RegionRef(
                    region_id=loc.region.id, generation=loc.region.generation,
                    offset=loc.offset))
        return op


class Client:
    """One sidecar, one session. Use as a context manager or call close()."""

    def __init__(self, target: str, client_name: str = "arfuse-py", timeout: float = 10.0,
                 connect_timeout: float = 10.0):
        self.target = target
        self.timeout = timeout
        self._channel = grpc.insecure_channel(grpc_target(target), options=[
            ("grpc.keepalive_time_ms", 10000),
            ("grpc.keepalive_permit_without_calls", 1)])
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise ArfuseError(grpc.StatusCode.UNAVAILABLE,
                              f"no arfused answers at {target} within {connect_timeout} s")
        self.stub = fusion_pb2_grpc.FusionStub(self._channel)
        # The request stream: the hello, then nothing until close() ends it.
        self._outbox: "queue.Queue" = queue.Queue()
        self._outbox.put(fusion_pb2.SessionRequest(client_name=client_name))

        def requests():
            while True:
                item = self._outbox.get()
                if item is None:
                    return
                yield item

        self._session_call = self.stub.Session(
            requests(), metadata=[(API_VERSION_KEY, API_VERSION)])
        first = {}

        def read_first():
            try:
                first["resp"] = next(self._session_call)
            except grpc.RpcError as e:
                first["error"] = e
            except StopIteration:
                first["error"] = None

        reader = threading.Thread(target=read_first, daemon=True)
        reader.start()
        reader.join(connect_timeout)
        if "resp" not in first:
            self._session_call.cancel()
            self._channel.close()
            err = first.get("error")
            if isinstance(err, grpc.RpcError):
                raise ArfuseError(err.code(), err.details())
            raise ArfuseError(grpc.StatusCode.UNAVAILABLE, "the sidecar did not open a session")
        resp = first["resp"]
        self.session_id = resp.session_id
        self.device = resp.device
        self.rank = resp.rank
        self.world_size = resp.world_size
        self.server_api = (resp.server_api.major, resp.server_api.minor)
        self._closed = False

    # -- lifecycle --
    def close(self):
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._outbox.put(None)
        self._session_call.cancel()
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- plumbing --
    def _call(self, method, request, timeout: Optional[float] = None):
        md = [(API_VERSION_KEY, API_VERSION), (SESSION_KEY, str(self.session_id))]
        try:
            return method(request, metadata=md, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise ArfuseError(e.code(), e.details()) from None

    # -- regions --
    def register_host_shm(self, name: str, shm_name: str, byte_size: int) -> Region:
        if not shm_name.startswith("/"):
            shm_name = "/" + shm_name  # multiprocessing.shared_memory names lack the slash
        req = fusion_pb2.RegisterRegionRequest(
            name=name, byte_size=byte_size, host_shm=fusion_pb2.HostSharedMemory(shm_name=shm_name))
        resp = self._call(self.stub.RegisterRegion, req)
        return Region(resp.region_id, resp.generation, name, byte_size)

    def register_cuda_ipc(self, name: str, handle: bytes, device_id: int,
                          byte_size: int) -> Region:
        req = fusion_pb2.RegisterRegionRequest(
            name=name, byte_size=byte_size,
            cuda_ipc=fusion_pb2.CudaIpcMemory(handle=bytes(handle), device_id=device_id))
        resp = self._call(self.stub.RegisterRegion, req)
        return Region(resp.region_id, resp.generation, name, byte_size)

    def unregister(self, region: Region, timeout: Optional[float] = None) -> None:
        self._call(self.stub.UnregisterRegion, fusion_pb2.UnregisterRegionRequest(
            region_id=region.id, generation=region.generation), timeout)

    def list_regions(self):
        return list(self._call(self.stub.ListRegions, fusion_pb2.ListRegionsRequest()).regions)

    # -- plans and ops --
    def create_plan(self, op: OpSpec, doorbell: bool = False) -> Plan:
        resp = self._call(self.stub.CreatePlan,
                          fusion_pb2.CreatePlanRequest(op=op.to_proto(), doorbell=doorbell))
        return Plan(resp.plan_id, resp.generation, resp.path, resp.reason)

    def destroy_plan(self, plan: Plan) -> None:
        self._call(self.stub.DestroyPlan, fusion_pb2.DestroyPlanRequest(
            plan_id=plan.id, generation=plan.generation))

    def execute(self, plan: Plan, num_tokens: int, wait_event: bytes = b"",
                synchronous: bool = False, workspace_generation: int = 0,
                timeout: Optional[float] = None):
        req = fusion_pb2.ExecuteRequest(plan_id=plan.id, plan_generation=plan.generation,
                                        num_tokens=num_tokens, wait_event=wait_event,
                                        synchronous=synchronous,
                                        workspace_generation=workspace_generation)
        return self._call(self.stub.Execute, req, timeout)

    def execute_op(self, op: OpSpec, num_tokens: int, wait_event: bytes = b"",
                   synchronous: bool = False, timeout: Optional[float] = None):
        req = fusion_pb2.ExecuteRequest(op=op.to_proto(), num_tokens=num_tokens,
                                        wait_event=wait_event, synchronous=synchronous)
        return self._call(self.stub.Execute, req, timeout)

    def workspace_info(self):
        return self._call(self.stub.GetWorkspaceInfo, fusion_pb2.GetWorkspaceInfoRequest())
