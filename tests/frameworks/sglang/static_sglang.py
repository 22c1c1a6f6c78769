"""SGLang's released source read without importing it (no torch needed): module-level names of
each module from its AST, so arfuse's layout detection and install() can run against the real
wheels' modules as namespaces, and every call site can be followed to what it binds."""
import ast
import pathlib
import types
from typing import Dict, Optional


class Function:
    """Stands for a function defined in the wheel's source (callable, like the real one)."""

    def __init__(self, module: str, node: ast.FunctionDef):
        self.module, self.node, self.__name__ = module, node, node.name

    def __call__(self, *a, **k):
        raise RuntimeError(f"{self.module}.{self.__name__} is the wheel's source, not code")

    def params(self):
        a = self.node.args
        return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]


class Source:
    def __init__(self, root):
        self.root = pathlib.Path(root)
        self._trees: Dict[str, Optional[ast.Module]] = {}
        self._modules: Dict[str, types.ModuleType] = {}

    def path(self, name: str) -> Optional[pathlib.Path]:
        base = self.root.joinpath(*name.split("."))
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.exists():
                return p
        return None

    def tree(self, name: str) -> Optional[ast.Module]:
        if name not in self._trees:
            p = self.path(name)
            self._trees[name] = ast.parse(p.read_text(encoding="utf-8-sig"), str(p)) \
                if p else None
        return self._trees[name]

    def modules(self, containing=()):
        """sglang.srt's module names; with `containing`, only those whose text has one."""
        for p in sorted((self.root / "sglang" / "srt").rglob("*.py")):
            if containing:
                text = p.read_text(encoding="utf-8-sig", errors="replace")
                if not any(c in text for c in containing):
                    continue
            rel = p.relative_to(self.root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts)

    def import_module(self, name: str) -> types.ModuleType:
        """A namespace with the module's top-level names (functions as Function, the rest as the
        AST node that binds them); ImportError when the wheel has no such module."""
        if name in self._modules:
            return self._modules[name]
        tree = self.tree(name)
        if tree is None:
            raise ImportError(f"No module named {name!r} in {self.root}")
        m = types.ModuleType(name)
        is_pkg = self.path(name).name == "__init__.py"
        for node in tree.body:
            for bound, value in top_level_bindings(name, node, is_pkg):
                setattr(m, bound, value)
        self._modules[name] = m
        return m

    def resolve(self, module: str, name: str, depth: int = 0):
        """(defining module, object) of `name` as `module` binds it at top level, following
        `from X import name` re-exports; None when not found in the wheel."""
        if depth > 10:
            return None
        try:
            m = self.import_module(module)
        except ImportError:
            return None
        v = vars(m).get(name)
        if isinstance(v, ImportFrom):
            return self.resolve(v.module, v.name, depth + 1)
        if v is None:
            return None
        return module, v


class ImportFrom:
    def __init__(self, module: str, name: str):
        self.module, self.name = module, name


def _absolute(module: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_pkg else parts[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def top_level_bindings(module: str, node, is_pkg: bool = False):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        yield node.name, Function(module, node)
    elif isinstance(node, ast.ClassDef):
        yield node.name, node
    elif isinstance(node, ast.Assign):
        for t in node.targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    yield n.id, node
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
        yield node.target.id, node
    elif isinstance(node, ast.ImportFrom):
        src = _absolute(module, node, is_pkg)
        for a in node.names:
            yield a.asname or a.name, ImportFrom(src, a.name)
    elif isinstance(node, (ast.If, ast.Try)):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                yield from top_level_bindings(module, child, is_pkg)
            elif isinstance(child, ast.ExceptHandler):
                for c in child.body:
                    yield from top_level_bindings(module, c, is_pkg)


def local_import(func: ast.AST, module: str, name: str, is_pkg: bool = False):
    """The `from X import name` inside `func` (a function-level import), or None."""
    for n in ast.walk(func):
        if isinstance(n, ast.ImportFrom):
            for a in n.names:
                if (a.asname or a.name) == name:
                    return ImportFrom(_absolute(module, n, is_pkg), a.name)
    return None


def call_sites(src: Source, names):
    """Every call `name(...)` of one of `names` in sglang/srt: (module, enclosing function node
    or None, call node, called name)."""
    for mod in src.modules(containing=tuple(names)):
        tree = src.tree(mod)
        parents = {}
        for p in ast.walk(tree):
            for c in ast.iter_child_nodes(p):
                parents[c] = p
        for n in ast.walk(tree):
            if isinstance(n, ast.Call):
                f = n.func
                called = f.id if isinstance(f, ast.Name) else (
                    f.attr if isinstance(f, ast.Attribute) else None)
                if called in names:
                    fn = parents.get(n)
                    while fn is not None and not isinstance(
                            fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        fn = parents.get(fn)
                    yield mod, fn, n, called
