"""The numerics oracle (docs/numerics.md): the torch side of `tp_decode.py --oracle JSON`
(oracle.py).

The same weights (tp_model.generate_weights, from --seed) run four ways on the same prompt:

  (a) arfuse: the tensor-parallel model with its fused op on the negotiated plane;
  (b) the framework path: the same tensor-parallel model with torch.distributed all_reduce +
      residual add + RMSNorm (NCCL with a GPU per rank; gloo when ranks share a GPU);
  (c) fp32 on one GPU: the whole model, unsharded, in fp32 (rank 0);
  (d) Hugging Face transformers' own LlamaForCausalLM, built from the same config and weights,
      in fp32 (rank 0): an implementation nobody here wrote, to check (c).

Decode is teacher-forced on (c)'s greedy tokens, so every implementation sees the same sequence
and every position is comparable. Per layer (the residual stream after it, at every prefill and
decode position) and at the logits, the report gives each implementation's distance from (c):
relative L2 (||x - c|| / ||c||) and max |x - c|. The criterion: arfuse's distance from (c) is at
most (1 + --oracle-slack) x the framework path's, per layer and at the logits. Tokens: at every
decode position the argmax of (a), (b) and (d) is compared with (c)'s; a difference where (c)'s
top-2 logit gap is below --tie-tol counts as a tie, any other as a mismatch. Rank 0 writes the
JSON and prints the table; the run passes when the criterion holds, (a) has no token mismatch,
and (d) agrees with (c) (when it ran).
"""
import dataclasses
import json
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

import tp_model as tm
from tpd_common import log
from tpd_planes import report_eager_decode

# (d) must match (c) this closely at the logits (fp32 both, different operation order).
REFERENCE_REL_L2 = 1e-4


def distance(x: torch.Tensor, ref: torch.Tensor) -> Dict[str, float]:
    x, ref = x.double(), ref.double()
    d = x - ref
    return {"rel_l2": float(d.norm() / ref.norm().clamp_min(1e-30)),
            "max_abs": float(d.abs().max()), "ref_max_abs": float(ref.abs().max())}


def compare_tokens(ref_logits: torch.Tensor, got_logits: torch.Tensor, tie_tol: float,
                   limit: int = 20) -> dict:
    """Argmax per position ([steps, batch, vocab]); ties where the reference's top-2 gap is
    below tie_tol."""
    top2 = ref_logits.topk(2, dim=-1)
    ref_tok = top2.indices[..., 0]
    gap = top2.values[..., 0] - top2.values[..., 1]
    got_tok = got_logits.argmax(-1)
    equal = ref_tok == got_tok
    tie = ~equal & (gap < tie_tol)
    mismatch = ~equal & ~tie
    details = []
    for kind, mask in (("mismatch", mismatch), ("tie", tie)):
        for s, b in mask.nonzero().tolist()[:limit]:
            details.append({"kind": kind, "step": s, "seq": b, "reference": int(ref_tok[s, b]),
                            "got": int(got_tok[s, b]), "reference_top2_gap": float(gap[s, b]),
                            "got_logit_gap": float(got_logits[s, b, got_tok[s, b]] -
                                                   got_logits[s, b, ref_tok[s, b]])})
    return {"positions": int(equal.numel()), "equal": int(equal.sum()), "ties": int(tie.sum()),
            "mismatches": int(mismatch.sum()), "details": details}


def fp32_reference(ctx, prompt) -> tm.PassResult:
    """(c): the whole model in fp32 on this rank's device, greedy, with per-layer taps."""
    cfg, device = ctx.cfg, prompt.device
    w = tm.Weights(cfg, 0, 1, device, torch.float32)
    m = tm.TPModel(cfg, w, None, ctx.layout, 0, 1, device, torch.float32)
    taps = [torch.zeros(ctx.layout.max_tokens, cfg.hidden, device=device)
            for _ in range(cfg.layers)]
    comm = tm.TapComm(tm.FrameworkComm(m, "gloo", local=True), taps)
    r = tm.run_pass(ctx, m, prompt, "(c) fp32 on one GPU", comm, comm, "none", taps=taps)
    del m, w, taps
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return r


