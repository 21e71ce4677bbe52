"""Generated gRPC stubs for the mesh.v1 protocol (scripts/gen_proto.py; do not edit)."""
