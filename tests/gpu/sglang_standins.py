"""Stand-ins for the packages a staged SGLang source imports that are not installed (sgl_kernel,
flashinfer, transformers, ...): a meta-path finder that answers an import made by SGLang's own
modules, and only for a top-level package no other finder has, with a permissive module whose
attributes are stand-ins. SGLang's modules themselves are always the real files.

    import sglang_standins; sglang_standins.install()   # before importing sglang
    sglang_standins.FINDER.stubbed                      # the top-level names it answered
"""
import importlib.abc, importlib.machinery, importlib.util, os, sys, types

class _Any(types.ModuleType):
    """A stand-in module: every attribute is a stand-in (callable, subscriptable, a class base)."""
    __path__ = []
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        v = _stub_class(f"{self.__name__}.{name}")
        setattr(self, name, v)
        return v

# Dunder names SGLang reads off stand-in classes (the rest raise, as Python's probes expect).
_DUNDERS = {"__class_validators__": ()}


class _Meta(type):
    def __new__(mcls, name, bases, ns, **kw):
        return super().__new__(mcls, name, bases, ns)
    def __init__(cls, name, bases, ns, **kw):
        super().__init__(name, bases, ns)
    def __iter__(cls): return iter(())
    def __call__(cls, *a, **k):
        if cls.__dict__.get("_stub"):
            if len(a) == 1 and isinstance(a[0], types.FunctionType) and not k:
                return a[0]  # used as a decorator
            return _Val()
        return super().__call__(*a, **k)
    def __setitem__(cls, k, v): pass
    def __contains__(cls, k): return False
    def __len__(cls): return 0
    def __bool__(cls): return False
    def __getattr__(cls, name):
        if name in _DUNDERS:
            return _DUNDERS[name]
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub_class(f"{cls.__qualname__}.{name}")
    def __getitem__(cls, item):
        return cls
    def __or__(cls, o): return cls
    def __ror__(cls, o): return cls

class _Val(str):
    """What a stand-in returns: an empty string that answers any attribute with a stand-in."""
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub_class("value." + name)
    def __call__(self, *a, **k): return _Val()

def _stub_class(qual):
    return _Meta(qual.rsplit(".", 1)[-1], (), {"__qualname__": qual, "_stub": True,
        "__init__": lambda self, *a, **k: None, "__call__": lambda self, *a, **k: None})

def _from_sglang():
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith("<frozen"):
        f = f.f_back
    return f is not None and str(f.f_globals.get("__name__", "")).startswith("sglang")

class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self): self.stubbed = set()
    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if top == "sglang" or top in sys.stdlib_module_names or not _from_sglang():
            return None
        if top in FORCED:
            self.stubbed.add(top)
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        for f in sys.meta_path:
            if f is self: continue
            try:
                s = f.find_spec(name, path, target)
            except Exception:
                s = None
            if s is not None:
                return None
        self.stubbed.add(top)
        return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        if spec.name in KNOWN:
            return KNOWN[spec.name]()
        return _Any(spec.name)
    def exec_module(self, m):
        if not hasattr(m, "__path__"):
            m.__path__ = []

def _msgspec():
    """msgspec (a C extension): Struct as a dataclass, enough for SGLang's kernel registry."""
    import dataclasses
    m = types.ModuleType("msgspec")

    class Struct:
        def __init_subclass__(cls, frozen=False, **kw):
            super().__init_subclass__()
            dataclasses.dataclass(frozen=frozen, eq=True)(cls)
            cls.__struct_fields__ = tuple(f.name for f in dataclasses.fields(cls))

    def defstruct(name, fields, *, bases=None, module=None, namespace=None, frozen=False,
                  **kw):
        ns = dict(namespace or {})
        ns.pop("__struct_fields__", None)
        specs = [f if len(f) < 3 or isinstance(f[2], dataclasses.Field)
                 else (f[0], f[1], dataclasses.field(default=f[2]) if not isinstance(
                     f[2], (list, dict, set)) else dataclasses.field(
                         default_factory=(lambda v: lambda: type(v)(v))(f[2])))
                 for f in fields]
        cls = dataclasses.make_dataclass(name, specs, namespace=ns, frozen=frozen,
                                         kw_only=True)
        cls.__struct_fields__ = tuple(f.name for f in dataclasses.fields(cls))
        if module:
            cls.__module__ = module
        return cls

    m.Struct, m.field, m.defstruct = Struct, dataclasses.field, defstruct
    m.structs = types.ModuleType("msgspec.structs")
    m.structs.replace = dataclasses.replace
    m.structs.asdict = dataclasses.asdict
    m.structs.fields = dataclasses.fields
    return m


# Packages with behaviour SGLang's import-time code relies on: real small stand-ins.
KNOWN = {"msgspec": _msgspec}

FINDER = Finder()


# Packages stood in for even where installed ($ARFUSE_SGLANG_STANDINS, comma-separated): an
# installed transformers whose optional parts are missing fails inside SGLang's config imports.
FORCED = {n for n in os.environ.get("ARFUSE_SGLANG_STANDINS", "").split(",") if n}


def install():
    if FINDER not in sys.meta_path:
        # First, so that a forced stand-in wins over the installed package.
        sys.meta_path.insert(0, FINDER)
    return FINDER
