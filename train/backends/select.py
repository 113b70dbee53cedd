"""Which framework layer a run uses. The one place that imports a backend module, and it does so
lazily on purpose: importing both torch and TensorFlow costs seconds and GBs, and each Horovod
binding (horovod.torch, horovod.tensorflow) initialises its own framework, so a run imports
exactly the one its config names."""

from __future__ import annotations

import sys

from ringfeed.train.backends.base import Backend

# Importing TensorFlow imports Keras 3, which imports scikit-learn (for keras.wrappers'
# SKLearnClassifier) and matplotlib.pyplot (for keras.visualization) whenever they are
# installed: 1.5-2 s of CPU of a 6.5 s import on the 2-core box, in every TensorFlow rank.
# Keras imports both optionally, so a rank imports TensorFlow with them hidden; imported
# later (by a user's module), they load as usual.
KERAS_OPTIONAL_IMPORTS = ("sklearn", "matplotlib.pyplot")


def import_tensorflow_for_training() -> None:
    """Import TensorFlow and Keras without Keras's optional scikit-learn and pyplot hooks
    (keras.wrappers' scikit-learn estimators and keras.visualization are then unavailable in
    this process)."""
    if "tensorflow" in sys.modules:
        return
    hidden = [name for name in KERAS_OPTIONAL_IMPORTS if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # `import name` raises ImportError: Keras goes without it
    try:
        import keras  # noqa: F401
        import tensorflow  # noqa: F401
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def make_backend(cfg) -> Backend:
    """Import the framework named by cfg.framework (and Horovod for it), hvd.init() included."""
    if cfg.framework == "torch":
        from ringfeed.train.backends.torch import TorchBackend

        return TorchBackend(cfg)
    import_tensorflow_for_training()
    from ringfeed.train.backends.tf import TFBackend

    return TFBackend(cfg)
