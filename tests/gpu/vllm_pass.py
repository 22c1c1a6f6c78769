#!/usr/bin/env python3
"""vLLM's real compilation-pass modules with arfuse's pass (arfuse.integrations.vllm) on a GPU:
two TP ranks, their CUDA sidecars, Llama-3-8B and 70B hidden sizes, a token sweep that crosses
the fused range.

Per hidden size, two sidecars (--device=cuda, trtllm, --max-tokens=2048) and two rank processes
(tests/frameworks/vllm/pass_rank.py --device cuda): each builds arfuse's pass from vLLM's real
CompilationConfig as vLLM's pass manager does (it attaches in-stream and votes), traces post-grad
FX graphs of vLLM's own ops (torch.ops.vllm.all_reduce, vllm.ir's rms_norm and
fused_add_rms_norm, three layers as a model calls them) at each token count, applies the pass
where vLLM would (the compile ranges inside the sidecar's fused range), and runs the graph
against vLLM's unpassed graph (its all_reduce over gloo: NCCL refuses two ranks on one GPU). A
point passes when, inside the range, all three sites are arfuse's op with no vLLM allreduce or IR
norm left, the outputs agree with vLLM's path within bf16 tolerance and a CUDA-graph replay of
the passed graph is bit-identical to its eager run; beyond the range, the pass is not applied.
The same ranks also pass FP8 graphs (a norm feeding vLLM's static per-tensor FP8 quant, in its
_C-op and native forms): both sites on arfuse's FP8 op, nothing of vLLM's left, the codes within
one E4M3 step of vLLM's and the residual identical; and graphs the pass must leave to vLLM.

What is not vLLM's: the TP group (a stand-in GroupCoordinator over gloo: vLLM's needs its CUDA
extension, whose build is tied to another torch) and xgrammar (vllm_env.py). vLLM's engine,
scheduler and model runner do not run.

  python3 tests/gpu/vllm_pass.py --vllm-src DIR --arfused BIN [--deps DIR] [--hidden 4096,8192]
      [--tokens 1,...] [--json FILE]
  python3 tests/gpu/vllm_pass.py --stage VLLM_SRC DEPS IMPORTS DEST [--stage-skip PKGS]
      [--stage-wheels DIR]
      (copies the files listed in IMPORTS, from pass_rank.py --record-imports, into DEST)

DIR: an unpacked vLLM wheel's .py files (tests/frameworks/vllm/fetch.py). Exit status 0 when every
point passed.
"""
import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(HERE), str(REPO / "client" / "python")]

TOKENS = (1, 2, 16, 64, 512, 2048, 4096)
WORLD = 2


def judge(point, tol, fused_max):
    """Problems of one rank's point (empty: it passed)."""
    t = point["tokens"]
    problems = []
    if point["applicable"] != (t <= fused_max):
        problems.append(f"{t} tokens: pass applicable={point['applicable']}, the fused range "
                        f"is 1..{fused_max}")
    if point["applicable"]:
        if point["after"] != {"arfuse": 3, "all_reduce": 0, "vllm_ir": 0}:
            problems.append(f"{t} tokens: after the pass {point['after']}")
        if not point.get("graph_equal"):
            problems.append(f"{t} tokens: the CUDA graph replay differs from eager")
    for i, (diff, ref) in enumerate(zip(point["max_abs_diff"], point["max_abs_ref"])):
        if diff > tol * (1.0 + ref):
            problems.append(f"{t} tokens: output {i} differs from vLLM's path by {diff:.3g} "
                            f"(max |ref| {ref:.3g})")
    return problems


FP8_FORMS = ("fp8_custom", "fp8_custom_no_group_shape", "fp8_native")
DECLINED = ("quant_nvfp4", "quant_dynamic", "quant_norm_used", "quant_fp32", "gemma", "mixed",
            "partial_first")


