"""RecordingLib: libarfuse_client's C ABI as a recorder, for testing the Python layers above it
(arfuse.instream's event handling, arfuse.torch's eligibility rules) where the library or the
sidecar's Fusion.Attach is not there. It launches nothing and writes no output."""
import types

from arfuse import fusion_pb2, instream


class RecordingLib:
    """Stands in for libarfuse_client: records calls, answers per arfuse_client.h (after
    arfuse_disable every op returns UNAVAILABLE with the reason)."""

    def __init__(self, device_kind=2, attach_id=7):
        self.device_kind, self.attach_id = device_kind, attach_id
        self.calls = []
        self.reason = None
        self.error = b""
        self.detached = False

    def arfuse_client_abi_version(self):
        return instream.CLIENT_ABI_VERSION

    def arfuse_launch_abi_version(self):
        return 4

    def arfuse_launch_args_bytes(self):
        return 368

    def arfuse_client_version(self):
        return b"recording"

    def arfuse_last_error(self):
        return self.error

    def arfuse_ctx_get_info(self, handle, ref):
        s = ref._obj
        s.device_kind, s.rank, s.world_size = self.device_kind, 0, 2
        s.attach_id, s.generation, s.max_tokens, s.hidden, s.dtype = self.attach_id, 3, 64, 256, 3
        return 0

    def arfuse_disable(self, handle, reason):
        self.calls.append(("disable", reason.decode()))
        self.reason = reason
        return 0

    def arfuse_supports(self, handle, pattern, tokens, hidden, dtype):
        if self.reason is not None:
            self.error = self.reason
            return instream.UNAVAILABLE
        if tokens > 64:
            self.error = b"64+ tokens: beyond the workspace"
            return instream.OUT_OF_RANGE
        # The FP8 patterns' own rules (contract::CheckPattern), as the library answers them.
        if pattern >= instream.PATTERN_FP8_STATIC and dtype == instream.DTYPES["fp32"]:
            self.error = b"fusion unavailable for this op: ... takes bf16 or fp16 input, not fp32"
            return instream.OUT_OF_RANGE
        if pattern == instream.PATTERN_FP8_PER_GROUP and hidden % instream.FP8_GROUP_SIZE:
            self.error = b"fusion unavailable for this op: ... is not a multiple of the group size"
            return instream.OUT_OF_RANGE
        return 0

    def arfuse_fused_allreduce_residual_rmsnorm(self, handle, stream, input, residual_in,
                                                residual_out, norm_out, gamma, tokens, hidden,
                                                dtype, eps):
        if self.reason is not None:
            self.error = self.reason
            return instream.UNAVAILABLE
        self.calls.append(("launch", stream, tokens, hidden, dtype, residual_in == residual_out))
        return 0

    def arfuse_fused_allreduce_residual_rmsnorm_fp8(self, handle, stream, input, residual_in,
                                                    residual_out, norm_out, quant_out, scale,
                                                    gamma, tokens, hidden, dtype, eps, quant,
                                                    scale_layout):
        if self.reason is not None:
            self.error = self.reason
            return instream.UNAVAILABLE
        self.calls.append(("launch_fp8", stream, tokens, hidden, dtype, quant, scale_layout,
                           norm_out is None, scale))
        return 0

    def arfuse_fused_allreduce(self, handle, stream, input, output, tokens, hidden, dtype):
        if self.reason is not None:
            self.error = self.reason
            return instream.UNAVAILABLE
        self.calls.append(("allreduce", stream, tokens, hidden, dtype))
        return 0

    def arfuse_check(self, handle, ref):
        self.calls.append(("check",))
        return 0

    def arfuse_set_program_key(self, handle, key):
        self.calls.append(("program_key", key))
        if key > instream.PROGRAM_KEY_MAX:
            self.error = b"the program key has bits above the low 24"
            return instream.INVALID_ARGUMENT
        return 0

    def arfuse_note_declined(self, handle, reason):
        self.calls.append(("note_declined", reason))
        return 0

    def arfuse_detach(self, handle):
        self.calls.append(("detach",))
        self.detached = True
        return 0

    def arfuse_error_name(self, code):
        return b"none"


def bound_context(client, lib):
    ctx = instream.InStreamContext(lib, object(), client,
                                   types.SimpleNamespace(attach_id=lib.attach_id,
                                                         memory_kind="host_shm"), [256])
    table = instream.attachments_of(client)
    table.expect(lib.attach_id)
    table.bind(lib.attach_id, ctx)
    return ctx


def deliver_event(client, kind, attach_id, reason):
    """An AttachEvent as the client's session thread hands it to the client's attachments."""
    instream.attachments_of(client).on_session_event(
        fusion_pb2.AttachEvent(kind=kind, attach_id=attach_id, reason=reason))


def unbound_context(lib, hiddens=(256,)):
    """A context without a client (events come from the test)."""
    return instream.InStreamContext(lib, object(), None,
                                    types.SimpleNamespace(attach_id=lib.attach_id), hiddens)
