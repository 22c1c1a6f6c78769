"""Fixtures for the deployment checks: arfused's flags, the image, the rendered overlays."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import arfuse_deploy_checks as checks  # noqa: E402


@pytest.fixture(scope="session")
def flags():
    return checks.flags_from_options_cc()


@pytest.fixture(scope="session")
def dockerfile_text():
    return checks.DOCKERFILE.read_text()


@pytest.fixture(scope="session")
def image(dockerfile_text):
    return checks.image_from_dockerfile(dockerfile_text)


@pytest.fixture(scope="session")
def kubectl():
    path = checks.find_kubectl()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("kubectl not found: scripts/setup installs it (Debian: kubernetes-client)")
        pytest.skip("kubectl not found (Debian: kubernetes-client); run scripts/setup")
    # The manifests use kustomize components and inline patches: kustomize v5 (kubectl >= 1.27).
    # Debian 12's kubernetes-client (1.20, kustomize v2) cannot render them.
    out = subprocess.run([path, "version", "--client"], capture_output=True, text=True)
    m = re.search(r"Kustomize Version: v(\d+)", out.stdout + out.stderr)
    if not m or int(m.group(1)) < 5:
        msg = (f"{path} embeds no kustomize v5 ({(out.stdout + out.stderr).strip()[:200]}); "
               "deploy/k8s needs kubectl >= 1.27 (set KUBECTL to one)")
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@pytest.fixture(scope="session")
def rendered(kubectl):
    """Overlay name -> the documents `kubectl kustomize` renders for it."""
    return {o.name: checks.kustomize(o, kubectl) for o in checks.overlays()}


@pytest.fixture(scope="session")
def arfused_help():
    binary = checks.arfused_binary()
    if binary is None:
        pytest.skip("arfused is not built (build/server/daemon/arfused); options.cc was checked instead")
    ran = checks.run_help(binary)
    if ran.returncode != 0:
        # Built with CUDA on a machine without the driver (libcuda.so.1), for example.
        reason = (ran.stderr or ran.stdout).strip().splitlines()[-1:] or ["no output"]
        pytest.skip(f"{binary} --help cannot run here ({reason[0][:160]}); options.cc was checked instead")
    names = checks.flag_names_from_help(binary)
    if not names:
        pytest.fail(f"{binary} --help listed no flags")
    return names