def judge_fp8(res):
    """Problems of one rank's FP8 graphs (pass_rank.py: a first-layer and an add-norm site whose
    norm feeds vLLM's static per-tensor FP8 quant, in each of its graph forms) and of the graphs
    the pass must leave alone."""
    problems = []
    for name in FP8_FORMS:
        fp8 = res.get(name)
        if fp8 is None:
            problems.append(f"{name}: no result")
            continue
        if fp8["after"] != {"arfuse": 2, "all_reduce": 0, "vllm_ir": 0} or fp8["left"]:
            problems.append(f"{name}: after the pass {fp8['after']}, left {fp8['left']}")
        if any(s > 1 for s in fp8["codes_max_steps"]):
            problems.append(f"{name}: codes {fp8['codes_max_steps']} E4M3 steps from vLLM's")
        if not all(n > 0 for n in fp8["codes_nonzero"]):
            problems.append(f"{name}: all-zero codes {fp8['codes_nonzero']}")
        if not fp8["residual_equal"]:
            problems.append(f"{name}: the residual differs from vLLM's")
    for name in DECLINED:
        got = res.get(name)
        if got is None or got["matched"] != 0 or got["after"]["arfuse"] != 0:
            problems.append(f"{name}: should be left to vLLM, got {got}")
    return problems


def run_hidden(args, d, hidden):
    from instream_scenarios import Sidecars
    ns = argparse.Namespace(arfused=args.arfused, device="cuda", world=WORLD, gpus=args.gpus,
                            hidden=hidden)
    sc = Sidecars(ns, d, max_tokens=2048, spin_timeout=None)
    try:
        sc.wait_ready()
        env = dict(os.environ)
        procs = []
        for r in range(WORLD):
            argv = [sys.executable, str(REPO / "tests/frameworks/vllm/pass_rank.py"),
                    "--rank", str(r), "--world", str(WORLD), "--init", str(d / f"init{hidden}"),
                    "--socket", str(d / "r{rank}.sock"), "--vllm-src", args.vllm_src,
                    "--hidden", str(hidden), "--dtype", "bf16", "--device", "cuda",
                    "--gpu", str(r % args.gpus), "--sweep", ",".join(map(str, args.tokens)),
                    "--out", str(d / f"rank{r}.{hidden}.json")]
            if args.deps:
                argv += ["--deps", args.deps]
            log = open(d / f"rank{r}.{hidden}.log", "w")
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        for p in procs:
            try:
                p.wait(args.timeout)
            except subprocess.TimeoutExpired:
                p.kill()
        out = {"hidden": hidden, "problems": [], "ranks": []}
        for r in range(WORLD):
            f = d / f"rank{r}.{hidden}.json"
            if not f.exists():
                tail = (d / f"rank{r}.{hidden}.log").read_text()[-3000:]
                out["problems"].append(f"rank {r} left no result (rc {procs[r].returncode}): "
                                       f"{tail}")
                continue
            res = json.loads(f.read_text())
            out["ranks"].append(res)
            if res.get("disabled"):
                out["problems"].append(f"rank {r}: the pass disabled itself: {res.get('status')}")
                continue
            for point in res.get("sweep", []):
                out["problems"] += [f"rank {r}: {p}" for p in
                                    judge(point, args.tol, res["max_token_num"])]
            out["problems"] += [f"rank {r}: {p}" for p in judge_fp8(res)]
        out["ok"] = not out["problems"]
        return out
    finally:
        sc.stop()


def _tops(names):
    """Top-level module names of package paths ("a/b.py" -> "a", "x.py" -> "x")."""
    return {n.split("/")[0].removesuffix(".py") for n in names if n and not n.startswith(".")}


def _dist_tops(info: pathlib.Path):
    record = info / "RECORD"
    if not record.exists():
        return set()
    return _tops(line.split(",")[0] for line in record.read_text().splitlines()
                 if ".dist-info/" not in line.split(",")[0])


