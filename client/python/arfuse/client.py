"""gRPC client of one arfused sidecar (the Fusion and Config services).

A Client opens a Session stream and keeps it open: the sidecar releases the session's regions
and plans when the stream ends (close(), garbage collection, or the process dying). Every call
carries the API version and the session token in metadata, and a deadline.

The session stream also tells the client when its sidecar is gone: a sidecar that dies (or is
killed) ends the stream at once, and `session_lost` then says why. allreduce_fusion raises
SidecarLost in that case instead of reporting "fusion unavailable".

Whatever else the sidecar says on the stream (the in-stream plane's attachment events: drain,
re-initialization, poisoning) goes to the session's listeners (add_session_listener): each hears
every event the stream delivers, then the stream's end. Their answers go back on the request
stream (send_session_request). arfuse.instream keeps its attachments in such a listener.
"""
import dataclasses
import queue
import threading
import time
from typing import Optional, Sequence

import grpc

from . import _proto, fdpass

common_pb2, fusion_pb2, fusion_pb2_grpc = _proto.load()
config_pb2, config_pb2_grpc = _proto.load_config()

API_VERSION = "1.1"
API_VERSION_KEY = "arfuse-api-version"
SESSION_KEY = "arfuse-session"

# Plain names for the proto enums.
DTYPES = {"bf16": common_pb2.DTYPE_BF16, "fp16": common_pb2.DTYPE_FP16,
          "fp32": common_pb2.DTYPE_FP32}
DTYPE_BYTES = {common_pb2.DTYPE_BF16: 2, common_pb2.DTYPE_FP16: 2, common_pb2.DTYPE_FP32: 4}
PATTERNS = {"allreduce": common_pb2.PATTERN_ALLREDUCE,
            "allreduce_residual_rmsnorm": common_pb2.PATTERN_ALLREDUCE_RESIDUAL_RMSNORM,
            "allreduce_residual_rmsnorm_fp8_static":
                common_pb2.PATTERN_ALLREDUCE_RESIDUAL_RMSNORM_FP8_STATIC,
            "allreduce_residual_rmsnorm_fp8_per_token":
                common_pb2.PATTERN_ALLREDUCE_RESIDUAL_RMSNORM_FP8_PER_TOKEN,
            "allreduce_residual_rmsnorm_fp8_per_group":
                common_pb2.PATTERN_ALLREDUCE_RESIDUAL_RMSNORM_FP8_PER_GROUP}
# The per-group FP8 pattern's scale layouts (kernels/quant/fp8_format.h's GroupScaleLayout).
SCALE_LAYOUTS = {"fp32_row_major": common_pb2.SCALE_LAYOUT_FP32_ROW_MAJOR,
                 "fp32_mn_major": common_pb2.SCALE_LAYOUT_FP32_MN_MAJOR,
                 "ue8m0_packed": common_pb2.SCALE_LAYOUT_UE8M0_PACKED}
GRAPH_MODES = {"none": common_pb2.CUDA_GRAPH_MODE_NONE,
               "piecewise": common_pb2.CUDA_GRAPH_MODE_PIECEWISE,
               "full": common_pb2.CUDA_GRAPH_MODE_FULL}
GRAPH_MODE_NAMES = {v: k for k, v in GRAPH_MODES.items()}
GRAPH_MODE_NAMES[common_pb2.CUDA_GRAPH_MODE_UNSPECIFIED] = "none"
DATA_PLANE_NAMES = {common_pb2.DATA_PLANE_UNSPECIFIED: "eager",
                    common_pb2.DATA_PLANE_EAGER: "eager",
                    common_pb2.DATA_PLANE_DOORBELL: "doorbell",
                    common_pb2.DATA_PLANE_INSTREAM: "instream"}
DEVICE_NAMES = {common_pb2.DEVICE_KIND_UNSPECIFIED: "unknown",
                common_pb2.DEVICE_KIND_CUDA: "cuda", common_pb2.DEVICE_KIND_HOST: "host"}


# Client.attach's implementation (arfuse.instream.attach), registered by that module when it is
# imported (register_attach), so that this module imports nothing of the in-stream plane.
_ATTACH = None


