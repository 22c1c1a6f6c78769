"""arfuse.integrations.sglang without SGLang: install() against stub modules shaped like
upstream's (sglang.srt.layers.flashinfer_comm_fusion and its callers), and the op's
"unavailable" answers before any setup. The torch parts (the vote, the op on tensors) are in
test_torch_op.py."""
import sys
import types

import pytest

from arfuse.integrations import sglang as shim

UPSTREAM_NAMES = ("flashinfer_allreduce_residual_rmsnorm", "is_flashinfer_allreduce_unavailable",
                  "ensure_workspace_initialized", "pre_initialize_workspaces",
                  "cleanup_flashinfer_workspace")


def upstream_fusion_module():
    """What sglang/srt/layers/flashinfer_comm_fusion.py exposes (functions as stand-ins)."""
    m = types.ModuleType(shim.FUSION_MODULE)
    for name in UPSTREAM_NAMES + ("fake_flashinfer_allreduce_residual_rmsnorm",):
        def original(*a, _name=name, **k):
            return ("upstream", _name)
        setattr(m, name, original)
    m._flashinfer_comm = None
    return m


def upstream_communicator(fusion):
    """communicator.py binds is_flashinfer_allreduce_unavailable at import and gates on its
    own _is_flashinfer_available."""
    m = types.ModuleType("sglang.srt.layers.communicator")
    m.is_flashinfer_allreduce_unavailable = fusion.is_flashinfer_allreduce_unavailable
    m._is_flashinfer_available = False
    m.FUSE_ALLREDUCE_MAX_BATCH_SIZE = 2048
    return m


def upstream_layernorm():
    """Newer layernorm.py imports the op inside a function: nothing bound at module level."""
    m = types.ModuleType("sglang.srt.layers.layernorm")
    m._is_flashinfer_available = False
    return m


@pytest.fixture(autouse=True)
def clean():
    shim.uninstall()
    yield
    shim.uninstall()


def test_install_replaces_what_callers_use_and_uninstall_restores_it():
    fusion = upstream_fusion_module()
    comm = upstream_communicator(fusion)
    norm = upstream_layernorm()
    before = {n: getattr(fusion, n) for n in UPSTREAM_NAMES}
    comm_before = comm.is_flashinfer_allreduce_unavailable
    patched = shim.install(fusion_module=fusion, caller_modules=[comm, norm],
                           patch_torch_ops=False)
    assert shim.installed()
    for name in UPSTREAM_NAMES:
        assert getattr(fusion, name) is getattr(shim, name), name
    assert comm.is_flashinfer_allreduce_unavailable is shim.is_flashinfer_allreduce_unavailable
    assert comm._is_flashinfer_available is True  # the gate no longer needs FlashInfer
    assert norm._is_flashinfer_available is False  # layernorm's flag is not the fusion gate
    assert not hasattr(norm, "flashinfer_allreduce_residual_rmsnorm")
    assert (comm, "_is_flashinfer_available") in patched
    # Idempotent: a second install changes nothing.
    assert shim.install(fusion_module=fusion, caller_modules=[comm, norm]) == patched
    # What SGLang's callers now get before setup: unavailable, so they keep their own path.
    assert fusion.is_flashinfer_allreduce_unavailable() is True
    assert fusion.flashinfer_allreduce_residual_rmsnorm(object(), object(), object()) == \
        (None, None)
    shim.uninstall()
    assert not shim.installed()
    for name in UPSTREAM_NAMES:
        assert getattr(fusion, name) is before[name], name
    assert comm.is_flashinfer_allreduce_unavailable is comm_before
    assert comm._is_flashinfer_available is False
    assert fusion.flashinfer_allreduce_residual_rmsnorm() == ("upstream",
                                                              "flashinfer_allreduce_residual_"
                                                              "rmsnorm")


def test_install_finds_sglangs_modules_by_name(monkeypatch):
    fusion = upstream_fusion_module()
    comm = upstream_communicator(fusion)
    for name in ("sglang", "sglang.srt", "sglang.srt.layers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, shim.FUSION_MODULE, fusion)
    monkeypatch.setitem(sys.modules, "sglang.srt.layers.communicator", comm)
    monkeypatch.setitem(sys.modules, "sglang.srt.layers.layernorm", None)  # not importable
    original = fusion.flashinfer_allreduce_residual_rmsnorm
    shim.install(patch_torch_ops=False)
    assert fusion.flashinfer_allreduce_residual_rmsnorm is \
        shim.flashinfer_allreduce_residual_rmsnorm
    assert comm._is_flashinfer_available is True
    shim.uninstall()
    assert fusion.flashinfer_allreduce_residual_rmsnorm is original


def test_install_adds_the_op_to_an_older_module_and_removes_it_again():
    fusion = types.ModuleType(shim.FUSION_MODULE)  # an upstream version without the op
    shim.install(fusion_module=fusion, caller_modules=[], patch_torch_ops=False)
    assert fusion.flashinfer_allreduce_residual_rmsnorm is \
        shim.flashinfer_allreduce_residual_rmsnorm
    shim.uninstall()
    assert not hasattr(fusion, "flashinfer_allreduce_residual_rmsnorm")


def test_install_without_sglang_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, shim.FUSION_MODULE, None)
    with pytest.raises(ImportError):
        shim.install(patch_torch_ops=False)
    assert not shim.installed()


def test_the_op_is_unavailable_before_setup_with_upstreams_signature():
    import inspect

    params = list(inspect.signature(shim.flashinfer_allreduce_residual_rmsnorm).parameters)
    assert params == ["input_tensor", "residual", "weight", "eps", "max_token_num",
                      "use_oneshot", "trigger_completion_at_end", "fp32_acc",
                      "use_attn_tp_group"]
    assert shim.flashinfer_allreduce_residual_rmsnorm(
        input_tensor=None, residual=None, weight=None, eps=1e-5, max_token_num=16,
        use_oneshot=True, trigger_completion_at_end=True, fp32_acc=True,
        use_attn_tp_group=False) == (None, None)
    assert shim.is_flashinfer_allreduce_unavailable()
    assert shim.ensure_workspace_initialized(max_token_num=16, hidden_dim=256) is False
