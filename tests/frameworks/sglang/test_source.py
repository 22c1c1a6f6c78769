"""arfuse's SGLang adapters against the released wheels' source, without SGLang or torch
installed: layout detection and install() run on the real modules read as namespaces, the
replaced functions' signatures match each release's, and every call site of the fused op and
of the gate in sglang/srt reaches arfuse after install()."""
import ast
import warnings

import pytest

warnings.filterwarnings("ignore", category=SyntaxWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning)

from arfuse.integrations import sglang as shim
from arfuse.integrations.sglang import layouts
from conftest import EXPECTED
from static_sglang import Function, ImportFrom, Source, call_sites, local_import


@pytest.fixture(autouse=True)
def clean():
    shim.uninstall()
    yield
    shim.uninstall()


def test_each_release_is_detected_as_its_layout_or_refused(release):
    version, root = release
    src = Source(root)
    if EXPECTED[version] is None:
        with pytest.raises(shim.UnknownLayout) as e:
            shim.detect_layout(src.import_module)
        assert "unknown module layout" in str(e.value)
        assert version in layouts.REFUSED
        return
    layout, gate = shim.detect_layout(src.import_module)
    assert layout.name == EXPECTED[version]
    assert version in layout.checked
    assert gate in layout.gate_names


def test_install_patches_every_name_on_the_real_modules(release):
    version, root = release
    src = Source(root)
    if EXPECTED[version] is None:
        with pytest.raises(shim.UnknownLayout):
            shim.install(import_module=src.import_module)
        assert not shim.installed()
        return
    patched = shim.install(import_module=src.import_module)
    layout = layouts.LAYOUTS[[l.name for l in layouts.LAYOUTS].index(EXPECTED[version])]
    fusion = src.import_module(layouts.FUSION_MODULE)
    for name in layouts.FUSION_FUNCTIONS:
        assert getattr(fusion, name) is getattr(shim, name)
        assert f"{layouts.FUSION_MODULE}.{name}" in patched
    gate_mod = src.import_module(layout.gate_module)
    for g in layout.gate_true_globals:
        assert getattr(gate_mod, g) is True
    assert gate_mod.is_flashinfer_allreduce_unavailable is shim.is_flashinfer_allreduce_unavailable
    # Before setup the gate's inputs say "unavailable" and the op declines: SGLang's own path.
    assert shim.is_flashinfer_allreduce_unavailable() is True
    assert shim.flashinfer_allreduce_residual_rmsnorm(None, None, None) == (None, None)
    shim.uninstall()
    assert isinstance(vars(fusion)[layouts.OP_NAME], Function)
    for g in layout.gate_true_globals:
        assert isinstance(vars(gate_mod)[g], ast.AST)


def test_replaced_functions_take_every_parameter_of_the_release(release):
    import inspect

    version, root = release
    if EXPECTED[version] is None:
        pytest.skip("refused layout")
    fusion = Source(root).import_module(layouts.FUSION_MODULE)
    for name, params in layouts.FUSION_FUNCTIONS.items():
        upstream = getattr(fusion, name)
        assert isinstance(upstream, Function), name
        ours = list(inspect.signature(getattr(shim, name)).parameters)
        assert upstream.params() == ours == list(params), (name, upstream.params(), ours)


def test_the_gate_reads_only_what_install_sets(release):
    """The gate's availability inputs are the globals install() sets and the
    is_flashinfer_allreduce_unavailable binding it replaces; its other conditions (batch size,
    DP attention, the backend flag) are SGLang's own and stay."""
    version, root = release
    if EXPECTED[version] is None:
        pytest.skip("refused layout")
    src = Source(root)
    layout, gate = shim.detect_layout(src.import_module)
    fn = getattr(src.import_module(layout.gate_module), gate)
    names = {n.id for n in ast.walk(fn.node) if isinstance(n, ast.Name)}
    assert set(layout.gate_true_globals) <= names
    assert "is_flashinfer_allreduce_unavailable" in names
    assert "FUSE_ALLREDUCE_MAX_BATCH_SIZE" in names
    assert "_flashinfer_comm" not in names  # nothing else of FlashInfer's is asked
    mod = src.import_module(layout.gate_module)
    assert vars(mod)["is_flashinfer_allreduce_unavailable"].module == layouts.FUSION_MODULE


OP_NAMES = set(layouts.FUSION_FUNCTIONS)


