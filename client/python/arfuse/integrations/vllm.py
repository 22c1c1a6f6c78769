"""arfuse in vLLM's place for FlashInfer's fused allreduce + (residual add +) RMSNorm.

The arfuse package ships a `vllm.general_plugins` entry point (`arfuse =
arfuse.integrations.vllm:register`); vLLM calls it first in every process it starts (the API
process, the engine core, every worker). Configured by environment:

    ARFUSE_SOCKET=/run/arfuse/rank{rank}.sock   this rank's sidecar ("{rank}": the TP rank)
    ARFUSE_VLLM=1|0                             on / off (default: on when ARFUSE_SOCKET is set)

register() checks vLLM's module layout (LAYOUT below; known on vLLM 0.30.0-0.33.0) and then:

- puts ArfuseAllReduceFusionPass in the place of vLLM's AllReduceFusionPass, where vLLM's
  PostGradPassManager.configure() builds it (`pass_manager.AllReduceFusionPass`): FlashInfer's
  pass is then never built (no FlashInfer workspace, FlashInfer need not be installed) and
  arfuse's runs at its position in the pass order;
- turns `PassConfig.fuse_allreduce_rms` on by default at -O2 and -O3 for TP > 1 on CUDA (vLLM's
  own default asks for FlashInfer and SM90/SM100); an explicit
  `-cc.pass_config.fuse_allreduce_rms=false` still turns it off, as does VLLM_BATCH_INVARIANT.

A layout it does not know: an ERROR naming the vLLM version and what is missing, and nothing is
patched (vLLM runs as without arfuse).

The pass (built by vLLM in every worker when it compiles, after the TP group exists) attaches
to this rank's sidecar and votes across the TP group: all ranks fuse or none
(arfuse.torch.agree). It then replaces, in the post-grad FX graph, the patterns FlashInfer's
pass replaces that arfuse serves:

- all_reduce + fused_add_rms_norm -> torch.ops.arfuse.fused_allreduce_residual_rmsnorm (and
  the variant whose residual output is unused);
- all_reduce + rms_norm (the first layer, no residual) -> the same op with a zero residual:
  exact, since arfuse's residual_out = round(allreduce + 0) is its allreduce result bit for bit
  and its norm is computed from that rounded value, as rms_norm(all_reduce(x)) is.

- all_reduce + fused_add_rms_norm or rms_norm whose output is quantized to FP8 E4M3 with a
  static per-tensor scale (vLLM's AllReduceFused[Add]RMSNormStaticQuantFP8Pattern: the quant as
  _C.static_scaled_fp8_quant under auto_functionalized, or QuantFP8's native form) ->
  torch.ops.arfuse.fused_allreduce_residual_rmsnorm_fp8 with quant static, vLLM's scale passed
  as is (both ops compute e4m3(x * (1 / scale)), saturating). arfuse quantizes the fp32
  normalized value, vLLM the norm output rounded to the model dtype: a code may differ by one
  E4M3 step. Taken where input, residual and weight are bf16 or fp16, the norm's output feeds
  only the quant and the static FP8 pattern's fused range covers the compile range.

only for compile ranges whose end is at most arfuse's fused range for the model's hidden size
and dtype (the sidecar's, the same on every rank; added to vLLM's compile-range endpoints), and
only where input, residual and weight share a served dtype. Declined (vLLM's own path), each
reason logged once: an RMSNorm whose output feeds an NVFP4 quantization (arfuse has no FP4
outputs), a dynamic FP8 one (per-tensor, per-token, per-group: not patterns of vLLM's pass) or
another quantization op, a static FP8 site the FP8 op does not take (fp32 input, the norm's
output also used unquantized, ...; "fp8_*" reasons), Gemma's (1 + weight) norm in fp32, weights
of another dtype, TP 1.

The integration's modules: this one (the entry point register(), the LAYOUT check, the
environment), vllm_state.py (this process's state, the attach and vote, status(), the log lines),
vllm_pass.py (the pass class and its unquantized patterns) and vllm_fp8.py (the static FP8 site
walk and the quantization checks).
"""
import importlib
import os
from typing import Optional

from . import _patches
from .vllm_pass import EPSILONS, pass_class
from .vllm_state import OWN_PATH, attach_and_vote, logger, state, status

# What other code imports from here (the entry point, tests, docs): the names of the modules
# above included.
__all__ = ["EPSILONS", "LAYOUT", "OWN_PATH", "TESTED_VERSIONS", "attach_and_vote",
           "check_layout", "enabled", "logger", "pass_class", "register", "status",
           "unregister", "vllm_version"]

TESTED_VERSIONS = ("0.30.0", "0.31.0", "0.32.0", "0.33.0")

