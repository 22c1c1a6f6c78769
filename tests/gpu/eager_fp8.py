#!/usr/bin/env python3
"""The FP8 patterns on the eager and doorbell planes with CUDA sidecars, against the in-stream op.

Two arfused --device=cuda (bf16, hidden 8192, 256 tokens) and two rank processes (torch). Every
rank runs, for hidden 4096 and 8192, tokens 1-256 and every FP8 case (static with and without
norm_out, per token, per group in each scale layout), the op twice on the same inputs:
arfuse.allreduce_fusion over a registered CudaBuffer (Fusion.Execute, the sidecar's launch) and
arfuse.torch.fused_allreduce_residual_rmsnorm_fp8 (the in-stream launch); and, up to 64 tokens,
through a doorbell plan over the same tensors rung once with arfuse.ring (the sidecar's serving
kernel, or the indirect launch behind it). Each of the eager and the doorbell op is one row;
each row checks against the in-stream op:
  - residual_out identical, and norm_out where given;
  - the codes within one E4M3 step of each other and the scales equal (UE8M0: one exponent);
  - the eager codes, dequantized, the fp32 normalized value to E4M3's precision;
  - the same bytes on both ranks.
Exit status 0 when every op passed (an op of more than 64 tokens the sidecar does not serve is
reported, not failed, unless --all-served). Beyond 64 tokens the dispatcher may send an eager op
down the unfused path (NCCL, then the add-RMSNorm kernel's FP8 epilogue): with --gpus 2 NCCL is
there, so --all-served checks the unfused path's bytes against the in-stream (fused) op's too.
JSON with every row: --json.
  python3 tests/gpu/eager_fp8.py --arfused BIN [--gpus 1] [--all-served] [--no-doorbell]
      [--json FILE]
"""
import argparse
import hashlib
import json
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "client" / "python"))
sys.path.insert(0, str(REPO / "tests" / "gpu"))

EPS = 1e-6
HIDDENS = (4096, 8192)
TOKENS = (1, 3, 16, 64, 128, 256)
DOORBELL_MAX_TOKENS = 64  # the doorbell rows' shapes: a decode batch
STATIC_SCALE = 0.05
# (FlashInfer-numbered pattern name, arfuse.torch's quant, scale layout, norm_out given)
CASES = (("kARResidualRMSNormFP8Quant", "static", None, False),
         ("kARResidualRMSNormOutFP8Quant", "static", None, True),
         ("kARResidualRMSNormFP8PerToken", "per_token", None, False),
         ("kARResidualRMSNormFP8PerGroup", "per_group", "fp32_row_major", True),
         ("kARResidualRMSNormFP8PerGroup", "per_group", "fp32_mn_major", False),
         ("kARResidualRMSNormFP8PerGroup", "per_group", "ue8m0_packed", False))


