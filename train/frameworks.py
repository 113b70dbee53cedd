"""Which framework layer a run uses. The one place that imports a backend module, and it does so
lazily on purpose: importing both torch and TensorFlow costs seconds and GBs, and each Horovod
binding (horovod.torch, horovod.tensorflow) initialises its own framework, so a run imports
exactly the one its config names."""

from __future__ import annotations

from ringfeed.train.backend import Backend


def make_backend(cfg) -> Backend:
    """Import the framework named by cfg.framework (and Horovod for it), hvd.init() included."""
    if cfg.framework == "torch":
        from ringfeed.train.torch_backend import TorchBackend

        return TorchBackend(cfg)
    from ringfeed.train.tf_backend import TFBackend

    return TFBackend(cfg)
