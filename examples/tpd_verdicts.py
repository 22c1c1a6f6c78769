"""tp_decode's verdicts (no torch): judging each scenario from the ranks' result files, and
the summary the launcher prints (checks, negotiation, the plane, the perf table).
"""
import json
import os
from typing import Dict, List

from tpd_common import PROG, model_config
from tpd_planes import EAGER_BANNER


def rank_checks(res: dict) -> List[dict]:
    """A rank's checks: the model's (tokens, logits, decode plane) and the setup-only run's."""
    return list(res.get("checks", [])) + list((res.get("setup") or {}).get("checks", []))


def judge_normal(args, scenario: str, results: Dict[int, dict], verdict: dict):
    problems = verdict["problems"]
    for r, res in results.items():
        if res.get("exit_code") != 0 or res.get("status") != "pass":
            problems.append(f"rank {r}: {res.get('status')} (exit {res.get('exit_code')})"
                            + (f": {res['error']}" if res.get("error") else ""))
        for c in rank_checks(res):
            if not c.get("ok"):
                problems.append(f"rank {r}: check {c.get('name')}: {c.get('message')}")
    planes = {r: (res.get("execution") or {}).get("decode_plane") for r, res in results.items()
              if res.get("execution")}
    if len(set(planes.values())) > 1:
        problems.append("ranks decode on different planes: " +
                        ", ".join(f"rank {r}: {p}" for r, p in sorted(planes.items())))
    toks = {r: res.get("tokens") for r, res in results.items() if res.get("tokens") is not None}
    if len(toks) > 1 and len({json.dumps(t) for t in toks.values()}) != 1:
        problems.append("ranks decoded different tokens")
    if scenario == "off":
        for r, res in results.items():
            ex = res.get("execution") or {}
            if ex.get("fused"):
                problems.append(f"rank {r}: fusion still on with "
                                "--enforce-disable-flashinfer-allreduce-fusion")
    verdict["ok"] = not problems


def judge_kill(args, folder: str, results: Dict[int, dict], procs, verdict: dict):
    problems = verdict["problems"]
    try:
        with open(os.path.join(folder, "kill.json")) as f:
            kill = json.load(f)
    except (OSError, ValueError):
        problems.append("the fault was never injected (the run failed or ended before it)")
        for r, res in results.items():
            if res.get("error"):
                problems.append(f"rank {r}: {res['error']}")
        verdict["ok"] = False
        return
    verdict["kill"] = kill
    killed = kill["rank"]
    bound = args.op_timeout + 10.0
    stops = {}
    for r, res in results.items():
        code = res.get("exit_code")
        at = procs.exit_at.get(r)
        stops[r] = round(at - kill["time"], 2) if at else None
        if code == 0:
            problems.append(f"rank {r} exited 0 although rank {killed}'s sidecar was killed")
        elif code is None or code < 0:
            problems.append(f"rank {r} was killed by the launcher (did not stop by itself)")
        if not res.get("error"):
            problems.append(f"rank {r} stopped without an error message")
        if stops[r] is None or stops[r] > bound:
            problems.append(f"rank {r} stopped {stops[r]} s after the kill (bound: op deadline "
                            f"{args.op_timeout:g} s + 10 s)")
    named = [r for r, res in results.items() if f"rank {killed}" in (res.get("error") or "")]
    if killed not in named:
        problems.append(f"rank {killed}'s own error does not name it")
    verdict["stop_seconds"] = stops
    verdict["ok"] = not problems


def print_perf(perf: dict, cfg_line: str):
    if not perf or not perf.get("rows"):
        return
    print(f"\n{PROG}: decode step ({cfg_line})")
    print(f"  {'path':<34} {'graph':<10} {'plane':<10} {'p50 ms':>8} {'p90 ms':>8} "
          f"{'tok/s':>9}")
    for row in perf["rows"]:
        print(f"  {row['name']:<34} {row['graph']:<10} {row['plane']:<10} {row['p50_ms']:>8.3f} "
              f"{row['p90_ms']:>8.3f} {row['tokens_per_s']:>9.0f}")
    for line in perf.get("summary", []):
        print(f"  {line}")
    print()


def summarize(args, verdicts: List[dict], device: str, gpus: int) -> bool:
    all_ok = True
    cfg = model_config(args)
    for v in verdicts:
        ok = v["ok"]
        all_ok &= ok
        detail = ""
        r0 = v["ranks"].get(0, {})
        if v["scenario"] == "kill" and "kill" in v:
            errs = " | ".join((res.get("error") or f"rank {r}: no error")[:240]
                              for r, res in v["ranks"].items())
            detail = (f"rank {v['kill']['rank']}'s sidecar killed before step "
                      f"{v['kill']['step']}; ranks stopped after {v.get('stop_seconds')} s "
                      f"(op deadline {args.op_timeout:g} s); {errs}")
        elif ok:
            checks = r0.get("checks", [])
            detail = "; ".join(f"{c['name']}: {c['message']}" for c in checks)
            if not detail and r0.get("setup"):
                st = r0["setup"]
                detail = (f"setup-only: plane {st.get('plane')}, {st.get('plans')} plans, "
                          f"{st.get('attached')} attachment(s), {st.get('sites_fused')}/"
                          f"{st.get('sites')} sites fused, {st.get('ops')} ops, "
                          f"{st.get('checked_values')} values checked")
                extra = "; ".join(f"{c['name']}: {c['message']}" for c in st.get("checks", []))
                detail += f"; {extra}" if extra else ""
        print(f"{PROG}: scenario {v['scenario']}: {'PASS' if ok else 'FAIL'} "
              f"({v.get('seconds')} s){': ' + detail if detail else ''}")
        for p in v["problems"]:
            print(f"{PROG}:   problem: {p}")
        for r, tail in (v.get("sidecar_logs") or {}).items():
            print(tail)
        ex = r0.get("execution")
        neg = r0.get("negotiation")
        if neg:
            print(f"{PROG}:   negotiated: backend={neg['backend']} fusion="
                  f"{'on' if neg['fusion_enabled'] else 'off'} cuda_graph_mode="
                  f"{neg['cuda_graph_mode']} data_plane={neg['data_plane']} "
                  f"mps={neg.get('mps_detected')}")
        if ex:
            print(f"{PROG}:   ran: decode graph={ex['decode_graph']} plane={ex['decode_plane']} "
                  f"op_in_graph={ex['op_in_graph']}")
            if ex.get("fused") and ex.get("decode_plane") == "eager":
                print(f"{PROG}:   {EAGER_BANNER}")
        if r0.get("perf"):
            print_perf(r0["perf"], f"batch {cfg.batch}, {cfg.layers} layers, hidden "
                                   f"{cfg.hidden}, tp {args.ranks}, {device}"
                                   + (f" x{gpus}" if device == "cuda" else ""))
    print(f"{PROG}: {'PASS' if all_ok else 'FAIL'}")
    return all_ok

