# Generated protobuf and gRPC modules of arfuse.v1 live here (git-ignored); arfuse._proto makes
# them from proto/arfuse/v1 with grpc_tools.protoc.
