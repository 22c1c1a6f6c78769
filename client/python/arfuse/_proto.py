"""Generates and imports the arfuse.v1 stubs.

The stubs are made from the repository's proto/arfuse/v1 with grpc_tools.protoc into arfuse/v1/
(git-ignored), at first import or with `python -m arfuse._proto`, and again whenever a .proto is
newer than its stub. ARFUSE_PROTO_DIR points at another proto root (an installed copy).

Machines without grpcio-tools (or whose protobuf/grpcio runtime is older than the one that
generated the stubs) use the fallback: arfuse/v1/descriptors.pb, a FileDescriptorSet written by
`python -m arfuse._proto --descriptors` and kept in the tree. Message classes are built from it at
run time and the service stubs are plain channel.unary_unary/stream_stream callables, so it works
with any protobuf >= 3.20 and grpcio. ARFUSE_PROTO_FALLBACK=1 forces it (tests).
"""
import hashlib
import importlib
import os
import pathlib
import sys
import threading
import types

_PKG_DIR = pathlib.Path(__file__).resolve().parent
_OUT_DIR = _PKG_DIR.parent  # protoc writes arfuse/v1/<name>_pb2.py under it
_NAMES = ("common", "config", "fusion", "admin", "peer")
_DESCRIPTORS = _PKG_DIR / "v1" / "descriptors.pb"
_DESCRIPTORS_HASH = _PKG_DIR / "v1" / "descriptors.sha256"
_lock = threading.Lock()
_fallback_modules = {}


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


def _protoc(args):
    try:
        from grpc_tools import protoc
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("generating arfuse stubs needs grpcio-tools "
                          "(pip install grpcio-tools)") from e
    import grpc_tools
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    root = proto_root()
    files = [str(root / "arfuse" / "v1" / f"{n}.proto") for n in _NAMES]
    rc = protoc.main(["grpc_tools.protoc", f"-I{root}", f"-I{well_known}", *args, *files])
    if rc != 0:
        raise ImportError(f"grpc_tools.protoc failed with exit code {rc}")


def generate(force: bool = False) -> None:
    root = proto_root()
    with _lock:
        if not force and not _stale(root):
            return
        if not (root / "arfuse" / "v1" / "fusion.proto").exists():
            raise ImportError(
                f"arfuse stubs are missing and no protos were found under {root}; "
                "set ARFUSE_PROTO_DIR to the directory holding arfuse/v1/*.proto")
        _protoc([f"--python_out={_OUT_DIR}", f"--grpc_python_out={_OUT_DIR}"])
        importlib.invalidate_caches()


def protos_hash(root: pathlib.Path = None) -> str:
    """sha256 over the .proto sources, in a fixed order (what descriptors.sha256 records)."""
    root = root or proto_root()
    h = hashlib.sha256()
    for name in _NAMES:
        h.update(name.encode())
        h.update((root / "arfuse" / "v1" / f"{name}.proto").read_bytes())
    return h.hexdigest()


def write_descriptors() -> pathlib.Path:
    """Writes arfuse/v1/descriptors.pb (+ .sha256 of the protos it was made from)."""
    _DESCRIPTORS.parent.mkdir(parents=True, exist_ok=True)
    _protoc([f"--descriptor_set_out={_DESCRIPTORS}", "--include_imports"])
    _DESCRIPTORS_HASH.write_text(protos_hash() + "\n")
    return _DESCRIPTORS


def descriptors_fresh() -> bool:
    """False when the protos changed since descriptors.pb was written (regenerate it)."""
    try:
        return _DESCRIPTORS_HASH.read_text().strip() == protos_hash()
    except FileNotFoundError:
        return False


# ---- fallback: modules built from descriptors.pb ----

