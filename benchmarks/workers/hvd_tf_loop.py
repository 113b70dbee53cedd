"""A minimal hand-written Horovod TensorFlow loop: the built-in Keras 3 model, a
tf.function step with hvd.DistributedGradientTape, one in-memory batch. Keras 3 variables are
handed to Horovod as their underlying tf.Variables (horovod.tensorflow.keras does not support
Keras 3). Rank 0 writes --out."""

from __future__ import annotations

import argparse
from typing import Any

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf
from peer import batch, model_args, parse_args, report, spec, time_steps

from ringfeed.train.models import build_model


def setup(args: argparse.Namespace) -> tuple[Any, Any, list, list, np.ndarray, np.ndarray]:
    """Horovod started; (model, SGD optimizer, its Keras variables, their tf.Variables, this
    rank's images and labels)."""
    hvd.init()
    keras.utils.set_random_seed(0)
    model = build_model("tensorflow", args.model, model_args(args), spec(args))
    optimizer = keras.optimizers.SGD(learning_rate=args.lr * hvd.size(), momentum=0.9)
    keras_vars = model.trainable_variables
    variables = [v.value for v in keras_vars]  # the tf.Variables Horovod can .ref()
    return model, optimizer, keras_vars, variables, *batch(args, hvd.rank())


def main() -> None:
    args = parse_args()
    model, optimizer, keras_vars, variables, images, labels = setup(args)
    x_u8, y = tf.constant(images), tf.constant(labels)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step() -> tf.Tensor:
        x = tf.cast(x_u8, tf.float32) / 255.0
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, keras_vars, strict=True))
        return loss

    train_step()  # builds the optimizer's slots, then everyone starts from rank 0's weights
    hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
    hvd.broadcast_variables([v.value for v in optimizer.variables], root_rank=0)
    loss_box = [0.0]

    def step() -> None:
        loss_box[0] = float(train_step())  # .numpy(): waits for the step to finish

    times, wall = time_steps(step, args, lambda: hvd.allreduce(tf.zeros(1)).numpy())
    if hvd.rank() == 0:
        report(args, hvd.size(), times, wall, loss_box[0], peer="horovod TF loop")
    hvd.shutdown()


if __name__ == "__main__":
    main()
