"""Checks a vLLM source tree, by AST and without importing it, for everything
arfuse.integrations.vllm relies on: its LAYOUT table (the same names its register() checks at
run time) and the signatures and call forms its pass and plugin depend on."""
import ast
import pathlib

# (module, function path, parameter names): what the arfuse pass calls or is called as.
SIGNATURES = (
    ("vllm.ir.ops.layernorm", "rms_norm", ["x", "weight", "epsilon", "variance_size"]),
    ("vllm.ir.ops.layernorm", "fused_add_rms_norm",
     ["x", "x_residual", "weight", "epsilon", "variance_size"]),
    ("vllm.distributed.parallel_state", "all_reduce", ["tensor", "group_name"]),
    ("vllm.compilation.passes.pass_manager", "PostGradPassManager.configure",
     ["self", "config"]),
    ("vllm.compilation.passes.vllm_inductor_pass", "VllmInductorPass.__init__",
     ["self", "config"]),
    ("vllm.compilation.passes.inductor_pass", "InductorPass.is_applicable_for_range",
     ["self", "compile_range"]),
    ("vllm.compilation.passes.fusion.allreduce_rms_fusion",
     "AllReduceFusionPass.is_applicable_for_range", ["self", "compile_range"]),
    ("vllm.config.compilation", "CompilationConfig.get_compile_ranges", ["self"]),
)
# (module, class, field): configuration fields the plugin and pass read or set.
FIELDS = (
    ("vllm.config.compilation", "PassConfig", "fuse_allreduce_rms"),
    ("vllm.config.compilation", "CompilationConfig", "compile_ranges_endpoints"),
    ("vllm.config.compilation", "CompilationConfig", "inductor_compile_config"),
)


def module_file(root: pathlib.Path, module: str):
    base = root.joinpath(*module.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.exists():
            return f
    return None


def _defs(body):
    out = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                out[a.asname or a.name] = node
        elif isinstance(node, (ast.If, ast.Try)):
            for sub in [node.body, getattr(node, "orelse", []),
                        *[h.body for h in getattr(node, "handlers", [])]]:
                out.update({k: v for k, v in _defs(sub).items() if k not in out})
    return out


def resolve(root, module, path):
    f = module_file(root, module)
    if f is None:
        return None, f"{module}: no such module"
    node = ast.parse(f.read_text(), str(f))
    for part in path.split("."):
        body = getattr(node, "body", None)
        found = _defs(body) if isinstance(body, list) else {}
        if part not in found:
            return None, f"{module}.{path}: {part} not defined"
        node = found[part]
    return node, None


def names_in(node):
    """The names a function's code refers to, as its co_names holds them (globals and
    attributes)."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def check(root, layout):
    """[] when the tree at `root` (the directory holding vllm/) has the layout; else what
    differs, one string each. `layout`: arfuse.integrations.vllm.LAYOUT."""
    root = pathlib.Path(root)
    problems = []
    for module, path, kind in layout:
        node, err = resolve(root, module, path)
        if err:
            problems.append(err)
            continue
        if kind.startswith("names:") and kind.split(":", 1)[1] not in names_in(node):
            problems.append(f"{module}.{path} does not refer to {kind.split(':', 1)[1]}")
        if path == "DEFAULT_PLUGINS_GROUP":
            value = getattr(node, "value", None)
            if not (isinstance(value, ast.Constant) and value.value == "vllm.general_plugins"):
                problems.append(f"{module}.{path} is not 'vllm.general_plugins'")
        if path.startswith("OPTIMIZATION_LEVEL_"):
            src = ast.unparse(node)
            if "'fuse_allreduce_rms'" not in src and '"fuse_allreduce_rms"' not in src:
                problems.append(f"{module}.{path} has no pass_config fuse_allreduce_rms")
    for module, path, params in SIGNATURES:
        node, err = resolve(root, module, path)
        if err:
            problems.append(err)
            continue
        got = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
        if got != params:
            problems.append(f"{module}.{path}{tuple(got)}: expected {tuple(params)}")
    for module, cls, field in FIELDS:
        _, err = resolve(root, module, f"{cls}.{field}")
        if err:
            problems.append(err)
    problems += _call_forms(root)
    return problems


def _call_forms(root):
    """The call forms the pass's patterns reproduce and the pass-manager order it relies on."""
    problems = []
    node, err = resolve(root, "vllm.distributed.parallel_state", "GroupCoordinator.all_reduce")
    if not err:
        src = ast.unparse(node)
        if "torch.ops.vllm.all_reduce(input_, group_name=self.unique_name)" not in src:
            problems.append("GroupCoordinator.all_reduce does not call "
                            "torch.ops.vllm.all_reduce(input_, group_name=self.unique_name)")
    node, err = resolve(root, "vllm.compilation.passes.pass_manager",
                        "PostGradPassManager.configure")
    if not err:
        src = ast.unparse(node)
        if "AllReduceFusionPass(config)" not in src or "fuse_allreduce_rms" not in src:
            problems.append("PostGradPassManager.configure does not build "
                            "AllReduceFusionPass(config) under fuse_allreduce_rms")
    node, err = resolve(root, "vllm.compilation.passes.fusion.allreduce_rms_fusion",
                        "AllReduceFusedAddRMSNormPattern.register")
    if not err:
        src = ast.unparse(node)
        for call in ("tensor_model_parallel_all_reduce(input)",
                     "vllm.ir.ops.fused_add_rms_norm(allreduce_output, residual, weight, "
                     "self.epsilon)"):
            if call not in src:
                problems.append(f"FlashInfer's add-RMSNorm pattern no longer matches {call}")
    node, err = resolve(root, "vllm.compilation.passes.fusion.allreduce_rms_fusion",
                        "AllReduceRMSNormPattern.register")
    if not err and "vllm.ir.ops.rms_norm(allreduce_output, weight, self.epsilon)" not in \
            ast.unparse(node):
        problems.append("FlashInfer's RMSNorm pattern no longer matches vllm.ir.ops.rms_norm")
    node, err = resolve(root, "vllm.compilation.backends", "VllmBackend.__call__")
    if err:
        problems.append(err)
    else:
        src = ast.unparse(node)
        a, b = src.find("self.configure_post_pass()"), src.find("split_graph(")
        if a < 0 or b < 0 or a > b:
            problems.append("VllmBackend.__call__ does not configure the passes before it "
                            "splits the graph (the pass's compile-range endpoint would be late)")
    node, err = resolve(root, "vllm.compilation.piecewise_backend", "PiecewiseBackend.__init__")
    if not err and "self.compilation_config.get_compile_ranges()" not in ast.unparse(node):
        problems.append("PiecewiseBackend.__init__ does not read get_compile_ranges()")
    return problems