def _fallback_load():
    """Returns {name: module} for common/config/fusion (+ *_grpc) built from descriptors.pb."""
    if _fallback_modules:
        return _fallback_modules
    from google.protobuf import descriptor_pb2, descriptor_pool
    from google.protobuf.internal import enum_type_wrapper
    try:
        from google.protobuf.message_factory import GetMessageClass
    except ImportError:  # protobuf < 4.22
        from google.protobuf import message_factory

        _factory = message_factory.MessageFactory()

        def GetMessageClass(desc):
            return _factory.GetPrototype(desc)

    import grpc

    if not _DESCRIPTORS.exists():
        raise ImportError(f"{_DESCRIPTORS} is missing: run `python -m arfuse._proto --descriptors` "
                          "on a machine with grpcio-tools")
    fds = descriptor_pb2.FileDescriptorSet.FromString(_DESCRIPTORS.read_bytes())
    pool = descriptor_pool.DescriptorPool()  # private: never clashes with generated stubs
    for f in fds.file:
        pool.Add(f)
    for f in fds.file:
        if not f.name.startswith("arfuse/v1/"):
            continue
        name = f.name.rsplit("/", 1)[1][:-len(".proto")]
        fd = pool.FindFileByName(f.name)
        mod = types.ModuleType(f"arfuse.v1.{name}_pb2")
        mod.DESCRIPTOR = fd
        for ename, edesc in fd.enum_types_by_name.items():
            setattr(mod, ename, enum_type_wrapper.EnumTypeWrapper(edesc))
            for v in edesc.values:
                setattr(mod, v.name, v.number)
        for mname, mdesc in fd.message_types_by_name.items():
            setattr(mod, mname, GetMessageClass(mdesc))
        grpc_mod = types.ModuleType(f"arfuse.v1.{name}_pb2_grpc")
        for sname, sdesc in fd.services_by_name.items():
            setattr(grpc_mod, f"{sname}Stub", _make_stub(grpc, sdesc, GetMessageClass))
        _fallback_modules[name] = mod
        _fallback_modules[name + "_grpc"] = grpc_mod
    return _fallback_modules


def _make_stub(grpc, sdesc, get_class):
    methods = []
    for m in sdesc.methods:
        req, resp = get_class(m.input_type), get_class(m.output_type)
        kind = ("stream_" if m.client_streaming else "unary_") + \
               ("stream" if m.server_streaming else "unary")
        methods.append((m.name, kind, f"/{sdesc.full_name}/{m.name}", req, resp))

    def __init__(self, channel):
        for name, kind, path, req, resp in methods:
            setattr(self, name, getattr(channel, kind)(
                path, request_serializer=req.SerializeToString,
                response_deserializer=resp.FromString))

    return type(f"{sdesc.name}Stub", (), {"__init__": __init__,
                                          "__doc__": f"{sdesc.full_name} (from descriptors.pb)"})


def _use_fallback() -> bool:
    return os.environ.get("ARFUSE_PROTO_FALLBACK", "") not in ("", "0")


_mode = None  # "generated" or "fallback", once decided


def _load(names):
    global _mode
    if _mode is None:
        if _use_fallback():
            _mode = "fallback"
        else:
            try:
                generate()
                for n in ("common", "fusion", "config"):
                    importlib.import_module(f"arfuse.v1.{n}_pb2")
                    importlib.import_module(f"arfuse.v1.{n}_pb2_grpc")
                _mode = "generated"
            except Exception as e:  # no grpcio-tools, or a runtime older than the stubs
                if not _DESCRIPTORS.exists():
                    raise
                print(f"arfuse: generated stubs unusable ({type(e).__name__}: {e}); using "
                      f"{_DESCRIPTORS.name}", file=sys.stderr)
                _mode = "fallback"
    if _mode == "generated":
        return tuple(importlib.import_module(f"arfuse.v1.{n}") for n in names)
    mods = _fallback_load()
    return tuple(mods[n[:-len("_pb2")]] if n.endswith("_pb2")
                 else mods[n[:-len("_pb2_grpc")] + "_grpc"] for n in names)


def mode() -> str:
    """"generated" or "fallback" (after the first load)."""
    return _mode or "unloaded"


def load():
    """Returns (common_pb2, fusion_pb2, fusion_pb2_grpc)."""
    return _load(("common_pb2", "fusion_pb2", "fusion_pb2_grpc"))


def load_config():
    """Returns (config_pb2, config_pb2_grpc)."""
    return _load(("config_pb2", "config_pb2_grpc"))


if __name__ == "__main__":
    if "--descriptors" in sys.argv:
        print(f"wrote {write_descriptors()}")
    else:
        generate(force="--force" in sys.argv)
        print(f"arfuse stubs generated in {_PKG_DIR / 'v1'}")