def transformers_pass(ctx, prompt, forced: torch.Tensor) -> tm.PassResult:
    """(d): transformers' LlamaForCausalLM in fp32 with the same weights, teacher-forced."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg, device = ctx.cfg, prompt.device
    hc = LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden,
                     intermediate_size=cfg.intermediate, num_hidden_layers=cfg.layers,
                     num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                     head_dim=cfg.head_dim, max_position_embeddings=max(cfg.max_seq, 128),
                     rms_norm_eps=cfg.eps, tie_word_embeddings=False, attention_bias=False,
                     mlp_bias=False, hidden_act="silu", attn_implementation="eager")
    # Our rotary embedding is Llama's default one with theta 10000 (the config's default).
    theta = getattr(hc, "rope_theta", None)
    if theta is None:
        theta = (getattr(hc, "rope_parameters", None) or {}).get("rope_theta")
    if theta is not None and float(theta) != 10000.0:
        raise RuntimeError(f"transformers' LlamaConfig defaults to rope theta {theta}, the model "
                           "here uses 10000")
    t0 = time.perf_counter()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(hc)
    finally:
        torch.set_default_dtype(prev)
    model.float().eval()
    with torch.no_grad():
        for item in tm.generate_weights(cfg, device):
            if item[0] == "embed":
                model.model.embed_tokens.weight.copy_(item[1])
            elif item[0] == "layer":
                layer, w = model.model.layers[item[1]], item[2]
                a, mlp = layer.self_attn, layer.mlp
                for mod, key in ((a.q_proj, "q"), (a.k_proj, "k"), (a.v_proj, "v"),
                                 (a.o_proj, "o"), (mlp.gate_proj, "gate"), (mlp.up_proj, "up"),
                                 (mlp.down_proj, "down")):
                    mod.weight.copy_(w[key])
                layer.input_layernorm.weight.copy_(w["input_norm"])
                layer.post_attention_layernorm.weight.copy_(w["post_norm"])
            elif item[0] == "final_norm":
                model.model.norm.weight.copy_(item[1])
            else:
                model.lm_head.weight.copy_(item[1])
    captured: List[List[torch.Tensor]] = [[] for _ in range(cfg.layers)]

    def hook(layer):
        def fn(module, inputs, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            captured[layer].append(out.reshape(-1, cfg.hidden).to(device="cpu",
                                                                  dtype=torch.float32,
                                                                  copy=True))
        return fn

    handles = [model.model.layers[i].register_forward_hook(hook(i)) for i in range(cfg.layers)]
    # The KV cache's argument: `cache` in newer transformers, `past_key_values` before.
    import inspect

    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else \
        "past_key_values"
    logits = []
    try:
        with torch.no_grad():
            out = model(input_ids=prompt, use_cache=True)
            logits.append(out.logits[:, -1].float().cpu())
            past = getattr(out, cache_kw)
            for s in range(1, cfg.steps):
                out = model(input_ids=forced[s - 1].to(device)[:, None], use_cache=True,
                            **{cache_kw: past})
                logits.append(out.logits[:, -1].float().cpu())
                past = getattr(out, cache_kw)
    finally:
        for h in handles:
            h.remove()
    lg = torch.stack(logits)
    r = tm.PassResult("(d) transformers LlamaForCausalLM fp32", "none", "-", lg.argmax(-1), lg,
                      time.perf_counter() - t0, [torch.cat(c) for c in captured])
    del model, past, out
    if device.type == "cuda":
        torch.cuda.empty_cache()
    log(f"pass {r.name}: {cfg.steps} positions x {cfg.batch} sequences in {r.seconds:.2f} s",
        ctx.rank)
    return r


def report(ctx, ref: tm.PassResult, runs: Dict[str, tm.PassResult], hf_note: str) -> dict:
    cfg, args = ctx.cfg, ctx.args
    slack = args.oracle_slack
    layers = []
    for layer in range(cfg.layers):
        row = {"layer": layer}
        for key, r in runs.items():
            row[key] = distance(r.taps[layer], ref.taps[layer])
        a, b = row["arfuse"]["rel_l2"], row["framework"]["rel_l2"]
        row["arfuse_over_framework"] = a / b if b > 0 else (0.0 if a == 0 else float("inf"))
        row["ok"] = a <= (1.0 + slack) * b
        layers.append(row)
    logits = {key: distance(r.logits, ref.logits) for key, r in runs.items()}
    la, lb = logits["arfuse"]["rel_l2"], logits["framework"]["rel_l2"]
    logits["arfuse_over_framework"] = la / lb if lb > 0 else (0.0 if la == 0 else float("inf"))
    logits["ok"] = la <= (1.0 + slack) * lb
    tokens = {key: compare_tokens(ref.logits, r.logits, args.tie_tol) for key, r in runs.items()}
    reference_ok = None
    if "transformers" in runs:
        reference_ok = logits["transformers"]["rel_l2"] <= REFERENCE_REL_L2
    criterion_ok = all(r["ok"] for r in layers) and logits["ok"]
    ok = criterion_ok and tokens["arfuse"]["mismatches"] == 0 and reference_ok is not False
    return {
        "what": "numerics oracle: distance from (c) fp32 on one GPU, per layer and at the logits",
        "command": " ".join(sys.argv), "model": dataclasses.asdict(cfg),
        "world_size": ctx.world, "device": ctx.device,
        "negotiation": ctx.result.get("negotiation"), "execution": ctx.result.get("execution"),
        "implementations": {"arfuse": runs["arfuse"].name, "framework": runs["framework"].name,
                            "reference": ref.name,
                            "transformers": runs["transformers"].name if "transformers" in runs
                            else hf_note},
        "positions_per_layer": int(ref.taps[0].shape[0]),
        "criterion": {"rule": "arfuse rel_l2 <= (1 + slack) * framework rel_l2, per layer and "
                              "at the logits", "slack": slack, "ok": criterion_ok,
                      "layers_failing": [r["layer"] for r in layers if not r["ok"]]},
        "reference_check": {"transformers_vs_fp32_logits_rel_l2":
                            logits.get("transformers", {}).get("rel_l2"),
                            "bound": REFERENCE_REL_L2, "ok": reference_ok},
        "tie_tol": args.tie_tol, "layers": layers, "logits": logits, "tokens": tokens,
        "ok": ok}


def print_report(rep: dict):
    keys = [k for k in ("arfuse", "framework", "transformers") if k in rep["logits"]]
    print(f"\n{'layer':>5} " + " ".join(f"{k + ' rel_l2':>22}" for k in keys) +
          f" {'arfuse/framework':>17} {'ok':>4}")
    for row in rep["layers"]:
        print(f"{row['layer']:>5} " + " ".join(f"{row[k]['rel_l2']:>22.4e}" for k in keys) +
              f" {row['arfuse_over_framework']:>17.3f} {'yes' if row['ok'] else 'NO':>4}")
    lg = rep["logits"]
    print(f"{'logit':>5} " + " ".join(f"{lg[k]['rel_l2']:>22.4e}" for k in keys) +
          f" {lg['arfuse_over_framework']:>17.3f} {'yes' if lg['ok'] else 'NO':>4}")
    print("  max |logit - fp32|: " + ", ".join(f"{k} {lg[k]['max_abs']:.4g}" for k in keys) +
          f" (max |logit| {lg['arfuse']['ref_max_abs']:.4g})")
    for k in keys:
        t = rep["tokens"][k]
        print(f"  tokens {k}: {t['equal']}/{t['positions']} equal, {t['ties']} ties (top-2 gap "
              f"< {rep['tie_tol']:g}), {t['mismatches']} mismatches")
    rc = rep["reference_check"]
    if rc["ok"] is not None:
        print(f"  reference check: transformers vs fp32 logits rel_l2 "
              f"{rc['transformers_vs_fp32_logits_rel_l2']:.3g} (bound {rc['bound']:g}): "
              f"{'ok' if rc['ok'] else 'DISAGREE'}")
    print(f"  criterion ({rep['criterion']['rule']}, slack {rep['criterion']['slack']:g}): "
          f"{'met' if rep['criterion']['ok'] else 'NOT met'}; oracle "
          f"{'PASS' if rep['ok'] else 'FAIL'}\n", flush=True)


def want_transformers(mode: str) -> Optional[str]:
    """None when (d) runs; else why not."""
    if mode == "off":
        return "not run (--oracle-hf off)"
    try:
        import transformers  # noqa: F401
        return None
    except ImportError as e:
        if mode == "on":
            raise
        return f"not run (transformers not importable: {e})"


def run_rank(ctx) -> bool:
    args, cfg, rank = ctx.args, ctx.cfg, ctx.rank
    rs = tm.setup_rank(ctx)
    ex, model, fw = rs.ex, rs.model, rs.fw
    checks = report_eager_decode(ex, ctx.allow_eager_decode, rank)
    prompt = tm.make_prompt(cfg, rs.device)
    # (c) first: its greedy tokens drive every other implementation (teacher forcing).
    ref = fp32_reference(ctx, prompt) if rank == 0 else None
    box = [ref.tokens.tolist() if ref is not None else None]
    dist.broadcast_object_list(box, src=0)
    forced = torch.tensor(box[0], dtype=torch.long)
    taps = [torch.zeros(ctx.layout.max_tokens, cfg.hidden, device=rs.device,
                        dtype=model.dtype) for _ in range(cfg.layers)] if rank == 0 else None

    def tapped(comm):
        return tm.TapComm(comm, taps) if taps is not None else comm

    runs = {}
    runs["arfuse"] = tm.run_pass(ctx, model, prompt, "(a) arfuse" if ex.fused else
                                 "(a) arfuse (fusion off)", tapped(rs.prefill_comm),
                                 tapped(rs.decode_comm), ex.decode_graph, forced=forced,
                                 taps=taps)
    runs["framework"] = tm.run_pass(ctx, model, prompt, f"(b) framework ({rs.backend})",
                                    tapped(fw), tapped(fw), rs.ref_mode, forced=forced, taps=taps)
    ctx.result["tokens"] = runs["arfuse"].tokens.tolist()
    rs.release(ctx.client)
    ok = True
    if rank == 0:
        hf_note = want_transformers(args.oracle_hf)
        if hf_note is None:
            del model
            runs["transformers"] = transformers_pass(ctx, prompt, forced)
        rep = report(ctx, ref, runs, hf_note or "")
        with open(args.oracle, "w") as f:
            json.dump(rep, f, indent=1, default=str)
        print_report(rep)
        log(f"oracle report written to {args.oracle}", rank)
        ok = rep["ok"]
        checks.append({"name": "oracle", "ok": ok,
                       "message": f"criterion {'met' if rep['criterion']['ok'] else 'NOT met'}"
                                  f" (logits arfuse/framework "
                                  f"{rep['logits']['arfuse_over_framework']:.3f}); arfuse tokens "
                                  f"{rep['tokens']['arfuse']['mismatches']} mismatches, "
                                  f"{rep['tokens']['arfuse']['ties']} ties; {args.oracle}"})
    ctx.result["checks"] = checks
    dist.barrier()
    return ok and all(c["ok"] for c in checks)
