"""tp_decode's command line (no torch): the parser, the checks of the arguments, the
scenarios and the tensor-parallel constraints of the model at a world size.
"""
import argparse
from typing import List, Optional, Sequence, Tuple

from tpd_common import UsageError
from tpd_sidecars import PLANES

SCENARIOS = ("main", "off", "kill")


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tp_decode.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Tensor-parallel decode of a Llama-style model through arfuse "
                    "(docs/integration.md).",
        epilog="Paths: --arfused or $ARFUSE_ARFUSED, else the newest build*/server/daemon/arfused,"
               " else arfused on $PATH; libraries it needs from --arfused-lib-dir or "
               "$ARFUSE_ARFUSED_LIBS, else <arfused's dir>/../devlibs when present (set for the "
               "sidecars only). Ring library: --ring-lib or $ARFUSE_RING_LIB, else a build of "
               "this checkout (build/client/ring/). Client library (in-stream plane): "
               "--client-lib or $ARFUSE_CLIENT_LIB, else a build of this checkout "
               "(build/client/instream/); else the system's library path.")
    g = p.add_argument_group("processes")
    g.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="cuda (default when a GPU is visible) or cpu (host-mode sidecars, gloo, "
                        "no CUDA graphs)")
    g.add_argument("--ranks", type=int, default=2, help="tensor-parallel size (launcher)")
    g.add_argument("--gpus", type=int, default=None,
                   help="GPUs to spread the ranks over (rank r on GPU r %% gpus); default: all "
                        "visible. Fewer GPUs than ranks: ranks share them, run MPS")
    g.add_argument("--sockets", default=None,
                   help="comma-separated sockets of sidecars already running, in rank order: "
                        "start no sidecars")
    g.add_argument("--rank", type=int, default=None,
                   help="run as this rank only (with --sockets and --dist-init; torchrun sets "
                        "RANK/WORLD_SIZE instead)")
    g.add_argument("--gpu", type=int, default=None, help="this rank's GPU (default rank %% gpus)")
    g.add_argument("--dist-init", default=None,
                   help="torch.distributed init_method for --rank (e.g. tcp://host:port)")
    g.add_argument("--scenarios", default="main",
                   help="launcher: comma-separated of main (check + fallback pass + --perf), off "
                        "(sidecars with --enforce-disable-flashinfer-allreduce-fusion: the "
                        "framework path decodes the same tokens), kill (the last rank's sidecar "
                        "is SIGKILLed mid-decode: every rank must stop with an error naming it "
                        "within the op deadline)")
    g.add_argument("--timeout", type=float, default=170.0,
                   help="seconds a scenario may take before everything is killed")
    g.add_argument("--json", default=None, help="write every scenario's results here")
    g.add_argument("--keep-logs", action="store_true", help="keep the run folder")

    g = p.add_argument_group("model (random weights from --seed; nothing is downloaded)")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--hidden", type=int, default=1024)
    g.add_argument("--heads", type=int, default=16)
    g.add_argument("--kv-heads", type=int, default=8)
    g.add_argument("--intermediate", type=int, default=2816)
    g.add_argument("--vocab", type=int, default=4096)
    g.add_argument("--eps", type=float, default=1e-5, help="RMSNorm epsilon")
    g.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--batch", type=int, default=4, help="sequences decoded together")
    g.add_argument("--prompt-len", type=int, default=16)
    g.add_argument("--steps", type=int, default=24, help="tokens generated per sequence")

    g = p.add_argument_group("data plane and CUDA graphs (negotiated with the sidecar's config "
                             "service)")
    g.add_argument("--plane", choices=list(PLANES), default="instream",
                   help="instream (default): the sidecar's kernel launched in this process's "
                        "stream through arfuse.torch, prefill and decode, decode inside the "
                        "graphs; doorbell: a ring kernel in the graph and a serving launch in the "
                        "sidecar; eager: one Fusion.Execute RPC per op, between graph pieces")
    g.add_argument("--allow-eager-decode", action="store_true",
                   help="accept a decode whose fused ops run on the eager plane (otherwise the "
                        "run fails, loudly); --plane eager implies it")
    g.add_argument("--client-lib", default=None,
                   help="libarfuse_client.so for the in-stream plane (default: "
                        "$ARFUSE_CLIENT_LIB, then a build of this checkout)")
    g.add_argument("--cuda-graph", choices=["none", "piecewise", "full"], default="full",
                   help="the mode this client wants; the sidecar answers the mode it may use")
    g.add_argument("--fused-op-in-graph", type=_bool, default=True,
                   help="ask for the fused op inside the graphs (in-stream and doorbell planes)")
    g.add_argument("--framework-graph", choices=["auto", "none", "piecewise", "full"],
                   default="auto",
                   help="graph mode of the in-process reference: auto = --cuda-graph when its "
                        "collective can be captured (NCCL), else piecewise (gloo)")

    g = p.add_argument_group("sidecar flags (SGLang's spelling, passed to every arfused)")
    g.add_argument("--flashinfer-allreduce-fusion-backend", choices=["auto", "trtllm", "mnnvl"],
                   default=None, help="unset: fusion off unless auto-enabled (SM100 family)")
    g.add_argument("--enable-flashinfer-allreduce-fusion", action="store_true",
                   help="deprecated: means --flashinfer-allreduce-fusion-backend=auto")
    g.add_argument("--enforce-disable-flashinfer-allreduce-fusion", action="store_true")
    g.add_argument("--enable-deterministic-inference", action="store_true")
    g.add_argument("--sm", type=int, default=None,
                   help="compute capability for the config service (host mode: default 90)")
    g.add_argument("--spin-timeout", type=float, default=5.0,
                   help="arfused --spin-timeout: a cross-rank wait gives up after this")
    g.add_argument("--sidecar-arg", action="append", default=[],
                   help="extra arfused argument (repeatable)")
    g.add_argument("--arfused", default=None)
    g.add_argument("--arfused-lib-dir", default=None)
    g.add_argument("--ring-lib", default=None)

    g = p.add_argument_group("what to run")
    g.add_argument("--check", type=_bool, default=True,
                   help="compare tokens and logits with in-process torch.distributed")
    g.add_argument("--strict-tokens", action="store_true",
                   help="fail on any token difference, even a near tie within bf16 tolerance")
    g.add_argument("--perf", action="store_true",
                   help="time decode steps: arfuse vs the framework path vs no allreduce")
    g.add_argument("--perf-iters", type=int, default=200)
    g.add_argument("--perf-warmup", type=int, default=20)
    g.add_argument("--op-timeout", type=float, default=10.0,
                   help="deadline of one fused op (eager RPC deadline, doorbell ring timeout)")
    g.add_argument("--ready-timeout", type=float, default=90.0,
                   help="seconds to wait for the sidecar's workspace and the group decision")
    g.add_argument("--pg-timeout", type=float, default=60.0,
                   help="torch.distributed timeout (bounds the framework path's collectives)")
    g.add_argument("--setup-only", action="store_true",
                   help="no torch: connect, negotiate, set up the plane (attach, or a plan per "
                        "site), run every site's fused op on known data (host mode) and check "
                        "the values")
    g = p.add_argument_group("numerics oracle (issue 25; oracle.py is the one-command front end)")
    g.add_argument("--oracle", default=None, metavar="JSON",
                   help="instead of the check: run the same weights through arfuse, the "
                        "framework path, fp32 on one GPU and Hugging Face transformers' "
                        "LlamaForCausalLM, teacher-forced on the fp32 tokens; write per-layer and "
                        "logit distances and the token comparison to JSON")
    g.add_argument("--tie-tol", type=float, default=0.1,
                   help="oracle: a token difference where the fp32 reference's top-2 logit gap "
                        "is below this counts as a tie")
    g.add_argument("--oracle-slack", type=float, default=0.01,
                   help="oracle: arfuse passes a layer when its distance from fp32 is at most "
                        "(1 + slack) x the framework path's (default 0.01: two bf16 paths of "
                        "equal precision that round in different orders differ by a fraction "
                        "of a percent; docs/numerics.md)")
    g.add_argument("--oracle-hf", choices=["auto", "on", "off"], default="auto",
                   help="oracle: run transformers' LlamaForCausalLM (auto: when importable)")
    # Internal (launcher -> rank).
    g.add_argument("--world-size", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    g.add_argument("--scenario", default="main", help=argparse.SUPPRESS)
    g.add_argument("--sidecar-pids", default=None, help=argparse.SUPPRESS)
    g.add_argument("--inject-kill", default=None, help=argparse.SUPPRESS)  # RANK@STEP
    g.add_argument("--gpu-count", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    validate_args(args)
    return args


def validate_args(args):
    if args.ranks < 1:
        raise UsageError("--ranks must be >= 1")
    for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "batch",
                 "prompt_len", "steps"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if args.hidden % args.heads:
        raise UsageError("--hidden must be a multiple of --heads")
    if (args.hidden // args.heads) % 2:
        raise UsageError("the head size (--hidden / --heads) must be even (rotary embedding)")
    if args.heads % args.kv_heads:
        raise UsageError("--heads must be a multiple of --kv-heads")
    if args.hidden % 8:
        raise UsageError("--hidden must be a multiple of 8 (the fused op's rule)")
    if args.steps < 2:
        raise UsageError("--steps must be >= 2 (one from prefill, the rest decode)")
    bad = [s for s in scenario_list(args) if s not in SCENARIOS]
    if bad:
        raise UsageError(f"unknown scenario(s) {','.join(bad)}: expected {','.join(SCENARIOS)}")
    if "kill" in scenario_list(args) and args.sockets and args.rank is None:
        raise UsageError("the kill scenario needs sidecars this launcher starts (no --sockets)")
    if args.inject_kill is not None:
        parse_inject(args.inject_kill)
    if args.oracle and args.setup_only:
        raise UsageError("--oracle needs the model (torch): not with --setup-only")
    if args.oracle and "main" not in scenario_list(args):
        raise UsageError("--oracle runs in the main scenario")


def scenario_list(args) -> List[str]:
    return [s.strip() for s in args.scenarios.split(",") if s.strip()]


def parse_inject(spec: str) -> Tuple[int, int]:
    try:
        r, s = spec.split("@")
        return int(r), int(s)
    except ValueError:
        raise UsageError(f"--inject-kill wants RANK@STEP, got {spec!r}") from None


def check_world(args, world: int):
    """Tensor-parallel constraints of the model at this world size."""
    for name, value in (("heads", args.heads), ("kv-heads", args.kv_heads),
                        ("intermediate", args.intermediate)):
        if value % world:
            raise UsageError(f"--{name} {value} is not divisible by the {world} ranks")
