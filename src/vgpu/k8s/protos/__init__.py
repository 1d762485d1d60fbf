"""gRPC stubs generated from the .proto files here by tools/gen_protos.py (checked in)."""
