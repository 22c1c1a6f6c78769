"""vLLM integration, without torch (CI): the pinned releases' real source has every name and
signature arfuse.integrations.vllm relies on; a layout it does not know is refused, at run time
with an ERROR naming the version and nothing patched; the entry point is declared."""
import logging
import pathlib
import shutil
import sys
import textwrap

import pytest

import layout_ast
from arfuse.integrations import vllm as av

REPO = pathlib.Path(__file__).resolve().parents[3]


def test_the_pinned_release_has_the_known_layout(vllm_source):
    version, src = vllm_source
    assert (src / "vllm").is_dir()
    assert layout_ast.check(src, av.LAYOUT) == [], version
    assert version in av.TESTED_VERSIONS


def test_metadata_names_the_release(vllm_source):
    version, src = vllm_source
    meta = next(src.glob("vllm-*.dist-info/METADATA")).read_text()
    assert f"\nVersion: {version}\n" in meta


def _mutated(src, tmp_path, rel, old, new):
    dest = tmp_path / "src"
    shutil.copytree(src / "vllm", dest / "vllm")
    f = dest / "vllm" / rel
    text = f.read_text()
    assert old in text
    f.write_text(text.replace(old, new))
    return dest


@pytest.mark.parametrize("rel,old,new,words", [
    ("compilation/passes/pass_manager.py", "AllReduceFusionPass(config)",
     "FlashInferAllReduceFusionPass(config)", "AllReduceFusionPass"),
    ("ir/ops/layernorm.py", "def fused_add_rms_norm(\n    x: Tensor,\n    x_residual",
     "def fused_add_rms_norm(\n    x: Tensor,\n    residual", "fused_add_rms_norm"),
    ("distributed/parallel_state.py", "group_name=self.unique_name)",
     "group=self.unique_name)", "torch.ops.vllm.all_reduce"),
    ("plugins/__init__.py", 'DEFAULT_PLUGINS_GROUP = "vllm.general_plugins"',
     'DEFAULT_PLUGINS_GROUP = "vllm.plugins"', "general_plugins"),
])
def test_an_unknown_layout_is_refused_by_the_check(vllm_source, tmp_path, rel, old, new, words):
    _, src = vllm_source
    if rel == "ir/ops/layernorm.py" and "x_residual" not in (src / "vllm" / rel).read_text():
        pytest.skip("layout differs already")
    problems = layout_ast.check(_mutated(src, tmp_path, rel, old, new), av.LAYOUT)
    assert problems and any(words in p for p in problems), problems


FAKE_VLLM = {
    "vllm/__init__.py": "__version__ = '9.9.9'\n",
    "vllm/plugins/__init__.py": "DEFAULT_PLUGINS_GROUP = 'vllm.general_plugins'\n",
    "vllm/compilation/__init__.py": "",
    "vllm/compilation/passes/__init__.py": "",
    # A pass manager that no longer builds AllReduceFusionPass by that name.
    "vllm/compilation/passes/pass_manager.py": textwrap.dedent("""
        class PostGradPassManager:
            def configure(self, config):
                self.passes = [FusedCollectivePass(config)]
        """),
    "vllm-9.9.9.dist-info/METADATA": "Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.9\n",
}


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    for rel, text in FAKE_VLLM.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    yield tmp_path
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]
    av.unregister()


def test_register_refuses_an_unknown_layout_with_an_error_naming_the_version(
        fake_vllm, monkeypatch, caplog):
    monkeypatch.setenv("ARFUSE_SOCKET", "/run/arfuse/rank{rank}.sock")
    monkeypatch.delenv("ARFUSE_VLLM", raising=False)
    pm = sys.modules.get("vllm.compilation.passes.pass_manager")
    with caplog.at_level(logging.ERROR, logger="arfuse.integrations.vllm"):
        av.register()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert "vLLM 9.9.9" in errors[0] and "fused allreduce off" in errors[0]
    assert "PostGradPassManager.configure refers to AllReduceFusionPass" in errors[0]
    assert "vllm.ir.ops" in errors[0]
    assert av.status()["patched"] == [] and not av.status()["registered"]
    import vllm.compilation.passes.pass_manager as pm
    assert not hasattr(pm, "AllReduceFusionPass")


def test_register_is_off_without_a_socket_or_with_arfuse_vllm_0(fake_vllm, monkeypatch,
                                                                caplog):
    monkeypatch.delenv("ARFUSE_SOCKET", raising=False)
    with caplog.at_level(logging.DEBUG, logger="arfuse.integrations.vllm"):
        av.register()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert av.status()["patched"] == []
    assert not av.enabled({"ARFUSE_SOCKET": "/s{rank}", "ARFUSE_VLLM": "0"})
    assert av.enabled({"ARFUSE_SOCKET": "/s{rank}"})
    assert av.enabled({"ARFUSE_SOCKET": "/s{rank}", "ARFUSE_VLLM": "1"})
    assert not av.enabled({"ARFUSE_VLLM": "1"})


def test_the_package_declares_the_general_plugins_entry_point():
    import tomllib
    meta = tomllib.loads((REPO / "client" / "python" / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["vllm.general_plugins"] == {
        "arfuse": "arfuse.integrations.vllm:register"}
