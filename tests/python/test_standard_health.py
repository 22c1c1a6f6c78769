"""A standard gRPC health client (grpcio-health-checking, not ours) gets SERVING for "" from both
the main Unix socket and the plaintext probe port, as Kubernetes' grpc probes would.

Where grpcio-health-checking is not installed (Debian packages no python3 module of it), the
client is generated from the standard grpc/health/v1/health.proto with the system's protoc and
grpc_python_plugin (the packages the C++ build uses), still none of our code."""
import importlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import grpc
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _health_modules():
    try:
        return (importlib.import_module("grpc_health.v1.health_pb2"),
                importlib.import_module("grpc_health.v1.health_pb2_grpc"))
    except ImportError:
        pass
    protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
    if not protoc or not plugin:
        pytest.skip("neither grpcio-health-checking nor protoc + grpc_python_plugin is installed")
    # Compiled as a top-level health.proto: a grpc/health/v1/ module path would fall under the
    # installed grpc package.
    out = tempfile.mkdtemp(prefix="arfuse-health-stubs-")
    shutil.copy(REPO / "proto" / "grpc" / "health" / "v1" / "health.proto", out)
    subprocess.run([protoc, f"-I{out}", f"--python_out={out}", f"--grpc_python_out={out}",
                    f"--plugin=protoc-gen-grpc_python={plugin}", "health.proto"], check=True)
    sys.path.insert(0, out)
    return importlib.import_module("health_pb2"), importlib.import_module("health_pb2_grpc")


health_pb2, health_pb2_grpc = _health_modules()


def test_standard_client_sees_serving_on_socket_and_port(arfused):
    d = tempfile.mkdtemp(prefix="arfuse-health-")
    sock = os.path.join(d, "a.sock")
    proc = subprocess.Popen([arfused, "--device=host", f"--socket={sock}", "--health-port=0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = ""
        deadline = time.time() + 30
        while "ready to accept" not in line and time.time() < deadline:
            line = proc.stdout.readline()
        m = re.search(r"health_port=(\d+)", line)
        assert m, f"no ready line from arfused: {line!r}"
        for addr in (f"unix:{sock}", f"127.0.0.1:{m.group(1)}"):
            with grpc.insecure_channel(addr) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                got = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                assert got.status == health_pb2.HealthCheckResponse.SERVING, addr
                with pytest.raises(grpc.RpcError) as e:
                    stub.Check(health_pb2.HealthCheckRequest(service="no.such"), timeout=10)
                assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
