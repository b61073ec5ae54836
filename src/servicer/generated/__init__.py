"""Generated protobuf/gRPC code lives here, built by tools/gen_proto.py."""
