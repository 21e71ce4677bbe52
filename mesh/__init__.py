"""Mesh: a pipeline-parallel serving mesh for large language models."""

__version__ = "0.1.0"
