"""The command blocks of docs/operations.md and of the README's "Running a sidecar", as the
runbook test (test_runbook.py) runs them.

A fenced block tagged sh (or bash) is a command block. The line before its fence may carry an
annotation, an HTML comment that renders as nothing:

    <!-- runbook: skip: <why it cannot run in CI> -->   not run (counted, the reason shown)
    <!-- runbook: fresh -->                             run with no sidecars started for it

Every other command block runs in a pod-like sandbox (runbook_sandbox.py): host-mode sidecars
started as the single-node-tp2 overlay starts them, sharing /run/arfuse and one network
namespace as the containers of a pod do, with `kubectl` and `docker` answered for that pod
(runbook_shims/).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OPERATIONS = REPO / "docs" / "operations.md"
README = REPO / "README.md"

_FENCE = re.compile(r"^(\s*)```\s*([A-Za-z0-9_+-]*)\s*$")
_ANNOTATION = re.compile(r"^\s*<!--\s*runbook:\s*(skip|fresh)\s*(?::\s*(.*?))?\s*-->\s*$")


@dataclass
class Block:
    source: str  # "docs/operations.md"
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    mode: str  # "pod", "fresh" or "skip"
    reason: str = ""
    heading: str = ""

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


def blocks(path: Path, section: str | None = None) -> list[Block]:
    """Every fenced block of `path` (only those under the heading `section`, when given)."""
    lines = path.read_text().splitlines()
    out, i, heading, annotation = [], 0, "", None
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        m = _ANNOTATION.match(line)
        if m:
            annotation = (m.group(1), m.group(2) or "")
            i += 1
            continue
        f = _FENCE.match(line)
        if f:
            indent, lang = f.group(1), f.group(2).lower()
            body, j = [], i + 1
            while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
                body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
                j += 1
            mode, reason = ("pod", "") if annotation is None else annotation
            if mode == "skip" and not reason:
                raise ValueError(f"{path.name}:{i + 1}: a runbook skip must say why")
            if section is None or heading == section:
                out.append(Block(str(path.relative_to(REPO)), i + 1, lang, "\n".join(body) + "\n",
                                 mode, reason, heading))
            annotation, i = None, j + 1
            continue
        if line.strip():
            annotation = None  # an annotation belongs to the fence right after it
        i += 1
    return out


def command_blocks(path: Path, section: str | None = None) -> list[Block]:
    return [b for b in blocks(path, section) if b.lang in ("sh", "bash")]


def runbook_blocks() -> list[Block]:
    """The blocks the runbook test runs: docs/operations.md's and the README's sidecar block."""
    readme = command_blocks(README, "Running a sidecar")
    for b in readme:
        if b.mode == "pod":
            b.mode = "fresh"  # the README starts its own sidecar
    return command_blocks(OPERATIONS) + readme


def logical_lines(script: str) -> list[str]:
    """Lines with backslash continuations joined."""
    out, cur = [], ""
    for raw in script.splitlines():
        if raw.rstrip().endswith("\\"):
            cur += raw.rstrip()[:-1] + " "
            continue
        out.append(cur + raw)
        cur = ""
    if cur:
        out.append(cur)
    return out


_DAEMON = re.compile(r"^(\s*)((?:\S*/)?arfused)(\s.*)?$")


def background_daemons(script: str) -> str:
    """A runbook line that starts arfused in the foreground (as a reader does in a terminal of
    its own) is run in the background instead, and the block goes on once the sidecar says it is
    ready (runbook_daemon, defined by the sandbox)."""
    out = []
    for line in logical_lines(script):
        m = _DAEMON.match(line)
        args = (m.group(3) or "") if m else ""
        if m and not re.search(r"--(help|version)\b", args) and not line.rstrip().endswith("&"):
            line = f"{m.group(1)}runbook_daemon {m.group(2)}{args}"
        out.append(line)
    return "\n".join(out) + "\n"