# (module, attribute path, kind): what this integration relies on. "names:X" means the
# function's code refers to the global name X (pass_manager's configure builds
# AllReduceFusionPass by that name, so replacing the module global takes its place).
LAYOUT = (
    ("vllm.plugins", "DEFAULT_PLUGINS_GROUP", "attr"),
    ("vllm.compilation.passes.pass_manager", "PostGradPassManager.configure",
     "names:AllReduceFusionPass"),
    ("vllm.compilation.passes.vllm_inductor_pass", "VllmPatternMatcherPass", "attr"),
    ("vllm.compilation.passes.vllm_inductor_pass", "VllmInductorPass.time_and_log", "attr"),
    ("vllm.compilation.passes.inductor_pass", "enable_fake_mode", "attr"),
    ("vllm.compilation.passes.inductor_pass", "get_pass_context", "attr"),
    ("vllm.compilation.passes.inductor_pass", "InductorPass.hash_source", "attr"),
    ("vllm.ir.ops", "rms_norm", "attr"),
    ("vllm.ir.ops", "fused_add_rms_norm", "attr"),
    ("vllm.distributed.parallel_state", "get_tp_group", "attr"),
    ("vllm.distributed.parallel_state", "get_tensor_model_parallel_rank", "attr"),
    ("vllm.distributed.parallel_state", "get_tensor_model_parallel_world_size", "attr"),
    ("vllm.distributed.parallel_state", "GroupCoordinator.all_reduce", "names:all_reduce"),
    ("vllm.config.vllm", "OPTIMIZATION_LEVEL_02", "attr"),
    ("vllm.config.vllm", "OPTIMIZATION_LEVEL_03", "attr"),
)


def _truthy(value: Optional[str]) -> bool:
    return (value or "").strip().lower() in ("1", "true", "on", "yes")


def enabled(environ=None) -> bool:
    """ARFUSE_VLLM=1 (or unset with ARFUSE_SOCKET set) and a socket to attach to."""
    env = os.environ if environ is None else environ
    if not env.get("ARFUSE_SOCKET"):
        return False
    flag = env.get("ARFUSE_VLLM")
    return True if flag is None or flag.strip() == "" else _truthy(flag)


def vllm_version() -> str:
    try:
        from importlib.metadata import version
        return version("vllm")
    except Exception:
        try:
            return importlib.import_module("vllm").__version__
        except Exception:
            return "unknown"


def _resolve(module, path):
    obj = module
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check_layout():
    """[] when vLLM's modules have every name this integration relies on; else what is
    missing, one string each."""
    missing = []
    for module_name, path, kind in LAYOUT:
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # any import failure means this layout is not served
            missing.append(f"{module_name} ({type(e).__name__}: {e})")
            continue
        try:
            obj = _resolve(module, path)
        except AttributeError:
            missing.append(f"{module_name}.{path}")
            continue
        if kind.startswith("names:"):
            name = kind.split(":", 1)[1]
            code = getattr(obj, "__code__", None)
            if code is None or name not in code.co_names:
                missing.append(f"{module_name}.{path} refers to {name}")
        if path == "DEFAULT_PLUGINS_GROUP" and obj != "vllm.general_plugins":
            missing.append(f"{module_name}.{path} == {obj!r}")
        if path.startswith("OPTIMIZATION_LEVEL_"):
            try:
                obj["compilation_config"]["pass_config"]["fuse_allreduce_rms"]
            except (KeyError, TypeError):
                missing.append(f"{module_name}.{path}[compilation_config][pass_config]"
                               "[fuse_allreduce_rms]")
    return missing


# ---- register() and its patches ----

def _patch(owner, name, value):
    _patches.patch(state.patched, owner, name, value)


def _patch_item(mapping, key, value, label):
    _patches.patch_item(state.patched, mapping, key, value, label)


def unregister():
    """Undoes register() (tests)."""
    with state.lock:
        _patches.restore(state.patched)
        state.registered = False


def _default_on(original):
    """fuse_allreduce_rms's default at -O2/-O3 with arfuse: on for TP > 1 on CUDA (FlashInfer
    not needed), off under VLLM_BATCH_INVARIANT (arfuse's sum is not batch-invariant either:
    the one-shot / two-shot choice depends on the token count)."""
    def enable_allreduce_rms_fusion(cfg) -> bool:
        import vllm.envs as envs
        from vllm.platforms import current_platform

        if getattr(envs, "VLLM_BATCH_INVARIANT", False):
            return False
        if cfg.parallel_config.tensor_parallel_size > 1 and current_platform.is_cuda():
            return True
        return bool(original(cfg)) if callable(original) else bool(original)
    enable_allreduce_rms_fusion.arfuse = True
    return enable_allreduce_rms_fusion


def register():
    """The vllm.general_plugins entry point (module docstring). Idempotent; vLLM may call it
    more than once per process."""
    with state.lock:
        if state.registered:
            return
        if not enabled():
            logger.debug("arfuse: vLLM integration off (ARFUSE_SOCKET unset or ARFUSE_VLLM=0)")
            return
        version = vllm_version()
        missing = check_layout()
        if missing:
            state.reason = f"vLLM {version}: unknown module layout"
            logger.error("arfuse: vLLM %s has a module layout arfuse does not know (tested: "
                         "%s); fused allreduce off, vLLM's own path runs. Missing: %s",
                         version, ", ".join(TESTED_VERSIONS), "; ".join(missing))
            return
        pass_manager = importlib.import_module("vllm.compilation.passes.pass_manager")
        _patch(pass_manager, "AllReduceFusionPass", pass_class())
        vcfg = importlib.import_module("vllm.config.vllm")
        for level in ("OPTIMIZATION_LEVEL_02", "OPTIMIZATION_LEVEL_03"):
            pc = getattr(vcfg, level)["compilation_config"]["pass_config"]
            if not getattr(pc["fuse_allreduce_rms"], "arfuse", False):
                _patch_item(pc, "fuse_allreduce_rms", _default_on(pc["fuse_allreduce_rms"]),
                            level)
        state.registered = True
        state.reason = "registered; the pass attaches when vLLM compiles"
        logger.info("arfuse: vLLM %s (layout known; tested %s): patched %s", version,
                    ", ".join(TESTED_VERSIONS),
                    ", ".join(status()["patched"]))
