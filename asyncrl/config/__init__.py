"""Typed configs composed from YAML (see loader.py)."""
