"""Stub (see torchvision/__init__.py)."""
