"""Stub (see torchvision/__init__.py)."""


def to_tensor(pic):
    raise NotImplementedError("torchvision is stubbed in benchmarks/.peers-venv")
