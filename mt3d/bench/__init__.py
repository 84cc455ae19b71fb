"""Benchmarks: python -m mt3d.bench <name> (see __main__.py)."""
