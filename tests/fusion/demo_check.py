#!/usr/bin/env python3
"""Runs arfuse-demo and checks what it printed (the ctests of tests/fusion/CMakeLists.txt).

usage: demo_check.py [--rc=N] [--text=T ...] [--planes=P,Q] [--path=PATH] [--skipped=TEXT]
                     -- ARFUSE-DEMO [FLAGS...]

--rc       the exit code the demo must return (default 0)
--text     a text its output (stdout and stderr) must contain (repeatable)
--planes   the demo runs with --json: the planes its JSON must list, in this order; every shape
           must have one row per plane in that order, every row ok; the in-stream row's cost
           against itself is 1, every other row's is its us/op over the in-stream row's
--path     with --planes: the path every in-stream row that ran must report
--skipped  with --planes: every in-stream row is skipped (not failed) with a reason containing
           TEXT, and no other row is compared with it; without it no row may be skipped
"""
import argparse
import json
import math
import subprocess
import sys


def fail(msg, out):
    sys.stderr.write(f"demo_check: {msg}\n--- the demo's output ---\n{out}\n")
    sys.exit(1)


def check_json(args, out):
    line = next((l for l in out.splitlines() if l.startswith("{")), None)
    if line is None:
        fail("no JSON line", out)
    doc = json.loads(line)
    planes = args.planes.split(",")
    if doc["planes"] != planes:
        fail(f"planes {doc['planes']}, expected {planes}", out)
    rows = doc["results"]
    if not rows or len(rows) % len(planes) != 0:
        fail(f"{len(rows)} rows for {len(planes)} planes", out)
    for i in range(0, len(rows), len(planes)):
        shape = rows[i:i + len(planes)]
        if [r["plane"] for r in shape] != planes:
            fail(f"rows of shape {i // len(planes)} in the order {[r['plane'] for r in shape]}", out)
        if len({(r["tokens"], r["hidden"]) for r in shape}) != 1:
            fail(f"rows of one shape name different shapes: {shape}", out)
        instream = next((r for r in shape if r["plane"] == "instream"), None)
        for r in shape:
            if not r["ok"]:
                fail(f"row not ok: {r}", out)
            is_instream = r["plane"] == "instream"
            if r["skipped"] and not (is_instream and args.skipped):
                fail(f"row skipped: {r}", out)
            if is_instream and args.skipped is not None:
                if not r["skipped"] or args.skipped not in r["reason"] or r["vs_instream"] is not None:
                    fail(f"in-stream row not skipped for \"{args.skipped}\": {r}", out)
                continue
            if r["skipped"]:
                continue
            if not (r["us_per_op"] > 0) or r["max_error"] is None:
                fail(f"row without a time or an error figure: {r}", out)
            if instream is None or instream["skipped"]:
                if r["vs_instream"] is not None:
                    fail(f"a cost against an in-stream row that did not run: {r}", out)
                continue
            want = 1.0 if is_instream else r["us_per_op"] / instream["us_per_op"]
            # Both figures are printed to two decimals.
            if r["vs_instream"] is None or not math.isclose(r["vs_instream"], want, rel_tol=0.02,
                                                            abs_tol=0.011):
                fail(f"vs_instream {r['vs_instream']}, expected {want:.3f}: {r}", out)
            if is_instream and args.path and r["path"] != args.path:
                fail(f"in-stream path {r['path']}, expected {args.path}: {r}", out)
    if doc["ok"] is not True:
        fail("the run is not ok", out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rc", type=int, default=0)
    p.add_argument("--text", action="append", default=[])
    p.add_argument("--planes")
    p.add_argument("--path")
    p.add_argument("--skipped")
    p.add_argument("demo", nargs=argparse.REMAINDER)
    args = p.parse_args()
    cmd = [a for a in args.demo if a != "--"]
    if args.planes:
        cmd.append("--json")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=280)
    out = proc.stdout
    if proc.returncode != args.rc:
        fail(f"exit code {proc.returncode}, expected {args.rc}", out)
    for t in args.text:
        if t not in out:
            fail(f"the output lacks \"{t}\"", out)
    if args.planes:
        check_json(args, out)
    print(out, end="")


if __name__ == "__main__":
    main()
