"""gRPC server reflection on arfused's main socket: a generic client (grpcurl, Postman) lists the
services and gets their descriptors without the .proto files; the health port serves
grpc.health.v1 only.

The reflection messages (grpc.reflection.v1alpha) are described here by their field numbers only,
as a client without the reflection package would: a private descriptor pool, no generated code.
"""
import re

import pytest

import arfuse_run as run

grpc = pytest.importorskip("grpc")
from google.protobuf import descriptor_pb2, descriptor_pool  # noqa: E402

try:
    from google.protobuf.message_factory import GetMessageClass
except ImportError:  # protobuf < 4.22
    from google.protobuf import message_factory

    def GetMessageClass(desc):
        return message_factory.MessageFactory().GetPrototype(desc)

METHOD = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


def _reflection_messages():
    f = descriptor_pb2.FileDescriptorProto(name="reflection_probe.proto",
                                           package="grpc.reflection.v1alpha", syntax="proto3")
    T = descriptor_pb2.FieldDescriptorProto

    def message(name, *fields, oneof=()):
        m = f.message_type.add(name=name)
        if oneof:
            m.oneof_decl.add(name="message")
        for fname, number, ftype, label, type_name in fields:
            fd = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                fd.type_name = ".grpc.reflection.v1alpha." + type_name
            if fname in oneof:
                fd.oneof_index = 0  # so that an empty list_services="" is still sent

    opt, rep = T.LABEL_OPTIONAL, T.LABEL_REPEATED
    message("ServerReflectionRequest", ("host", 1, T.TYPE_STRING, opt, None),
            ("file_containing_symbol", 4, T.TYPE_STRING, opt, None),
            ("list_services", 7, T.TYPE_STRING, opt, None),
            oneof=("file_containing_symbol", "list_services"))
    message("FileDescriptorResponse", ("file_descriptor_proto", 1, T.TYPE_BYTES, rep, None))
    message("ServiceResponse", ("name", 1, T.TYPE_STRING, opt, None))
    message("ListServiceResponse", ("service", 1, T.TYPE_MESSAGE, rep, "ServiceResponse"))
    message("ErrorResponse", ("error_code", 1, T.TYPE_INT32, opt, None),
            ("error_message", 2, T.TYPE_STRING, opt, None))
    message("ServerReflectionResponse", ("valid_host", 1, T.TYPE_STRING, opt, None),
            ("file_descriptor_response", 4, T.TYPE_MESSAGE, opt, "FileDescriptorResponse"),
            ("list_services_response", 6, T.TYPE_MESSAGE, opt, "ListServiceResponse"),
            ("error_response", 7, T.TYPE_MESSAGE, opt, "ErrorResponse"),
            oneof=("file_descriptor_response", "list_services_response", "error_response"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    fd = pool.FindFileByName("reflection_probe.proto")
    return (GetMessageClass(fd.message_types_by_name["ServerReflectionRequest"]),
            GetMessageClass(fd.message_types_by_name["ServerReflectionResponse"]))


Request, Response = _reflection_messages()


def _ask(target, *requests):
    with grpc.insecure_channel(target) as channel:
        call = channel.stream_stream(METHOD, request_serializer=Request.SerializeToString,
                                     response_deserializer=Response.FromString)
        return list(call(iter(requests), timeout=10))


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    d = tmp_path_factory.mktemp("reflection")
    sock = d / "arfused.sock"
    with run.host_sidecar(d) as s:
        s.wait_for(run.READY_LINE)
        port = re.search(r"ready to accept: .*health_port=(\d+)", s.text()).group(1)
        yield f"unix:{sock}", f"127.0.0.1:{port}"


def test_main_socket_lists_every_service(sidecar):
    main, _ = sidecar
    (reply,) = _ask(main, Request(list_services=""))
    names = {s.name for s in reply.list_services_response.service}
    assert {"arfuse.v1.Config", "arfuse.v1.Fusion", "arfuse.v1.Admin", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= names, names


def test_descriptors_describe_the_admin_service(sidecar):
    main, _ = sidecar
    (reply,) = _ask(main, Request(file_containing_symbol="arfuse.v1.Admin"))
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in reply.file_descriptor_response.file_descriptor_proto]
    admin = next(f for f in files if f.name == "arfuse/v1/admin.proto")
    methods = {m.name for s in admin.service if s.name == "Admin" for m in s.method}
    assert {"GetStats", "Drain", "SetBackend", "Reinitialize"} <= methods
    request = next(m for m in admin.message_type if m.name == "SetBackendRequest")
    assert {f.name for f in request.field} >= {"backend", "collective_id"}
    # An unknown symbol is an error reply, not a broken stream.
    (missing,) = _ask(main, Request(file_containing_symbol="arfuse.v1.NoSuchService"))
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_health_port_serves_no_reflection(sidecar):
    _, health = sidecar
    with pytest.raises(grpc.RpcError) as e:
        _ask(health, Request(list_services=""))
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED, e.value
