"""The vLLM integration's fusion pass: ArfuseAllReduceFusionPass, the class vLLM's pass manager
builds in the place of its AllReduceFusionPass (arfuse.integrations.vllm.register), with the
patterns it registers for the unquantized sites (all_reduce + fused_add_rms_norm, with and
without the residual output, and all_reduce + rms_norm) and their replacements by
torch.ops.arfuse.fused_allreduce_residual_rmsnorm. Its static FP8 sites are vllm_fp8.py's.

pass_class() builds the class on first use: this module imports without vLLM or torch."""
import inspect
import logging
import operator

from . import vllm_fp8
from .vllm_fp8 import QUANT_DETAIL, quant_kind, replace_static_fp8_sites
from .vllm_state import OWN_PATH, attach_and_vote, declined, declines, log_path, logger, state

# The RMSNorm epsilons the patterns are registered for, each pattern once per epsilon.
EPSILONS = (1e-5, 1e-6)

_PASS_CLASS = None


def pass_class():
    """ArfuseAllReduceFusionPass (a vLLM VllmPatternMatcherPass; built on first use so this
    module imports without vLLM or torch)."""
    global _PASS_CLASS
    if _PASS_CLASS is not None:
        return _PASS_CLASS

    import torch
    import torch._inductor.pattern_matcher as pm
    from torch._inductor.pattern_matcher import PatternMatcherPass

    import vllm.ir.ops
    from vllm.compilation.passes import inductor_pass as ip
    from vllm.compilation.passes.vllm_inductor_pass import (VllmInductorPass,
                                                            VllmPatternMatcherPass)
    from vllm.distributed import parallel_state as ps

    import arfuse.torch as aft

    ir_rms = torch.ops.vllm_ir.rms_norm.default
    ir_add_rms = torch.ops.vllm_ir.fused_add_rms_norm.default
    # The FP8 site walk lives in vllm_fp8.py: its source is part of the pass's uuid, so that a
    # change there invalidates vLLM's compile cache as a change of the class does.
    fp8_source = inspect.getsource(vllm_fp8)

    class ArfuseAllReduceFusionPass(VllmPatternMatcherPass):
        """allreduce + (fused add) RMSNorm -> torch.ops.arfuse.fused_allreduce_residual_rmsnorm
        within arfuse's fused range (module docstring of arfuse.integrations.vllm)."""

        def __init__(self, config) -> None:
            super().__init__(config)
            self.pass_name = "arfuse_allreduce_fusion_pass"
            self.disabled = True
            self.max_token_num = 0
            self.range_end = None
            self.tp_size = ps.get_tensor_model_parallel_world_size()
            if self.tp_size <= 1:
                logger.info("arfuse: allreduce fusion pass off for TP size %d", self.tp_size)
                log_path(logging.INFO, False, f"TP size {self.tp_size}: nothing to reduce")
                return
            if config.model_config is None:
                logger.warning("arfuse: allreduce fusion pass off: no model_config")
                return
            hidden = config.model_config.get_hidden_size()
            hiddens = [hidden]
            spec = config.speculative_config
            draft = getattr(spec, "draft_model_config", None) if spec else None
            if draft is not None and draft.get_hidden_size() not in hiddens:
                hiddens.append(draft.get_hidden_size())
            self.hiddens = hiddens
            tp = ps.get_tp_group()
            self.group_name = tp.unique_name
            if not attach_and_vote(hiddens, tp, device=self.device):
                log_path(logging.WARNING, False, state.reason)
                return
            if aft.dtype_name(self.model_dtype) is None:
                logger.warning("arfuse: allreduce fusion pass off: model dtype %s not served",
                               self.model_dtype)
                log_path(logging.WARNING, False, f"model dtype {self.model_dtype} not served")
                return
            self.max_token_num = min(aft.max_fused_tokens(h, self.model_dtype)
                                     for h in hiddens)
            max_batched = config.scheduler_config.max_num_batched_tokens
            if max_batched is not None:
                self.max_token_num = min(self.max_token_num, max_batched)
            if self.max_token_num <= 0:
                logger.warning("arfuse: allreduce fusion pass off: hidden %s in %s has no "
                               "fused range", hiddens, self.model_dtype)
                log_path(logging.WARNING, False,
                         f"hidden {hiddens} in {self.model_dtype} has no fused range")
                return
            self._add_compile_range_endpoint(config, max_batched)
            aft.register_ops()
            self.patterns = PatternMatcherPass(pass_name=self.pass_name)
            self.register_patterns()
            self.disabled = False
            logger.info("arfuse: allreduce fusion pass on: hidden %s %s, compile ranges up to "
                        "%d tokens (TP %d)", hiddens, self.model_dtype, self.max_token_num,
                        self.tp_size)
            log_path(logging.INFO, True,
                     f"fusion pass on: hidden {hiddens} {self.model_dtype}, compile ranges up "
                     f"to {self.max_token_num} tokens; sites outside it run {OWN_PATH}")

        def _add_compile_range_endpoint(self, config, max_batched):
            """vLLM compiles each compile range separately and the pass applies to a range
            only when its end is within the fused range: give arfuse's end its own range.
            vLLM's PiecewiseBackend reads the endpoints after the pass manager is
            configured."""
            cc = config.compilation_config
            ends = list(cc.compile_ranges_endpoints or [])
            m = self.max_token_num
            if m > 1 and (max_batched is None or m < max_batched) and m not in ends:
                cc.compile_ranges_endpoints = sorted(ends + [m])

        def _check(self, match) -> bool:
            """Input, residual and weight of one served dtype; the norm's output feeds no
            quantization op; the hidden size attached with a fused range covering this
            compile range."""
            for node in match.nodes:
                # rms_norm(x, weight, epsilon, variance_size=None); fused_add_rms_norm(x,
                # x_residual, weight, epsilon, variance_size=None): variance_size's position.
                if node.target == ir_rms:
                    x, residual, weight = node.args[0], None, node.args[1]
                    vs = 3
                elif node.target == ir_add_rms:
                    x, residual, weight = node.args[0], node.args[1], node.args[2]
                    vs = 4
                else:
                    continue
                if len(node.args) > vs and node.args[vs] is not None or \
                        node.kwargs.get("variance_size") is not None:
                    return declined("shape", "an RMSNorm over part of the hidden size "
                                    "(variance_size)")
                vals = [a.meta.get("val") if hasattr(a, "meta") else None
                        for a in (x, residual, weight) if a is not None]
                if any(v is None for v in vals) or len({v.dtype for v in vals}) != 1:
                    return declined("dtype", "input, residual and weight of different "
                                    "dtypes (or unknown)")
                if aft.dtype_name(vals[0].dtype) is None:
                    return declined("dtype", f"dtype {vals[0].dtype} is not served")
                hidden = int(vals[0].shape[-1])
                end = self.range_end if self.range_end is not None else self.max_token_num
                if aft.max_fused_tokens(hidden, vals[0].dtype) < end:
                    return declined("range", f"hidden {hidden} {vals[0].dtype}: fused "
                                    f"range below the compile range's end {end}")
                norm_nodes = [node] if node.target == ir_rms else \
                    [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
                kinds = [k for k in (quant_kind(n) for n in norm_nodes) if k is not None]
                if kinds:
                    return declined(kinds[0], QUANT_DETAIL[kinds[0]])
            return True

        @staticmethod
        def _functions(group_name, eps):
            """The patterns as vLLM's models trace them (its GroupCoordinator.all_reduce
            calls torch.ops.vllm.all_reduce with the group's unique name; its norms are
            vllm.ir.ops), and arfuse's replacements. Parameters are pattern inputs only."""
            def add_pattern(residual, input, weight):
                ar = torch.ops.vllm.all_reduce(input, group_name=group_name)
                norm, res = vllm.ir.ops.fused_add_rms_norm(ar, residual, weight, eps)
                return norm, res

            def add_replacement(residual, input, weight):
                out = torch.ops.arfuse.fused_allreduce_residual_rmsnorm(
                    input, residual, weight, eps)
                return out[0], out[1]

            def rms_pattern(input, weight):
                ar = torch.ops.vllm.all_reduce(input, group_name=group_name)
                return vllm.ir.ops.rms_norm(ar, weight, eps), ar

            def rms_replacement(input, weight):
                out = torch.ops.arfuse.fused_allreduce_residual_rmsnorm(
                    input, torch.zeros_like(input), weight, eps)
                return out[0], out[1]

            return add_pattern, add_replacement, rms_pattern, rms_replacement

        @staticmethod
        def _first_only(fn):
            def first(residual, input, weight):
                return fn(residual, input, weight)[0]
            return first

        @ip.enable_fake_mode
        def register_patterns(self) -> None:
            group_name = self.group_name
            dtype, device = self.model_dtype, self.device

            def empty(*shape):
                return torch.empty(*shape, dtype=dtype, device=device)

            for eps in EPSILONS:
                add_pattern, add_replacement, rms_pattern, rms_replacement = \
                    self._functions(group_name, eps)
                add_inputs = [empty(5, 16), empty(5, 16), empty(16)]
                pm.register_replacement(add_pattern, add_replacement, add_inputs, pm.fwd_only,
                                        self.patterns, extra_check=self._check)
                # The residual output unused (the last layer's norm).
                pm.register_replacement(
                    self._first_only(add_pattern), self._first_only(add_replacement),
                    add_inputs, pm.fwd_only, self.patterns, extra_check=self._check)
                pm.register_replacement(rms_pattern, rms_replacement,
                                        [empty(5, 16), empty(16)], pm.fwd_only, self.patterns,
                                        extra_check=self._check)
                # Allow the same patterns again with the next epsilon (as vLLM's pass does).
                torch._inductor.pattern_matcher._seen_patterns.clear()

        def is_applicable_for_range(self, compile_range) -> bool:
            if self.disabled:
                return False
            if compile_range.end <= self.max_token_num:
                return True
            declines.note("range", f"compile ranges ending above {self.max_token_num} tokens "
                          "(the fused range)")
            return False

        def uuid(self) -> str:
            return ip.InductorPass.hash_dict({
                "source": ip.InductorPass.hash_source(self, fp8_source),
                "max_token_num": self.max_token_num, "disabled": self.disabled})

        @VllmInductorPass.time_and_log
        def __call__(self, graph) -> None:
            if self.disabled:
                return
            try:
                self.range_end = ip.get_pass_context().compile_range.end
            except Exception:  # no pass context: outside vLLM's backend (tests)
                self.range_end = None
            fp8 = replace_static_fp8_sites(
                graph, self.group_name,
                self.range_end if self.range_end is not None else self.max_token_num)
            self.matched_count = fp8 + self.patterns.apply(graph)
            state.replaced += self.matched_count
            VllmPatternMatcherPass.match_table[self.pass_name] += self.matched_count
            logger.info("arfuse: compile range ending at %s: %d allreduce + RMSNorm sites on "
                        "arfuse (%d of them with static FP8 outputs)", self.range_end,
                        self.matched_count, fp8)

    _PASS_CLASS = ArfuseAllReduceFusionPass
    return _PASS_CLASS
