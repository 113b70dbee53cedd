"""torchvision's ImageNet models as ringfeed model factories, for `model.name:
vision_models:resnet50` with `PYTHONPATH=examples` (examples/configs/imagenet.yaml).

torchvision's own `resnet50` cannot be named directly: it takes `**kwargs`, so ringfeed would
pass it `spec` too. torchvision is not installed by `make setup` (PyPI's wheel is a CUDA build
that does not load beside its CPU torch): install it where the GPUs are.
"""

from __future__ import annotations

from typing import Any


def resnet50(spec: Any, zero_init_residual: bool = False) -> Any:
    """torchvision's ResNet-50 with no pretrained weights and the data's number of classes;
    takes (N, 3, H, W) images, returns logits."""
    from torchvision.models import resnet50 as torchvision_resnet50

    return torchvision_resnet50(weights=None, num_classes=spec.require("num_classes"),
                                zero_init_residual=zero_init_residual)