def worker(args):
    import torch
    import arfuse
    import arfuse.torch as aft
    from arfuse import instream, ring

    torch.cuda.set_device(args.gpu)
    dev = torch.device("cuda", args.gpu)
    client = arfuse.Client(args.socket, client_name=f"eager-fp8-{args.rank}")
    client.wait_ready(90)
    ws = arfuse.FusionWorkspace(client)
    hmax, tmax = max(HIDDENS), max(TOKENS)
    n = tmax * hmax
    scale_words = instream.fp8_scale_elements("per_group", tmax, hmax, "fp32_mn_major")
    sizes = [("x", 2 * n), ("res", 2 * n), ("res_out", 2 * n), ("norm", 2 * n), ("g", 2 * hmax),
             ("q", n), ("s", 4 * max(scale_words, tmax)), ("static", 16)]
    offsets, off = {}, 0
    for name, nb in sizes:
        offsets[name] = off
        off += (nb + 255) // 256 * 256
    buf = arfuse.CudaBuffer(off, device=args.gpu)
    ws.register(buf, "fp8")
    values = torch.empty(256, dtype=torch.float64)
    for c in range(256):
        e, m = (c >> 3) & 15, c & 7
        v = m * 2.0 ** -9 if e == 0 else (8 + m) * 2.0 ** (e - 10)
        values[c] = float("nan") if (c & 0x7f) == 0x7f else (-v if c & 0x80 else v)
    values = values.to(dev)
    def view(name, dtype, shape):
        return buf.tensor(dtype, shape, offsets[name])

    def inputs(hidden, tokens):
        x = view("x", torch.bfloat16, (tokens, hidden))
        res = view("res", torch.bfloat16, (tokens, hidden))
        g = view("g", torch.bfloat16, (hidden,))
        static = view("static", torch.float32, (1,))
        gen = torch.Generator(device="cpu").manual_seed(1000 * hidden + tokens)
        own = torch.Generator(device="cpu").manual_seed(7 * hidden + tokens + 31 * args.rank)
        x.copy_(torch.randn(tokens, hidden, generator=own).bfloat16())
        res.copy_(torch.randn(tokens, hidden, generator=gen).bfloat16())
        g.copy_((1 + 0.2 * torch.randn(hidden, generator=gen)).bfloat16())
        static.fill_(STATIC_SCALE)
        return x, res, g, static

    def poison(tokens, hidden, words):
        """Every output of the shape's op to 0xee, so an output an op never wrote is caught."""
        for name, n in (("res_out", 2 * tokens * hidden), ("norm", 2 * tokens * hidden),
                        ("q", tokens * hidden), ("s", 4 * max(words, 1))):
            view(name, torch.uint8, (n,)).fill_(0xee)

    def run_doorbell(x, res, res_out, norm, g, pattern, q, scale, layout, tokens, words):
        """One op through a doorbell plan over the same tensors: its outputs, or why not."""
        poison(tokens, x.shape[1], words)
        try:
            plan = ws.create_plan(x, residual_in=res, residual_out=res_out, norm_out=norm,
                                  rms_gamma=g, rms_eps=EPS, doorbell=True,
                                  pattern=getattr(arfuse.AllReduceFusionPattern, pattern),
                                  quant_out=q, scale=scale, scale_layout=layout)
        except arfuse.ArfuseError as e:
            return f"doorbell plan refused: {e}"
        try:
            bell = ring.DoorbellRing.open(plan.doorbell, name="fp8")
            try:
                bell.ring(torch.cuda.current_stream().cuda_stream, tokens)
                torch.cuda.synchronize()
                bell.check()
            finally:
                bell.close()
        finally:
            client.destroy_plan(plan)
        s = view("s", torch.float32, (max(words, 1),))
        return (res_out.clone(), q.clone(), s[:words].clone(),
                norm.clone() if norm is not None else None)

    shapes = [(h, t, c) for h in HIDDENS for t in TOKENS for c in CASES]
    # The eager plane first: a workspace with an in-stream attachment serves only its clients.
    eager = {}
    for hidden, tokens, case in shapes:
        pattern, quant, layout, with_norm = case
        x, res, g, static = inputs(hidden, tokens)
        res_out = view("res_out", torch.bfloat16, (tokens, hidden))
        norm = view("norm", torch.bfloat16, (tokens, hidden))
        q = view("q", torch.uint8, (tokens, hidden))
        words = instream.fp8_scale_elements(quant, tokens, hidden, layout)
        s = view("s", torch.float32, (max(words, 1),))
        poison(tokens, hidden, words)
        kw = dict(scale_factor=static) if quant == "static" else dict(scale_out=s)
        out = arfuse.allreduce_fusion(
            input=x, workspace=ws, pattern=getattr(arfuse.AllReduceFusionPattern, pattern),
            residual_in=res, residual_out=res_out, norm_out=norm if with_norm else None,
            rms_gamma=g, rms_eps=EPS, quant_out=q, scale_layout=layout, **kw)
        torch.cuda.synchronize()
        ws.check()
        eager[("eager", hidden, tokens, case)] = str(ws.unavailable_reason) if out is None else (
            res_out.clone(), q.clone(), s[:words].clone(), norm.clone())
        if args.doorbell and tokens <= DOORBELL_MAX_TOKENS:
            eager[("doorbell", hidden, tokens, case)] = run_doorbell(
                x, res, res_out, norm if with_norm else None, g, pattern, q,
                static if quant == "static" else s, layout, tokens, words)
    aft.attach(client, list(HIDDENS))
    rows = []
    for hidden, tokens, case in shapes:
        pattern, quant, layout, with_norm = case
        words = instream.fp8_scale_elements(quant, tokens, hidden, layout)
        x, res, g, static = inputs(hidden, tokens)
        iq, ires, iscale = aft.fused_allreduce_residual_rmsnorm_fp8(
            x, res, g, EPS, quant, layout, static if quant == "static" else None)
        torch.cuda.synchronize()
        aft.check()
        for plane in ("eager", "doorbell"):
            if (plane, hidden, tokens, case) not in eager:
                continue
            row = {"plane": plane, "hidden": hidden, "tokens": tokens, "pattern": pattern,
                   "layout": layout, "norm_out": with_norm}
            rows.append(row)
            check_row(row, eager[(plane, hidden, tokens, case)], iq, ires, iscale, quant, layout,
                      with_norm, hidden, tokens, words, g, values)
    aft.detach()
    client.close()
    print(json.dumps({"rank": args.rank, "rows": rows}), flush=True)


