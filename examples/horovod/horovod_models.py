"""The models of Horovod's example scripts as ringfeed model factories, for `model.name:
horovod_models:<factory>` with `PYTHONPATH=examples/horovod` (the configs beside this file).

Each takes ringfeed's `spec` (spec.input_shape: one sample, H x W x C; spec.num_classes) and
returns the model as the script builds it; the imports are inside, so a torch run never loads
Keras and the other way round.
"""

from __future__ import annotations

from typing import Any

# Horovod's Keras ImageNet script: BatchNormalization as trained from scratch, not Keras'
# inference-tuned default (momentum 0.99, epsilon 1e-3)
BN_MOMENTUM, BN_EPSILON = 0.9, 1e-5


def mnist_net(spec: Any) -> Any:
    """pytorch_mnist.py's Net: two convolutions, dropout, two dense layers, log-probabilities
    out (ringfeed's cross entropy of log-probabilities is the script's nll_loss: log_softmax
    leaves them unchanged). Needs 28 x 28 x 1 images (data.image_size 28, data.channels 1)."""
    import torch.nn.functional as F
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
            self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
            self.conv2_drop = nn.Dropout2d()
            self.fc1 = nn.Linear(320, 50)
            self.fc2 = nn.Linear(50, spec.num_classes)

        def forward(self, x):
            x = F.relu(F.max_pool2d(self.conv1(x), 2))
            x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
            x = F.relu(self.fc1(x.flatten(1)))
            return F.log_softmax(self.fc2(F.dropout(x, training=self.training)), dim=1)

    return Net()


def keras_mnist(spec: Any) -> Any:
    """keras_mnist.py's Sequential model (ending in a softmax, as there)."""
    import keras
    from keras import layers

    return keras.Sequential([
        keras.Input(spec.input_shape),
        layers.Conv2D(32, (3, 3), activation="relu"),
        layers.Conv2D(64, (3, 3), activation="relu"),
        layers.MaxPooling2D((2, 2)),
        layers.Dropout(0.25),
        layers.Flatten(),
        layers.Dense(128, activation="relu"),
        layers.Dropout(0.5),
        layers.Dense(spec.num_classes, activation="softmax"),
    ], name="keras_mnist")


def keras_resnet50(spec: Any, weight_decay: float = 5e-5) -> Any:
    """keras_imagenet_resnet50.py's model: Keras' ResNet50 (no weights, logits out) with an L2
    kernel_regularizer of `weight_decay` (the script's --wd: its only weight decay, which
    ringfeed adds to the loss as Model.fit does) and BatchNormalization momentum 0.9."""
    import keras

    model = keras.applications.ResNet50(weights=None, input_shape=spec.input_shape,
                                        classes=spec.num_classes, classifier_activation=None)
    return horovod_recipe(model, weight_decay)


def keras_small(spec: Any, weight_decay: float = 5e-5, width: int = 4) -> Any:
    """A small conv net with BatchNormalization under the same recipe (the suite's stand-in
    for ResNet50: `--set model.name=horovod_models:keras_small`)."""
    import keras
    from keras import layers

    inputs = keras.Input(spec.input_shape)
    x = layers.Conv2D(width, 3, padding="same")(inputs)
    x = layers.ReLU()(layers.BatchNormalization()(x))
    x = layers.GlobalAveragePooling2D()(x)
    return horovod_recipe(keras.Model(inputs, layers.Dense(spec.num_classes)(x)), weight_decay)


def horovod_recipe(model: Any, weight_decay: float) -> Any:
    """The script's rebuild of a Keras model from its config: every layer with a
    kernel_regularizer gets L2(weight_decay), every BatchNormalization momentum 0.9 and
    epsilon 1e-5."""
    import keras

    config = model.get_config()
    for layer, layer_config in zip(model.layers, config["layers"], strict=True):
        if hasattr(layer, "kernel_regularizer"):
            layer_config["config"]["kernel_regularizer"] = keras.regularizers.serialize(
                keras.regularizers.L2(weight_decay))
        if isinstance(layer, keras.layers.BatchNormalization):
            layer_config["config"].update(momentum=BN_MOMENTUM, epsilon=BN_EPSILON)
    return keras.Model.from_config(config)
