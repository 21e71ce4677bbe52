"""Model packages: manifest, builder, and the per-stage slice resolver."""