def check_row(row, got, iq, ires, iscale, quant, layout, with_norm, hidden, tokens, words, g,
              values):
    """Fills `row` with the plane's outputs (`got`) against the in-stream op's."""
    import torch
    if isinstance(got, str):
        row["outcome"], row["reason"] = f"{row['plane']}_not_served", got
        return
    e_res, e_q, e_s, e_norm = got
    if iq is None:
        row["outcome"] = "instream_not_served"
        return
    iq = iq.view(torch.uint8)
    flat = iscale.flatten() if quant != "per_group" or layout == "fp32_row_major" \
        else torch.as_strided(iscale, (words,), (1,))
    row["residual_equal"] = bool(torch.equal(e_res, ires))
    if with_norm:
        y = e_res.float()
        ref_norm = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + EPS) *
                    g.float()).bfloat16()
        row["norm_max_diff"] = float((e_norm.float() - ref_norm.float()).abs().max())
    # E4M3 codes of one sign are ordered by magnitude: one step apart is one code.
    diff = (e_q.int() - iq.int()).abs()
    row["codes_off_by_more_than_one"] = int((diff > 1).sum())
    row["codes_differing"] = int((diff != 0).sum())
    if quant == "static":
        row["scale_equal"] = True
    elif layout == "ue8m0_packed":
        eb = e_s.view(torch.uint8).int()
        ib = flat.contiguous().view(torch.uint8).int()
        row["scale_equal"] = bool(((eb - ib[:eb.numel()]).abs() <= 1).all())
    else:
        row["scale_equal"] = bool(torch.allclose(e_s, flat.float(), rtol=1e-6, atol=0))
    # The eager codes, dequantized, against the fp32 normalized value.
    if quant == "static" or layout == "fp32_row_major" or quant == "per_token":
        y = e_res.double()
        xn = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + EPS) * g.double()
        if quant == "static":
            per = torch.full_like(xn, STATIC_SCALE)
        else:
            sc = e_s.double().reshape(tokens, -1)
            per = sc.repeat_interleave(hidden // sc.shape[1], dim=1)
        dq = values[e_q.long()] * per
        sat = xn.abs() > 448 * per
        bound = (2 ** -4 + 1e-3) * xn.abs() + per * 2 ** -9
        bad = ((dq - xn).abs() > bound) & ~sat
        bad |= sat & ((dq.abs() - 448 * per).abs() > 1e-9 * per)
        row["dequant_out_of_bound"] = int(bad.sum())
    row["digest"] = hashlib.sha256(
        e_q.cpu().numpy().tobytes() + e_s.cpu().numpy().tobytes() +
        e_res.view(torch.int16).cpu().numpy().tobytes()).hexdigest()[:16]
    row["ok"] = (row["residual_equal"] and row["codes_off_by_more_than_one"] == 0 and
                 row["scale_equal"] and row.get("dequant_out_of_bound", 0) == 0 and
                 row.get("norm_max_diff", 0.0) <= 2 ** -6 * 8)
    row["outcome"] = "ok" if row["ok"] else "mismatch"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arfused")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--all-served", action="store_true",
                    help="fail on any op not served (the unfused path too: needs --gpus 2)")
    ap.add_argument("--no-doorbell", dest="doorbell", action="store_false",
                    help="leave out the doorbell rows")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--socket")
    ap.add_argument("--gpu", type=int, default=0)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from instream_scenarios import Sidecars
    d = pathlib.Path(tempfile.mkdtemp(prefix="arfuse-eager-fp8-"))
    ns = argparse.Namespace(arfused=args.arfused, device="cuda", gpus=args.gpus, world=2,
                            hidden=max(HIDDENS))
    sc = Sidecars(ns, d, max_tokens=max(TOKENS), spin_timeout=None)
    try:
        sc.wait_ready()
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--rank", str(r),
                                   "--socket", str(d / f"r{r}.sock"), "--gpu",
                                   str(r % args.gpus)] + ([] if args.doorbell else
                                                          ["--no-doorbell"]),
                                  stdout=subprocess.PIPE, text=True)
                 for r in range(2)]
        outs = []
        for r, p in enumerate(procs):
            text, _ = p.communicate(timeout=500)
            lines = [ln for ln in text.splitlines() if ln.startswith("{")]
            outs.append(json.loads(lines[-1]) if lines else {"rank": r, "rows": [],
                                                             "exit": p.returncode})
    finally:
        sc.stop()
    rows0, rows1 = outs[0]["rows"], outs[1]["rows"]
    failed = 0
    for a, b in zip(rows0, rows1):
        same = a.get("digest") is not None and a.get("digest") == b.get("digest")
        a["ranks_equal"] = same
        status = "PASS" if a.get("outcome") == "ok" and b.get("outcome") == "ok" and same \
            else a.get("outcome")
        # Beyond 64 tokens the dispatcher may send an op down the unfused path, which needs NCCL
        # (one GPU per rank): without it the op is not served (allreduce_fusion returns None),
        # reported, not a failure, unless --all-served. Up to 64 tokens every op must be served.
        allowed = status.endswith("not_served") and a["tokens"] > 64 and \
            a.get("outcome") == b.get("outcome") and not args.all_served
        failed += status != "PASS" and not allowed
        print(f"{status:18} {a.get('plane', ''):8} hidden {a['hidden']:5} tokens {a['tokens']:4} "
              f"{a['pattern']:30} "
              f"{a['layout'] or '':15} norm_out {int(a['norm_out'])} "
              f"codes_differing {a.get('codes_differing', '-')} "
              f"beyond_one_step {a.get('codes_off_by_more_than_one', '-')} "
              f"dequant_bad {a.get('dequant_out_of_bound', '-')} "
              f"{a.get('reason', '')}")
    if len(rows0) != len(rows1) or not rows0:
        print(f"FAIL: rows {len(rows0)} and {len(rows1)} ({outs})")
        failed += 1
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(outs, indent=1))
    print(f"{'PASS' if not failed else 'FAIL'}: {len(rows0) - failed}/{len(rows0)} rows")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