def _reaches(src, layout, gate_def, mod, fn, name):
    """Where a call of `name` in `mod` (inside function node `fn`) goes, and whether that is
    arfuse's after install()."""
    bound = local_import(fn, mod, name) if fn is not None else None
    if bound is not None:
        target = src.resolve(bound.module, bound.name)
    else:
        top = vars(src.import_module(mod)).get(name)
        if isinstance(top, ImportFrom):
            if name in OP_NAMES and mod not in (layouts.FUSION_MODULE,
                                                *layout.unavailable_bindings):
                return False, f"module-level binding of {name} in {mod}, not patched"
            target = src.resolve(top.module, top.name)
        elif top is None:
            return None, "not a module-level name (a method or a local)"
        else:
            target = (mod, top)
    if target is None:
        return False, f"{name} does not resolve in the wheel"
    where, obj = target
    if name in OP_NAMES:
        return where == layouts.FUSION_MODULE, f"{where}.{name}"
    return obj is gate_def, f"{where}.{name}"


def test_every_call_site_of_the_op_and_the_gate_reaches_arfuse(release):
    version, root = release
    if EXPECTED[version] is None:
        pytest.skip("refused layout")
    src = Source(root)
    layout, gate = shim.detect_layout(src.import_module)
    gate_def = getattr(src.import_module(layout.gate_module), gate)
    seen, wrong = [], []
    for mod, fn, call, name in call_sites(src, OP_NAMES | {gate}):
        if isinstance(call.func, ast.Attribute):
            # self.x(...) / obj.x(...): methods of the same name are not these functions.
            continue
        ok, where = _reaches(src, layout, gate_def, mod, fn, name)
        if ok is None:
            continue
        (seen if ok else wrong).append(f"{mod}:{call.lineno} {name} -> {where}")
    assert not wrong, "\n".join(wrong)
    op_sites = [s for s in seen if f" {layouts.OP_NAME} ->" in s]
    gate_sites = [s for s in seen if f" {gate} ->" in s]
    # layernorm's _forward_with_allreduce_fusion calls the op in every supported release; the
    # gate is asked at the attention and FFN boundaries.
    assert any(s.startswith("sglang.srt.layers.layernorm:") for s in op_sites), seen
    assert len(gate_sites) >= 3, seen
    print("\n".join(seen))


def test_no_second_gate_or_op_definition_outside_the_patched_modules(release):
    """A module that defines its own function named like the op or the gate would be a call
    path install() does not reach."""
    version, root = release
    if EXPECTED[version] is None:
        pytest.skip("refused layout")
    src = Source(root)
    layout, gate = shim.detect_layout(src.import_module)
    allowed = {layouts.OP_NAME: {layouts.FUSION_MODULE}, gate: {layout.gate_module}}
    for mod in src.modules(containing=tuple(allowed)):
        for node in src.tree(mod).body:
            if isinstance(node, ast.FunctionDef) and node.name in allowed:
                assert mod in allowed[node.name], f"{mod} defines {node.name}"


# The releases whose layernorm defines SGLang's per-group FP8 hook (layouts.QUANT_HOOK).
HAS_QUANT_HOOK = {"0.5.14": False, "0.5.20": True, "0.5.21": True, "0.5.23": True}


def _returns(fn_node):
    return [n.value for n in ast.walk(fn_node) if isinstance(n, ast.Return)]


def test_the_per_group_fp8_hook_has_the_contract_arfuse_serves(release):
    """The hook's parameters are the ones arfuse's replacement takes, in order, and it answers
    only None, ((fp8, scale), residual) or ((bf16, fp8, scale), residual): the forms arfuse
    hands back (fp8, scale) and, declining, SGLang's own None."""
    import inspect

    version, root = release
    if EXPECTED[version] is None:
        pytest.skip("refused layout")
    norm_mod = Source(root).import_module(layouts.QUANT_HOOK_MODULE)
    hook = vars(norm_mod).get(layouts.QUANT_HOOK)
    assert isinstance(hook, Function) is HAS_QUANT_HOOK[version], version
    if not HAS_QUANT_HOOK[version]:
        return
    ours = list(inspect.signature(shim.forward_with_allreduce_fusion_quant_per_group).parameters)
    assert hook.params() == ours == list(layouts.QUANT_HOOK_PARAMS)
    defaults = {a.arg: d.value for a, d in zip(hook.node.args.args[-len(hook.node.args.defaults):],
                                               hook.node.args.defaults)}
    assert defaults == {"group_size": layouts.QUANT_GROUP_SIZE, "use_attn_tp_group": True,
                        "keep_bf16": False}
    forms = set()
    for value in _returns(hook.node):
        if value is None or (isinstance(value, ast.Constant) and value.value is None):
            forms.add("None")
            continue
        assert isinstance(value, ast.Tuple) and len(value.elts) == 2, ast.dump(value)
        quant, residual = value.elts
        assert isinstance(quant, ast.Tuple) and isinstance(residual, ast.Name)
        names = [e.id for e in quant.elts]
        assert "residual" in residual.id, names
        if len(names) == 2:
            assert "fp8" in names[0] and "scale" in names[1], names
            forms.add("(fp8, scale)")
        else:
            assert len(names) == 3 and "bf16" in names[0] and "fp8" in names[1] and \
                "scale" in names[2], names
            forms.add("(bf16, fp8, scale)")
    assert forms == {"None", "(fp8, scale)", "(bf16, fp8, scale)"}, forms


