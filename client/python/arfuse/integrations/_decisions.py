"""What a framework integration says about the path it chose: one line per rank for the path and
why, and each decline reason the first time it occurs.

Decline notes sit at the Python-side decision points (SGLang's gate answering no in eager
Python, vLLM's fusion pass deciding a site at compile time), never inside code Dynamo traces:
a decline already seen costs one set lookup, a new one takes a lock once and logs at INFO."""
import logging
import threading
from typing import Iterable, List, Optional


class FirstDeclines:
    """Logs every distinct decline reason once, with the first occurrence's detail."""

    def __init__(self, logger: logging.Logger, own_path: str):
        self._logger, self._own_path = logger, own_path
        self._seen = set()
        self._lock = threading.Lock()

    def note(self, reason: str, detail: str = "") -> bool:
        """True when this call logged (the first `reason`); thread-safe."""
        if reason in self._seen:
            return False
        with self._lock:
            if reason in self._seen:
                return False
            self._seen.add(reason)
        self._logger.info("arfuse: declined (%s): %s; %s runs there (first time for this reason, "
                          "not logged again)", reason, detail or reason, self._own_path)
        return True

    def seen(self) -> List[str]:
        return sorted(self._seen)

    def reset(self):
        with self._lock:
            self._seen.clear()


def reason_class(why: Optional[str]) -> str:
    """A decline message of the client library or an integration, as a short class (the
    `reason` label the sidecar's counters use): shape, dtype, range, drained, not_contiguous,
    device, not_attached, groups or not_served."""
    w = (why or "").lower()
    if "not contiguous" in w:
        return "not_contiguous"
    if "drain" in w:
        return "drained"
    if "no in-stream context" in w or "no sidecar socket" in w or "attach" in w:
        return "not_attached"
    if "group" in w:
        return "groups"
    if "dtype" in w:
        return "dtype"
    if "is on " in w:
        return "device"
    if "range" in w or "tokens" in w:
        return "range"
    if "shape" in w or "differs from" in w or "must be [" in w or "hidden" in w:
        return "shape"
    return "not_served"


def path_line(logger: logging.Logger, level: int, who: str, arfuse_serves: bool, own_path: str,
              attached: str, vote: str, patched: Iterable[str], why: str = ""):
    """The one line per rank that says which path serves and why."""
    names = list(patched)
    logger.log(level, "arfuse: %s: path %s; attached: %s; vote: %s; patched: %s%s", who,
               "arfuse (fused allreduce + residual + RMSNorm)" if arfuse_serves else own_path,
               attached, vote, ", ".join(names) if names else "nothing",
               f"; why: {why}" if why else "")
