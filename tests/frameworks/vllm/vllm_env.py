"""Makes a vLLM source tree importable on a CPU machine with torch, for the tests.

The tree is a released wheel's .py files (tests/frameworks/vllm/fetch.py unpacks them);
vLLM's pure-Python dependencies come from a pip --target directory. One module cannot be
installed: xgrammar's wheel requires its own torch build, which would replace the torch under
test; it is a stand-in (a module whose attributes are empty classes taking any arguments), and nothing the fusion
pass runs uses it (vllm.config imports it through the structured-output parsers).
"""
import importlib.abc
import importlib.machinery
import sys
import types

STAND_INS = ("xgrammar",)


class _AnyModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__init__": lambda self, *args, **kwargs: None})
        setattr(self, name, value)
        return value


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STAND_INS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _AnyModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def setup(vllm_src: str, deps: str = None):
    for p in (deps, vllm_src):
        if p and p not in sys.path:
            sys.path.insert(0, p)
    if not any(isinstance(f, _StandIns) for f in sys.meta_path):
        sys.meta_path.insert(0, _StandIns())