def test_install_puts_arfuse_in_the_hooks_place_where_a_release_has_it(release):
    version, root = release
    if EXPECTED[version] is None:
        pytest.skip("refused layout")
    src = Source(root)
    patched = shim.install(import_module=src.import_module)
    norm_mod = src.import_module(layouts.QUANT_HOOK_MODULE)
    name = f"{layouts.QUANT_HOOK_MODULE}.{layouts.QUANT_HOOK}"
    if not HAS_QUANT_HOOK[version]:
        assert name not in patched and not shim._state.quant_hook_installed
        assert layouts.QUANT_HOOK not in vars(norm_mod)
        return
    assert name in patched
    assert vars(norm_mod)[layouts.QUANT_HOOK] is shim.forward_with_allreduce_fusion_quant_per_group
    # Before setup the hook declines and answers what SGLang's own hook answers.
    assert shim.status()["fp8"]["served"] is False
    shim.uninstall()
    assert isinstance(vars(norm_mod)[layouts.QUANT_HOOK], Function)


def test_the_norms_reach_the_hook_through_the_patched_module_name(release):
    """RMSNorm's and GemmaRMSNorm's forward_with_allreduce_fusion_quant_per_group call the
    hook by its module-level name (looked up at call time), so replacing the module attribute
    reaches both; no other binding of it exists in sglang/srt."""
    version, root = release
    if EXPECTED[version] is None or not HAS_QUANT_HOOK[version]:
        pytest.skip("no per-group FP8 hook in this release")
    src = Source(root)
    tree = src.tree(layouts.QUANT_HOOK_MODULE)
    classes = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and fn.name == layouts.QUANT_HOOK_METHOD:
                calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call)
                         and isinstance(c.func, ast.Name) and c.func.id == layouts.QUANT_HOOK]
                classes[cls.name] = len(calls)
                assert local_import(fn, layouts.QUANT_HOOK_MODULE, layouts.QUANT_HOOK) is None
    assert classes.get("RMSNorm") == 1 and classes.get("GemmaRMSNorm") == 1, classes
    for mod in src.modules(containing=(layouts.QUANT_HOOK,)):
        assert mod == layouts.QUANT_HOOK_MODULE, f"{mod} names {layouts.QUANT_HOOK}"


def test_sglangs_callers_ask_the_hook_only_on_rocm_aiter(release):
    """Where SGLang decides to call the norms' per-group FP8 method (a hasattr check), the same
    condition requires _use_aiter: on CUDA its caller does not ask the hook and runs the fused
    allreduce + RMSNorm and a separate per-group quant (docs/integration.md). A release that
    asks it elsewhere fails here, for the docs and the decision to be revisited."""
    version, root = release
    if EXPECTED[version] is None or not HAS_QUANT_HOOK[version]:
        pytest.skip("no per-group FP8 hook in this release")
    src = Source(root)
    checks, sites = [], []
    for mod in src.modules(containing=(layouts.QUANT_HOOK_METHOD,)):
        if mod == layouts.QUANT_HOOK_MODULE:
            continue
        tree = src.tree(mod)
        for n in ast.walk(tree):
            if isinstance(n, ast.BoolOp) and any(
                    isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                    and c.func.id == "hasattr" and any(
                        isinstance(a, ast.Constant) and a.value == layouts.QUANT_HOOK_METHOD
                        for a in c.args) for c in n.values):
                names = {x.id for x in ast.walk(n) if isinstance(x, ast.Name)}
                checks.append((mod, n.lineno, "_use_aiter" in names))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and \
                    n.func.attr == layouts.QUANT_HOOK_METHOD:
                sites.append((mod, n.lineno))
    assert sites, "no caller of the per-group FP8 method"
    assert {m for m, _ in sites} <= {m for m, _, _ in checks}, (sites, checks)
    assert all(aiter for _, _, aiter in checks), checks
