"""The minimal Horovod TensorFlow loop (hvd_tf_loop.py) with the parts ringfeed's TF step adds
switched on one by one, to find which of them costs step time. PARTS (comma list, environment):
args: the batch and settings passed to the tf.function as arguments; stats: a second
allreduce of [loss, save, stop]; cond: the update under tf.cond(loss is finite); grouped:
hvd.grouped_allreduce instead of DistributedGradientTape; apply: optimizer.apply; lr: the
learning rate assigned in the step; ce: ringfeed's cross_entropy; noauto: traced without
AutoGraph. Rank 0 writes --out (peer.py's report).

    PARTS=args,stats,cond horovodrun -np 2 -H localhost:2 --gloo \\
        python benchmarks/workers/tf_step_parts.py --out OUT.json
"""

from __future__ import annotations

import os

import horovod.tensorflow as hvd
import keras
import tensorflow as tf
from hvd_tf_loop import setup
from peer import parse_args, report, time_steps

from ringfeed.train.backends.tf import cross_entropy

PARTS = set(filter(None, os.environ.get("PARTS", "").split(",")))


def main() -> None:
    args = parse_args()
    model, optimizer, keras_vars, variables, images, labels = setup(args)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step_fn(x_u8: tf.Tensor, y: tf.Tensor, settings: tf.Tensor) -> tf.Tensor:
        if "lr" in PARTS:
            optimizer.learning_rate.assign(settings[2])
        x = tf.cast(x_u8, tf.float32) / 255.0
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(cross_entropy(logits, y)) if "ce" in PARTS else loss_fn(y, logits)
        if "grouped" in PARTS:
            grads = hvd.grouped_allreduce(tape.gradient(loss, variables), op=hvd.Average)
        else:
            grads = hvd.DistributedGradientTape(tape).gradient(loss, variables)
        stats = (hvd.allreduce(tf.concat([[loss], settings[:2]], 0), op=hvd.Average,
                               name="stats") if "stats" in PARTS else tf.stack([loss, 0.0, 0.0]))

        def update() -> tf.Tensor:
            if "apply" in PARTS:
                optimizer.apply(grads, keras_vars)
            else:
                optimizer.apply_gradients(zip(grads, keras_vars, strict=True))
            return tf.constant(True)

        applied = (tf.cond(tf.math.is_finite(stats[0]), update, lambda: tf.constant(False))
                   if "cond" in PARTS else update())
        return tf.concat([stats, [tf.cast(applied, tf.float32)]], 0)

    train_step = tf.function(step_fn, autograph="noauto" not in PARTS)
    x_fixed, y_fixed = tf.constant(images), tf.constant(labels)
    settings = (0.0, 0.0, args.lr * hvd.size())

    def call() -> tf.Tensor:
        if "args" in PARTS:  # made tensors on every call, as ringfeed's train_step does
            return train_step(tf.convert_to_tensor(images), tf.convert_to_tensor(labels),
                              tf.constant(settings, tf.float32))
        return train_step(x_fixed, y_fixed, tf.constant(settings, tf.float32))

    call()  # builds the optimizer's slots, then everyone starts from rank 0's weights
    hvd.broadcast_variables([v.value for v in model.variables], root_rank=0)
    hvd.broadcast_variables([v.value for v in optimizer.variables], root_rank=0)
    loss_box = [0.0]

    def step() -> None:
        loss_box[0] = call().numpy().tolist()[0]  # waits for the step to finish

    times, wall = time_steps(step, args, lambda: hvd.allreduce(tf.zeros(1)).numpy())
    if hvd.rank() == 0:
        report(args, hvd.size(), times, wall, loss_box[0],
               peer="horovod TF loop + " + (",".join(sorted(PARTS)) or "nothing"))
    hvd.shutdown()


if __name__ == "__main__":
    main()