def register_attach(fn):
    """Client.attach's implementation (arfuse.instream registers its attach())."""
    global _ATTACH
    _ATTACH = fn


class ArfuseError(Exception):
    """A call the sidecar refused or that failed; `code` is a grpc.StatusCode."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class SidecarLost(ArfuseError):
    """The sidecar is gone (its session stream ended: killed, crashed, restarted, or shut down).

    Not "fusion unavailable": the session's regions and plans are released, and the group's
    other ranks are about to fail their fused ops. Stop (or reconnect and re-register)."""

    def __init__(self, target: str, reason: str):
        super().__init__(grpc.StatusCode.UNAVAILABLE,
                         f"the arfused sidecar at {target} is gone ({reason}); its session, "
                         "regions and plans are released")
        self.target = target
        self.reason = reason


# The most metadata one call may carry (arfused's kMaxMetadataBytes). Past it gRPC 1.51 ends the
# whole connection, not only the call.
MAX_METADATA_BYTES = 64 << 10
METADATA_CLOSED_CONNECTION = (
    f"a call carried more metadata than the sidecar's limit of {MAX_METADATA_BYTES // 1024} KiB, "
    "and the sidecar's gRPC closes the whole connection then: this client's session, regions "
    "and plans were released with it; open a new Client and register again")


def _closed_for_metadata(code, details: str) -> bool:
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and "metadata size exceeds limit" in (
        details or "")


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
    # arfuse.v1.Doorbell (ipc_handle, offset, values) when made with doorbell=True: open it with
    # arfuse.ring.DoorbellRing.open(plan.doorbell) and ring it inside CUDA graph capture.
    doorbell: Optional[object] = None


@dataclasses.dataclass(frozen=True)
class Negotiation:
    """Config.Negotiate's answer: how the fused op may sit in this client's CUDA graphs.

    Decided alike on every rank of the group (after the rank vote)."""
    backend: str               # "trtllm", "mnnvl" or "none"
    fusion_enabled: bool
    cuda_graph_mode: str       # the mode the client may use: "none", "piecewise", "full"
    data_plane: str            # "instream" (the sidecar's kernel launched in the client's stream
                               # after attach), "doorbell" (ring kernel in graphs) or "eager"
                               # (Execute per op)
    warnings: tuple
    reasons: tuple
    device: str                # "cuda" or "host"
    rank: int
    world_size: int
    mps_detected: bool
    doorbell_hop_us: float

    @classmethod
    def from_proto(cls, resp) -> "Negotiation":
        d = resp.decision
        return cls(backend=d.backend, fusion_enabled=bool(d.fusion_enabled),
                   cuda_graph_mode=GRAPH_MODE_NAMES.get(d.cuda_graph_mode, "none"),
                   data_plane=DATA_PLANE_NAMES.get(d.data_plane, "eager"),
                   warnings=tuple(d.warnings), reasons=tuple(d.reasons),
                   device=DEVICE_NAMES.get(resp.device, "unknown"), rank=resp.rank,
                   world_size=resp.world_size, mps_detected=bool(resp.mps_detected),
                   doorbell_hop_us=float(resp.doorbell_hop_us))

    def summary(self) -> str:
        s = (f"backend={self.backend} fusion={'on' if self.fusion_enabled else 'off'} "
             f"cuda_graph_mode={self.cuda_graph_mode} data_plane={self.data_plane} "
             f"device={self.device}")
        if self.device == "cuda":
            s += f" mps={'yes' if self.mps_detected else 'no'}"
            if self.doorbell_hop_us:
                s += f" doorbell_hop={self.doorbell_hop_us:.1f}us"
        return s


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
    # The FP8 patterns': the E4M3 codes and the scale (static: read; otherwise written), and the
    # per-group pattern's scale layout (a SCALE_LAYOUTS name or number).
    quant_out: Optional[TensorLoc] = None
    scale: Optional[TensorLoc] = None
    scale_layout: Optional[object] = None

    def to_proto(self):
        op = fusion_pb2.OpSpec(
            pattern=PATTERNS[self.pattern] if isinstance(self.pattern, str) else self.pattern,
            dtype=DTYPES[self.dtype] if isinstance(self.dtype, str) else self.dtype,
            hidden=self.hidden, max_tokens=self.max_tokens)
        if self.eps is not None:
            op.eps = self.eps
        if self.scale_layout is not None:
            op.scale_layout = SCALE_LAYOUTS[self.scale_layout] \
                if isinstance(self.scale_layout, str) else int(self.scale_layout)
        for field in ("input", "output", "residual_in", "residual_out", "norm_out", "gamma",
                      "quant_out", "scale"):
            loc = getattr(self, field)
            if loc is not None:
                getattr(op, field).CopyFrom(fusion_pb2.RegionRef(
                    region_id=loc.region.id, generation=loc.region.generation,
                    offset=loc.offset))
        return op


class Client:
    """One sidecar, one session. Use as a context manager or call close()."""

    def __init__(self, target: str, client_name: str = "arfuse-py", timeout: float = 10.0,
                 connect_timeout: float = 10.0, keepalive_time: float = 10.0):
        # keepalive_time: seconds between the channel's pings while idle (1 .. 7200), so that an
        # idle session stays open and a dead sidecar is noticed; arfused accepts pings this often.
        if not 1.0 <= keepalive_time <= 7200.0:
            raise ArfuseError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"keepalive_time must be within 1..7200 s, got {keepalive_time}")
        self.target = target
        self.timeout = timeout
        self._channel = grpc.insecure_channel(grpc_target(target), options=[
            ("grpc.keepalive_time_ms", int(keepalive_time * 1000)),
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
        if not resp.session_token:
            self._session_call.cancel()
            self._channel.close()
            raise ArfuseError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the sidecar (API {resp.server_api.major}.{resp.server_api.minor}) sent no "
                f"session token; this client needs API {API_VERSION} or later: use the sidecar "
                "of this client's release")
        # 128 random bits as 32 hex characters: every call carries it, and only calls from this
        # client's user reach the session.
        self.session_token = resp.session_token
        self.device = resp.device
        self.rank = resp.rank
        self.world_size = resp.world_size
        self.server_api = (resp.server_api.major, resp.server_api.minor)
        self.config_stub = config_pb2_grpc.ConfigStub(self._channel)
        self._closed = False
        # Who hears the session stream's events and its end (add_session_listener).
        self._listeners_lock = threading.Lock()
        self._listeners: list = []
        # The stream stays open for the session's life; its end (other than by close()) means
        # the sidecar is gone.
        self._lost_reason: Optional[str] = None
        self._session_ended = threading.Event()
        threading.Thread(target=self._watch_session, daemon=True,
                         name=f"arfuse-session-{self.rank}").start()

    # -- lifecycle --
    def _watch_session(self):
        try:
            for resp in self._session_call:
                if resp.HasField("event"):
                    for listener in self.session_listeners():
                        listener.on_session_event(resp.event)
            reason = "the sidecar ended the session"
        except grpc.RpcError as e:
            reason = f"session stream ended: {e.code().name}: {e.details()}"
            if _closed_for_metadata(e.code(), e.details()):
                reason = METADATA_CLOSED_CONNECTION
        except Exception as e:  # pragma: no cover - defensive
            reason = f"session stream ended: {e!r}"
        if not self._closed:
            self._lost_reason = reason
        # Under the lock, so that a listener added meanwhile hears the end exactly once: here, or
        # in add_session_listener.
        with self._listeners_lock:
            self._session_ended.set()
            listeners = list(self._listeners)
        for listener in listeners:
            listener.on_session_end(self._lost_reason)

    # -- the session stream's listeners --
    def add_session_listener(self, listener):
        """`listener` hears the session stream from now on, on the session's thread:
        listener.on_session_event(event) for each event the stream delivers (a
        SessionResponse.event, fusion_pb2.AttachEvent), then listener.on_session_end(lost) once
        the stream ended (`lost`: session_lost, None after close()). A listener added after the
        end hears the end at once."""
        with self._listeners_lock:
            self._listeners.append(listener)
            ended = self._session_ended.is_set()
        if ended:
            listener.on_session_end(self._lost_reason)

    def remove_session_listener(self, listener):
        with self._listeners_lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def session_listeners(self) -> tuple:
        """The listeners, in the order they were added."""
        with self._listeners_lock:
            return tuple(self._listeners)

    def send_session_request(self, request) -> bool:
        """Puts a SessionRequest on the session's request stream; False (nothing sent) once the
        client is closed or the sidecar ended the session."""
        if self._closed or self._lost_reason is not None:
            return False
        self._outbox.put(request)
        return True

    @property
    def session_ended(self) -> bool:
        """True once the session stream ended (the sidecar's end or close())."""
        return self._session_ended.is_set()

    @property
    def closed(self) -> bool:
        """True once close() ran."""
        return self._closed

    def attach_rpc(self, request, timeout: Optional[float] = None):
        """Fusion.Attach (the raw AttachResponse); attach() does the rest."""
        return self._call(self.stub.Attach, request, timeout)

    def detach_rpc(self, attach_id: int, timeout: Optional[float] = None):
        return self._call(self.stub.Detach, fusion_pb2.DetachRequest(attach_id=attach_id),
                          timeout)

    def attach(self, hiddens: Optional[Sequence[int]] = None, **kwargs):
        """The in-stream plane: attaches to this sidecar's workspace for ops of these hidden
        sizes and returns an arfuse.instream.InStreamContext (its arguments: instream.attach)."""
        if _ATTACH is None:  # arfuse/__init__ imports arfuse.instream, which sets it
            raise ArfuseError(grpc.StatusCode.FAILED_PRECONDITION,
                              "arfuse.instream is not imported: import arfuse first")
        return _ATTACH(self, hiddens, **kwargs)

    def detach(self, ctx) -> None:
        ctx.detach()

    @property
    def session_lost(self) -> Optional[str]:
        """Why the session ended, when the sidecar ended it (None while it lives, or after
        close())."""
        return self._lost_reason

    def wait_session_lost(self, timeout: Optional[float] = None) -> Optional[str]:
        """Waits up to `timeout` (None: forever) for the session to end; returns session_lost."""
        self._session_ended.wait(timeout)
        return self._lost_reason

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
        md = [(API_VERSION_KEY, API_VERSION), (SESSION_KEY, self.session_token)]
        try:
            return method(request, metadata=md, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE and self._lost_reason is not None:
                raise SidecarLost(self.target, self._lost_reason) from None
            if _closed_for_metadata(e.code(), e.details()) or (
                    self._lost_reason == METADATA_CLOSED_CONNECTION):
                raise ArfuseError(e.code(), f"{e.details()}: {METADATA_CLOSED_CONNECTION}") \
                    from None
            raise ArfuseError(e.code(), e.details()) from None

    def raise_if_lost(self, grace: float = 0.0):
        """Raises SidecarLost when the session has ended (waiting up to `grace` seconds for the
        stream to report it: a failed call may race the stream's end)."""
        reason = self.wait_session_lost(grace) if grace > 0 else self._lost_reason
        if reason is not None:
            raise SidecarLost(self.target, reason)

    # -- regions --
    def fd_channel_path(self) -> str:
        """The sidecar's fd channel (its main socket's path + ".fd"); ArfuseError
        FAILED_PRECONDITION when this client does not reach the sidecar by Unix socket."""
        target = grpc_target(self.target)
        if not target.startswith("unix:") or target.startswith("unix-abstract:"):
            raise ArfuseError(grpc.StatusCode.FAILED_PRECONDITION,
                              "host memory by descriptor needs the sidecar's Unix socket, not "
                              f"{self.target}")
        path = target[len("unix:"):]
        if path.startswith("//"):
            path = path[2:]  # unix://<absolute path>
        return fdpass.channel_path(path)

    def register_host_fd(self, name: str, fd: int, byte_size: int) -> Region:
        """Registers host memory by descriptor: `fd` is a memfd sealed against shrinking
        (HostShmBuffer makes one). It goes to the sidecar over its fd channel; the ticket it
        answers names it in RegisterRegion. Only this process's user can claim the ticket."""
        try:
            ticket = fdpass.deposit(self.fd_channel_path(), [fd], timeout=self.timeout)
        except fdpass.FdChannelError as e:
            raise ArfuseError(e.code, e.message) from None
        req = fusion_pb2.RegisterRegionRequest(
            name=name, byte_size=byte_size, host_fd=fusion_pb2.HostFdMemory(fd_ticket=ticket))
        resp = self._call(self.stub.RegisterRegion, req)
        return Region(resp.region_id, resp.generation, name, byte_size)

    def register_host_shm(self, name: str, shm_name: str, byte_size: int) -> Region:
        """Registers a named POSIX shm object (compatibility; prefer register_host_fd): the
        sidecar opens it only if this process's user may open it read-write."""
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
        """Validates the op once. doorbell=True also sets up the doorbell plane for it: the plan's
        `doorbell` is then the Doorbell message (None if the sidecar answered without one). A
        sidecar that cannot serve it (host mode, an unfused shape) answers FAILED_PRECONDITION,
        one whose 32 slots are taken RESOURCE_EXHAUSTED: use the eager plane then."""
        resp = self._call(self.stub.CreatePlan,
                          fusion_pb2.CreatePlanRequest(op=op.to_proto(), doorbell=doorbell))
        bell = None
        if doorbell and resp.HasField("doorbell") and len(resp.doorbell.ipc_handle) > 0:
            bell = resp.doorbell
        return Plan(resp.plan_id, resp.generation, resp.path, resp.reason, bell)

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

    def workspace_info(self, timeout: Optional[float] = None):
        return self._call(self.stub.GetWorkspaceInfo, fusion_pb2.GetWorkspaceInfoRequest(),
                          timeout)

    # -- config --
    def negotiate(self, cuda_graph_mode: str = "full", fused_op_in_graph: Optional[bool] = None,
                  mnnvl_capture_safe: Optional[bool] = None,
                  timeout: Optional[float] = None,
                  client_loads_kernels: bool = False, call_sites: int = 0) -> Negotiation:
        """Config.Negotiate: the group's decision and how the fused op may sit in this client's
        CUDA graphs. cuda_graph_mode: "none", "piecewise" or "full" (what the client wants);
        fused_op_in_graph defaults to True unless the mode is "none"; client_loads_kernels: this
        client can attach (libarfuse_client), so the in-stream plane may be the answer;
        call_sites: how many fused-op sites the client will plan (2 per layer; 0: not said), so a
        plane that cannot serve them (the doorbell: one slot per site) is not offered.
        UNAVAILABLE (ArfuseError) while the group has not decided yet."""
        if cuda_graph_mode not in GRAPH_MODES:
            raise ValueError(f"cuda_graph_mode must be one of {sorted(GRAPH_MODES)}")
        if fused_op_in_graph is None:
            fused_op_in_graph = cuda_graph_mode != "none"
        capture = config_pb2.CaptureRequest(cuda_graph_mode=GRAPH_MODES[cuda_graph_mode],
                                            fused_op_in_graph=fused_op_in_graph)
        if mnnvl_capture_safe is not None:
            capture.mnnvl_capture_safe = mnnvl_capture_safe
        if client_loads_kernels:
            capture.client_loads_kernels = True
        if call_sites:
            capture.call_sites = call_sites
        resp = self._call(self.config_stub.Negotiate, config_pb2.NegotiateRequest(capture=capture),
                          timeout)
        return Negotiation.from_proto(resp)

    def wait_ready(self, timeout: float = 60.0, poll: float = 0.05):
        """Waits until the workspace leaves INITIALIZING (READY, UNFUSED, or a failure state);
        returns GetWorkspaceInfo. ArfuseError DEADLINE_EXCEEDED with the sidecar's reason when it
        does not within `timeout` (a peer that never came, typically)."""
        until = time.monotonic() + timeout
        while True:
            info = self.workspace_info()
            if info.state not in (common_pb2.WORKSPACE_STATE_UNSPECIFIED,
                                  common_pb2.WORKSPACE_STATE_INITIALIZING):
                return info
            if time.monotonic() >= until:
                raise ArfuseError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"workspace of rank {self.rank} not ready after {timeout:g} s: "
                                  f"{info.reason}")
            time.sleep(poll)
