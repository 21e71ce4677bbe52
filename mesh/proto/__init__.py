"""Wire protocol stubs; the generated modules live in mesh.proto.v1."""
