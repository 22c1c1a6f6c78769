"""One TP rank of the vLLM pass test: real vLLM modules, real torch, a host-mode sidecar.

    pass_rank.py --rank R --world W --init FILE --socket TEMPLATE --vllm-src DIR [--deps DIR]
                 --hidden H --dtype bf16 --out JSON

Runs the arfuse pass (arfuse.integrations.vllm) as vLLM's pass manager would: built with a
config after the TP group exists (it attaches and votes there), then applied to post-grad FX
graphs made of vLLM's own ops (torch.ops.vllm.all_reduce, torch.ops.vllm_ir.rms_norm and
fused_add_rms_norm, traced through vllm.ir.ops as vLLM's models call them). The graphs run
before and after the pass on CPU tensors: before, vLLM's path (its all_reduce op over gloo, its
IR norms); after, arfuse's op through the sidecar's host workspace. Writes what it saw as JSON
for the test to judge.

The TP group is a stand-in for vLLM's GroupCoordinator (its unique_name, cpu_group,
rank_in_group, world_size, and _all_reduce_out_place over gloo, registered in
parallel_state._groups so vLLM's all_reduce op finds it): a real one needs vLLM's device
communicators, which need its CUDA extension.
"""
import argparse
import logging
import copy
import json
import os
import pathlib
import sys
import types
import weakref

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO / "client" / "python"))
sys.path.insert(0, str(HERE))


# What the integration logs (the path line, first declines), returned with the results.
LOGS = []


class _Keep(logging.Handler):
    def emit(self, record):
        LOGS.append(f"{record.levelname} {record.getMessage()}")


def main():
    logging.getLogger("arfuse").addHandler(_Keep())
    logging.getLogger("arfuse").setLevel(logging.INFO)
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--vllm-src", required=True)
    ap.add_argument("--deps")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the ranks' tensors on --gpu, CUDA sidecars (tests/gpu/vllm_pass.py)")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--sweep", default="",
                    help="token counts (comma-separated) to trace, pass and run the model at")
    ap.add_argument("--max-batched", type=int, default=8192)
    ap.add_argument("--break-rank", type=int, default=-1,
                    help="this rank attaches to a socket that is not there")
    ap.add_argument("--out", required=True)
    ap.add_argument("--record-imports", default=None,
                    help="write the files of every module loaded from --vllm-src or --deps")
    args = ap.parse_args()
    try:
        run(args)
    finally:
        if args.record_imports:
            roots = [str(pathlib.Path(d).resolve()) for d in (args.vllm_src, args.deps) if d]
            files = sorted({str(pathlib.Path(m.__file__).resolve())
                            for m in list(sys.modules.values())
                            if getattr(m, "__file__", None)
                            and any(str(pathlib.Path(m.__file__).resolve()).startswith(r)
                                    for r in roots)})
            pathlib.Path(args.record_imports).write_text("\n".join(files) + "\n")


