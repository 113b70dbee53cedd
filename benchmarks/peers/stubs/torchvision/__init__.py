"""A stub of torchvision for benchmarks/.peers-venv (see benchmarks/peers/setup.sh): PyPI's
torchvision is a CUDA build that does not load beside the CPU torch there, and MosaicML
Streaming imports two names from it at `import streaming` (streaming/vision/base.py) that the
benchmark never uses. No `__version__`, no dist-info: libraries that probe for torchvision's
distribution (LitData) see none and decode with PIL."""
