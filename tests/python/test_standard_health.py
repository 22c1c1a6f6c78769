"""A standard gRPC health client (grpcio-health-checking, not ours) gets SERVING for "" from both
the main Unix socket and the plaintext probe port, as Kubernetes' grpc probes would."""
import os
import re
import subprocess
import tempfile
import time

import grpc
import pytest

health_pb2 = pytest.importorskip("grpc_health.v1.health_pb2")
health_pb2_grpc = pytest.importorskip("grpc_health.v1.health_pb2_grpc")


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
