"""The SGLang integration's process state, read by the op, the gate and the FP8 hook."""
import threading
from typing import List, Optional

from .layouts import Layout


class State:
    """Read by the op and the gate on SGLang's hot (and traced) path: plain attributes only."""

    def __init__(self):
        self.served = False          # the gate's answer: set only by setup(), after the vote
        self.op = None               # torch.ops.arfuse.allreduce_residual_rmsnorm once set up
        self.reason = "not set up (SGLang calls pre_initialize_workspaces before capture)"
        self.reason_class = "not_set_up"
        self.ctx = None
        self.client = None
        self.owns_client = False
        self.decided = None          # (hidden, dtype name) the vote decided
        self.world_size = 1
        self.rank = 0
        self.layout: Optional[Layout] = None
        self.gate_name = ""
        self.version = ""
        self.socket = None
        self.setup_kwargs = {}
        self.installed = []          # (owner, attribute, original, had_attribute)
        self.patched_names: List[str] = []
        # The per-group FP8 hook (layouts.QUANT_HOOK): decided and voted at setup like the op.
        self.fp8_served = False
        self.fp8_op = None           # torch.ops.arfuse.fused_allreduce_residual_rmsnorm_fp8
        self.fp8_reason = "not set up"
        self.fp8_limit = 0           # tokens per launch, the smallest any rank's sidecar serves
        self.fp8_layout = 0          # instream.SCALE_LAYOUTS code of the scales handed back
        self.fp8_layout_name = ""
        self.fp8_quant = 0           # instream.QUANTS["per_group"]
        self.fp8_dtype = None        # the torch dtype the setup decided (input, residual, weight)
        self.quant_hook_original = None  # SGLang's own hook: what a declined call runs
        self.quant_hook_installed = False
        self.lock = threading.Lock()  # install/setup/teardown only, never the op