def stage(src, deps, imports, dest, skip=(), wheels=None):
    """Copies vLLM's .py files into DEST/src, and the files of its dependencies that pass_rank.py
    loaded (IMPORTS, one path per line) into DEST/deps, with the .dist-info of each dependency staged
    (importlib.metadata reads them). `skip`: top-level packages the target machine has (left
    out, with their metadata). `wheels`: a folder of wheels built for the target's Python, each
    unpacked whole in place of the recorded files of its packages (compiled modules of this
    machine's Python would not load there). Prints the size."""
    import zipfile
    dest = pathlib.Path(dest)
    src, deps = pathlib.Path(src).resolve(), pathlib.Path(deps).resolve()
    replaced = set()
    for whl in sorted(pathlib.Path(wheels).glob("*.whl")) if wheels else ():
        with zipfile.ZipFile(whl) as z:
            replaced |= _tops(n for n in z.namelist() if ".dist-info/" not in n)
            z.extractall(dest / "deps")
    n = size = 0
    # All of vLLM's .py files (a module imported only on CUDA, or lazily, is there too).
    for f in src.rglob("*.py"):
        out = dest / "src" / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, out)
        n, size = n + 1, size + f.stat().st_size
    staged = set()
    for line in pathlib.Path(imports).read_text().split():
        f = pathlib.Path(line)
        if f.is_relative_to(deps):
            rel = f.relative_to(deps)
            top = _tops([rel.as_posix()]).pop()
            if top in skip or top in replaced:
                continue
            staged.add(top)
            out = dest / "deps" / rel
        else:
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, out)
        n, size = n + 1, size + f.stat().st_size
    for info in deps.glob("*.dist-info"):
        if _dist_tops(info) & staged:
            shutil.copytree(info, dest / "deps" / info.name, dirs_exist_ok=True)
    print(f"staged {n} files, {size / 2**20:.1f} MiB, and {len(replaced)} packages from wheels "
          f"in {dest}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-src")
    ap.add_argument("--deps", default=None, help="vLLM's pure-Python dependencies (--target dir)")
    ap.add_argument("--stage", nargs=4, metavar=("VLLM_SRC", "DEPS", "IMPORTS", "DEST"))
    ap.add_argument("--stage-skip", default="",
                    help="top-level packages the target machine has (comma-separated)")
    ap.add_argument("--stage-wheels", default=None,
                    help="wheels for the target's Python, unpacked in place of recorded files")
    ap.add_argument("--arfused", default=os.environ.get("ARFUSE_ARFUSED"))
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--hidden", default="4096,8192")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--tol", type=float, default=2e-2, help="max |out - ref| / (1 + max |ref|)")
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds per hidden size")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.stage:
        stage(*args.stage, skip=set(filter(None, args.stage_skip.split(","))),
              wheels=args.stage_wheels)
        return 0
    if not args.vllm_src or not args.arfused:
        ap.error("--vllm-src and --arfused are required")
    args.tokens = [int(t) for t in args.tokens.split(",")]
    results = []
    for hidden in (int(h) for h in args.hidden.split(",")):
        d = pathlib.Path(tempfile.mkdtemp(prefix=f"arfuse-vllm-{hidden}-"))
        res = run_hidden(args, d, hidden)
        res["dir"] = str(d)
        results.append(res)
        print(f"hidden {hidden}: {'PASS' if res['ok'] else 'FAIL'} "
              f"{'; '.join(res['problems'])[:1500]}", flush=True)
        for rank in res["ranks"][:1]:
            for name in FP8_FORMS:
                f = rank.get(name, {})
                print(f"  {name:26} after {f.get('after')}  codes_max_steps "
                      f"{f.get('codes_max_steps')}  codes_differ {f.get('codes_differ')}  "
                      f"residual_equal {f.get('residual_equal')}", flush=True)
            for p in rank.get("sweep", []):
                print(f"  {p['tokens']:5d} tokens  pass {'on ' if p['applicable'] else 'off'}  "
                      f"after {p['after']}  max|diff| {max(p['max_abs_diff']):.3g}  "
                      f"graph_equal {p.get('graph_equal')}", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