def run(args):
    import vllm_env
    vllm_env.setup(args.vllm_src, args.deps)
    if args.device == "cuda":
        # vLLM's CUDA platform imports its CUDA extension (vllm._C_stable_libtorch), built for
        # another torch than the one under test: vLLM runs on the platform it picks on a machine
        # without a GPU (UnspecifiedPlatform, its IR ops' native implementations), as on CPU,
        # with its custom ops (vllm::all_reduce) registered for CUDA tensors.
        import vllm.platforms
        from vllm.platforms.interface import UnspecifiedPlatform

        class CudaTensorsOnly(UnspecifiedPlatform):
            dispatch_key = "CUDA"

        vllm.platforms._current_platform = CudaTensorsOnly()

    import torch
    import torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx

    dist.init_process_group("gloo", init_method=f"file://{args.init}", rank=args.rank,
                            world_size=args.world)

    import vllm
    import vllm.ir.ops
    from vllm.config.compilation import CompilationConfig
    from vllm.config.utils import Range
    from vllm.distributed import parallel_state as ps

    from arfuse.integrations import vllm as av

    result = {"rank": args.rank, "vllm_file": vllm.__file__, "vllm_version": vllm.__version__}
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    dev = torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(args.gpu)
        dev = torch.device("cuda", args.gpu)

    # ---- the TP group ----
    class TpGroup:
        unique_name = "tp:0"
        cpu_group = dist.group.WORLD
        rank_in_group = args.rank
        world_size = args.world
        use_custom_op_call = True

        def _all_reduce_out_place(self, t):
            # vLLM's path over gloo (on CUDA through host memory: ranks may share one GPU,
            # which NCCL refuses).
            out = t.cpu().clone() if t.is_cuda else t.clone()
            dist.all_reduce(out)
            return out.to(t.device)

        def all_reduce(self, t):
            return torch.ops.vllm.all_reduce(t, group_name=self.unique_name)

    tp = TpGroup()
    ps._groups[tp.unique_name] = weakref.ref(tp)
    ps.get_tp_group = lambda: tp
    ps.get_tensor_model_parallel_world_size = lambda: args.world
    ps.get_tensor_model_parallel_rank = lambda: args.rank

    # ---- the config vLLM hands its passes (real CompilationConfig; the model, scheduler and
    # device parts are what the pass reads) ----
    cc = CompilationConfig()
    cc.compile_ranges_endpoints = [args.max_batched]
    hidden = args.hidden
    config = types.SimpleNamespace(
        compilation_config=cc,
        model_config=types.SimpleNamespace(dtype=dtype, get_hidden_size=lambda: hidden),
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=args.max_batched),
        speculative_config=None,
        device_config=types.SimpleNamespace(device=args.device))

    os.environ["ARFUSE_SOCKET"] = args.socket if args.rank != args.break_rank else \
        os.path.join(os.path.dirname(args.init), "missing{rank}.sock")
    Pass = av.pass_class()
    p = Pass(config)
    result.update(disabled=p.disabled, max_token_num=p.max_token_num,
                  endpoints=list(cc.compile_ranges_endpoints or []),
                  status=av.status())
    if p.disabled:
        result["logs"] = list(LOGS)
        json.dump(result, open(args.out, "w"))
        dist.barrier()
        return
    m = p.max_token_num
    result["applicable"] = {
        "1..m": p.is_applicable_for_range(Range(1, m)),
        "m+1..max": p.is_applicable_for_range(Range(m + 1, args.max_batched)),
        "1..max": p.is_applicable_for_range(Range(1, args.max_batched)),
    }

    eps = 1e-6
    ar = tp.all_reduce

    def model(x, x1, x2, w_in, w_post, w_last, w_mid):
        ar0 = ar(x)                                            # embedding allreduce
        h0 = vllm.ir.ops.rms_norm(ar0, w_in, eps)              # first layer: no residual
        y = ar(x1 + h0 @ w_mid)
        h1, r1 = vllm.ir.ops.fused_add_rms_norm(y, ar0, w_post, eps)
        z = ar(x2 + h1 @ w_mid)
        h2 = vllm.ir.ops.fused_add_rms_norm(z, r1, w_last, eps)[0]   # residual unused
        return h2, ar0, r1

    # ---- vLLM's FP8 sites: its AllReduceFused[Add]RMSNormStaticQuantFP8Pattern's graphs ----
    fp8 = torch.float8_e4m3fn
    from torch._higher_order_ops.auto_functionalize import auto_functionalized
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        GroupShape, group_broadcast, prep_scale_for_group_broadcast)

    # vLLM's _C.static_scaled_fp8_quant (its CUDA extension, not on this machine), with its
    # schema and its kernel's math: q = clamp(x * (1 / scale), -448, 448) in fp32.
    if not hasattr(torch.ops._C, "static_scaled_fp8_quant"):
        lib_c = torch.library.Library("_C", "FRAGMENT")
        lib_c.define("static_scaled_fp8_quant(Tensor! result, Tensor input, Tensor scale, "
                     "int[]? group_shape=None) -> ()")

        def static_scaled_fp8_quant(result, input, scale, group_shape=None):
            inv = 1.0 / scale.float().reshape(())
            result.copy_((input.float() * inv).clamp(-448.0, 448.0).to(fp8))

        lib_c.impl("static_scaled_fp8_quant", static_scaled_fp8_quant,
                   "CompositeExplicitAutograd")
        torch.library.register_fake("_C::static_scaled_fp8_quant",
                                    lambda result, input, scale, group_shape=None: None)
        result["stand_ins"] = ["_C::static_scaled_fp8_quant"]
    quant_custom = torch.ops._C.static_scaled_fp8_quant.default

    def custom_quant(n, scale, group_shape=(-1, -1)):
        # As vLLM's MatcherQuantFP8.forward_custom traces it (group_shape: 0.31.0 on).
        kw = {} if group_shape is None else {"group_shape": list(group_shape)}
        _, q = auto_functionalized(quant_custom, result=torch.empty(n.shape, dtype=fp8,
                                                                    device=n.device),
                                   input=n, scale=scale, **kw)
        return q

    def native_quant(n, scale):
        # vLLM's QuantFP8.forward_native, static per-tensor (its own helpers).
        s = prep_scale_for_group_broadcast(scale, n, GroupShape.PER_TENSOR)
        out = n.to(torch.float32) * group_broadcast(s.to(torch.float32),
                                                     n.shape[-2:]).reciprocal()
        return out.clamp(-448.0, 448.0).to(fp8)

    def fp8_model(quant):
        def f(x, x1, r, w_in, w_post, scale):
            # First layer: allreduce + RMSNorm + FP8 (vLLM's pattern returns the codes and
            # the allreduce, the residual stream); then allreduce + add-RMSNorm + FP8.
            ar0 = ar(x)
            q0 = quant(vllm.ir.ops.rms_norm(ar0, w_in, eps), scale)
            n1, r1 = vllm.ir.ops.fused_add_rms_norm(ar(x1), ar0 + r, w_post, eps)
            return q0, ar0, quant(n1, scale), r1
        return f

    def quant_nvfp4(x, r, w, scale):
        # An NVFP4 quantization after the norm (as vLLM's scaled_fp4_quant: packed FP4).
        n, res = vllm.ir.ops.fused_add_rms_norm(ar(x), r, w, eps)
        return torch.ops.arfuse_test.scaled_fp4_quant(n, scale), res

    def quant_dynamic(x, r, w):
        # Dynamic per-token FP8 (vLLM's dynamic_per_token_scaled_fp8_quant).
        n, res = vllm.ir.ops.fused_add_rms_norm(ar(x), r, w, eps)
        return torch.ops.arfuse_test.dynamic_per_token_scaled_fp8_quant(n), res

    def quant_norm_used(x, r, w, scale):
        # The norm's output quantized and also used unquantized.
        n, res = vllm.ir.ops.fused_add_rms_norm(ar(x), r, w, eps)
        return custom_quant(n, scale), n, res

    lib = torch.library.Library("arfuse_test", "FRAGMENT")
    lib.define("scaled_fp4_quant(Tensor x, Tensor scale) -> Tensor")
    lib.impl("scaled_fp4_quant",
             lambda x, s: torch.zeros(x.shape[0], x.shape[1] // 2, dtype=torch.uint8,
                                      device=x.device), "CompositeExplicitAutograd")
    torch.library.register_fake(
        "arfuse_test::scaled_fp4_quant",
        lambda x, s: torch.empty(x.shape[0], x.shape[1] // 2, dtype=torch.uint8,
                                 device=x.device))
    lib.define("dynamic_per_token_scaled_fp8_quant(Tensor x) -> Tensor")
    lib.impl("dynamic_per_token_scaled_fp8_quant",
             lambda x: x.float().clamp(-448, 448).to(fp8), "CompositeExplicitAutograd")
    torch.library.register_fake(
        "arfuse_test::dynamic_per_token_scaled_fp8_quant",
        lambda x: torch.empty(x.shape, dtype=fp8, device=x.device))

    def gemma(x, r, w):
        # Gemma's norm: (1 + weight) in fp32 against a bf16 input.
        return vllm.ir.ops.fused_add_rms_norm(ar(x), r, w.float() + 1.0, eps)

    def mixed(x, r, w):
        return vllm.ir.ops.fused_add_rms_norm(ar(x), r, w, eps)

    def partial_first(x, w):
        # The first layer's norm over part of the hidden size (rms_norm's variance_size is its
        # fourth argument, fused_add_rms_norm's its fifth).
        return vllm.ir.ops.rms_norm(ar(x), w, eps, w.shape[0] // 2)

    def counts(gm):
        names = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        return {"arfuse": sum("arfuse.fused_allreduce" in s for s in names),
                "all_reduce": sum(s.startswith("vllm.all_reduce") for s in names),
                "vllm_ir": sum(s.startswith("vllm_ir.") for s in names)}

    def left(gm):
        """vLLM's allreduce, norm and FP8 quant nodes left in a passed graph."""
        names = [str(n.target) + " " + " ".join(str(a) for a in n.args[:1])
                 for n in gm.graph.nodes if n.op == "call_function"]
        return sorted(s for s in names if "vllm.all_reduce" in s or "vllm_ir." in s
                      or "static_scaled_fp8_quant" in s or "reciprocal" in s
                      or "clamp" in s)

    def fp8_steps(got, want):
        """The largest distance between two FP8 E4M3 tensors in E4M3 steps: the magnitude codes
        are monotone in the value, so it is the codes' difference on one side of zero and the
        sum of the magnitudes across it."""
        g, w_ = got.view(torch.uint8).int(), want.view(torch.uint8).int()
        gm_, wm = g & 0x7F, w_ & 0x7F
        same = (g & 0x80) == (w_ & 0x80)
        return int(torch.where(same, (gm_ - wm).abs(), gm_ + wm).max())

    def run_pass(fn, *inputs):
        gm = make_fx(fn, tracing_mode="fake")(*inputs)
        before = counts(gm)
        ref = copy.deepcopy(gm)
        p(gm.graph)
        gm.graph.lint()
        gm.recompile()
        return gm, ref, before, counts(gm), p.matched_count

    t, h = args.tokens, hidden
    gen = torch.Generator().manual_seed(1000 + args.rank)   # per-rank partial sums
    shared = torch.Generator().manual_seed(7)                # weights alike on every rank

    def per_rank(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(dev)

    def same(*shape, scale=1.0):
        return (torch.randn(*shape, generator=shared) * scale).to(dtype).to(dev)

    x, x1, x2 = per_rank(t, h), per_rank(t, h), per_rank(t, h)
    w_in, w_post, w_last = same(h), same(h), same(h)
    w_mid = same(h, h, scale=h ** -0.5)

    gm, ref, before, after, matched = run_pass(model, x, x1, x2, w_in, w_post, w_last, w_mid)
    result["model"] = {"before": before, "after": after, "matched": matched}
    with torch.no_grad():
        want = ref(x, x1, x2, w_in, w_post, w_last, w_mid)
        got = gm(x, x1, x2, w_in, w_post, w_last, w_mid)
    result["model"]["max_abs_diff"] = [float((a.float() - b.float()).abs().max())
                                      for a, b in zip(got, want)]
    result["model"]["max_abs_ref"] = [float(b.float().abs().max()) for b in want]
    result["model"]["ar0_equal"] = bool(torch.equal(got[1], want[1]))

    r = per_rank(t, h)
    scale = torch.tensor([0.02], device=dev)
    for name, quant in (("fp8_custom", custom_quant),
                        ("fp8_custom_no_group_shape",
                         lambda n, s: custom_quant(n, s, group_shape=None)),
                        ("fp8_native", native_quant)):
        inputs = (x, x1, r, w_in, w_post, scale)
        gm, ref, b, a, k = run_pass(fp8_model(quant), *inputs)
        res = {"before": b, "after": a, "matched": k, "left": left(gm)}
        with torch.no_grad():
            want, got = ref(*inputs), gm(*inputs)
        res["dtypes"] = [str(g.dtype) for g in got]
        res["codes_max_steps"] = [fp8_steps(g, w_) for g, w_ in zip(got[0::2], want[0::2])]
        res["codes_differ"] = [int((g.view(torch.uint8) != w_.view(torch.uint8)).sum())
                               for g, w_ in zip(got[0::2], want[0::2])]
        res["codes_nonzero"] = [int((g.float() != 0).sum()) for g in got[0::2]]
        res["residual_equal"] = bool(torch.equal(got[1], want[1]))
        res["residual_max_abs_diff"] = float((got[3].float() - want[3].float()).abs().max())
        res["residual_max_abs_ref"] = float(want[3].float().abs().max())
        result[name] = res

    for name, fn, inputs in (
            ("quant_nvfp4", quant_nvfp4, (x, r, w_post, scale)),
            ("quant_dynamic", quant_dynamic, (x, r, w_post)),
            ("quant_norm_used", quant_norm_used, (x, r, w_post, scale)),
            ("quant_fp32", fp8_model(custom_quant),
             (x.float(), x1.float(), r.float(), w_in.float(), w_post.float(), scale)),
            ("gemma", gemma, (x, r, w_post)),
            ("mixed", mixed, (x, r, w_post.float())),
            ("partial_first", partial_first, (x, w_in))):
        _, _, b, a, k = run_pass(fn, *inputs)
        result[name] = {"before": b, "after": a, "matched": k}

    if args.sweep:
        result["sweep"] = [sweep_point(int(n), p, run_pass, model, per_rank, w_in, w_post, w_last,
                                       w_mid, dev, Range, torch)
                           for n in args.sweep.split(",")]
    result["logs"] = list(LOGS)
    json.dump(result, open(args.out, "w"))
    dist.barrier()


def sweep_point(tokens, p, run_pass, model, per_rank, w_in, w_post, w_last, w_mid, dev, Range,
                torch):
    """The model at `tokens`: passed when vLLM would apply the pass to that compile range (the
    sidecar's fused range), else vLLM's own graph; run against vLLM's path, and on CUDA also
    replayed as a CUDA graph (vLLM captures its decode graphs)."""
    h = w_in.shape[0]
    inputs = (per_rank(tokens, h), per_rank(tokens, h), per_rank(tokens, h), w_in, w_post,
              w_last, w_mid)
    applicable = p.is_applicable_for_range(Range(tokens, tokens))
    if applicable:
        gm, ref, before, after, matched = run_pass(model, *inputs)
    else:
        from torch.fx.experimental.proxy_tensor import make_fx
        ref = make_fx(model, tracing_mode="fake")(*inputs)
        gm, before, after, matched = ref, None, None, 0
    point = {"tokens": tokens, "applicable": applicable, "before": before, "after": after,
             "matched": matched}
    with torch.no_grad():
        want = ref(*inputs)
        got = gm(*inputs)
        point["max_abs_diff"] = [float((a.float() - b.float()).abs().max())
                                 for a, b in zip(got, want)]
        point["max_abs_ref"] = [float(b.float().abs().max()) for b in want]
        if applicable and dev.type == "cuda":
            # The passed graph captured and replayed: bit-identical to its eager run.
            static = [t.clone() for t in inputs]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                gm(*static)  # warm-up outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = gm(*static)
            for t, src in zip(static, inputs):
                t.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            point["graph_equal"] = all(torch.equal(a, b) for a, b in zip(out, got))
    return point


if __name__ == "__main__":
    main()
