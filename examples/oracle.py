#!/usr/bin/env python3
"""oracle.py: the numerics oracle in one command (docs/numerics.md; tp_oracle.py says what it does).

    # one H200, two ranks sharing it under MPS (see docs/integration.md for the MPS setup)
    python3 examples/oracle.py --gpus 1 --json-out oracle.json

runs tp_decode.py --oracle at Llama-3-8B layer sizes (hidden 4096, 32 / 8 heads, intermediate
14336, vocab 32000, 32 layers, batch 16, prompt 32, 8 decode steps), bf16, two ranks, the
in-stream plane, with sidecars it starts. Every tp_decode option can be given and wins over
these defaults (e.g. --layers 80, or --hidden 8192 --heads 64 --intermediate 28672 --layers 8,
or --plane doorbell). Writes the report to --json-out (default oracle.json) and exits 0 when the
oracle passes.
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import tp_decode  # noqa: E402

DEFAULTS = ["--ranks", "2", "--hidden", "4096", "--heads", "32", "--kv-heads", "8",
            "--intermediate", "14336", "--vocab", "32000", "--layers", "32", "--batch", "16",
            "--prompt-len", "32", "--steps", "8", "--flashinfer-allreduce-fusion-backend", "auto",
            "--pg-timeout", "600", "--timeout", "900", "--scenarios", "main"]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = "oracle.json"
    if "--json-out" in argv:
        i = argv.index("--json-out")
        out = argv[i + 1]
        del argv[i:i + 2]
    return tp_decode.main(DEFAULTS + ["--oracle", out] + argv)


if __name__ == "__main__":
    sys.exit(main())
