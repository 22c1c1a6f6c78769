"""Generates and imports the arfuse.v1 stubs.

The stubs are made from the repository's proto/arfuse/v1 with grpc_tools.protoc into arfuse/v1/
(git-ignored), at first import or with `python -m arfuse._proto`, and again whenever a .proto is
newer than its stub. ARFUSE_PROTO_DIR points at another proto root (an installed copy).
"""
import importlib
import os
import pathlib
import sys
import threading

_PKG_DIR = pathlib.Path(__file__).resolve().parent
_OUT_DIR = _PKG_DIR.parent  # protoc writes arfuse/v1/<name>_pb2.py under it
_NAMES = ("common", "config", "fusion", "admin", "peer")
_lock = threading.Lock()


def proto_root() -> pathlib.Path:
    env = os.environ.get("ARFUSE_PROTO_DIR")
    if env:
        return pathlib.Path(env)
    # client/python/arfuse -> repository root
    return _PKG_DIR.parent.parent.parent / "proto"


def _stale(root: pathlib.Path) -> bool:
    for name in _NAMES:
        src = root / "arfuse" / "v1" / f"{name}.proto"
        for out in (_PKG_DIR / "v1" / f"{name}_pb2.py", _PKG_DIR / "v1" / f"{name}_pb2_grpc.py"):
            if not out.exists():
                return True
            if src.exists() and src.stat().st_mtime > out.stat().st_mtime:
                return True
    return False


def generate(force: bool = False) -> None:
    root = proto_root()
    with _lock:
        if not force and not _stale(root):
            return
        if not (root / "arfuse" / "v1" / "fusion.proto").exists():
            raise ImportError(
                f"arfuse stubs are missing and no protos were found under {root}; "
                "set ARFUSE_PROTO_DIR to the directory holding arfuse/v1/*.proto")
        try:
            from grpc_tools import protoc
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("generating arfuse stubs needs grpcio-tools "
                              "(pip install grpcio-tools)") from e
        import grpc_tools
        well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
        files = [str(root / "arfuse" / "v1" / f"{n}.proto") for n in _NAMES]
        rc = protoc.main(["grpc_tools.protoc", f"-I{root}", f"-I{well_known}",
                          f"--python_out={_OUT_DIR}", f"--grpc_python_out={_OUT_DIR}", *files])
        if rc != 0:
            raise ImportError(f"grpc_tools.protoc failed with exit code {rc}")
        importlib.invalidate_caches()


def load():
    """Returns (common_pb2, fusion_pb2, fusion_pb2_grpc)."""
    generate()
    common = importlib.import_module("arfuse.v1.common_pb2")
    fusion = importlib.import_module("arfuse.v1.fusion_pb2")
    fusion_grpc = importlib.import_module("arfuse.v1.fusion_pb2_grpc")
    return common, fusion, fusion_grpc


if __name__ == "__main__":
    generate(force="--force" in sys.argv)
    print(f"arfuse stubs generated in {_PKG_DIR / 'v1'}")
