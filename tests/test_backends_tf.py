"""The TensorFlow backend's own rules (train/backends/tf.py) outside a launch: the per-sample
cross entropy (sequences averaged over positions, label smoothing as Keras' categorical one,
a softmax-ending model's probabilities read as logits), accuracy and top-k (ties count in),
the optimizer each config makes, and the elastic state's commit/restore of variables.
Integration tier: importing TensorFlow costs ~8 s. Training with it: test_train.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ringfeed.train.config import OptimSection

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tfb():
    """The backend module, imported by the first test that runs (not at collection: the unit
    tier collects this file and must not pay TensorFlow's import)."""
    pytest.importorskip("tensorflow")
    import ringfeed.train.backends.tf as module

    return module


@pytest.fixture(scope="module")
def tf(tfb):
    return tfb.tf


@pytest.fixture(scope="module")
def keras(tfb):
    return tfb.keras


def test_cross_entropy_is_per_sample_and_averages_a_sequences_positions(tf, tfb):
    logits = tf.constant([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    targets = tf.constant([0, 2])
    expected = [-math.log(math.exp(2) / (math.exp(2) + 2)), math.log(3)]
    assert tfb.cross_entropy(logits, targets).numpy().tolist() == pytest.approx(expected)
    sequences = tf.stack([logits, logits])  # (B=2, T=2, V=3)
    per_sample = tfb.cross_entropy(sequences, tf.constant([[0, 2], [2, 2]])).numpy()
    assert per_sample.shape == (2,)
    assert per_sample.tolist() == pytest.approx([np.mean(expected),
                                                 np.mean([-math.log(1 / (math.exp(2) + 2)),
                                                          math.log(3)])])
    half = tfb.cross_entropy(tf.cast(logits, tf.float16), targets)
    assert half.dtype == tf.float32


def test_label_smoothing_spreads_s_over_the_classes(tf, tfb):
    logits = tf.constant([[3.0, 1.0, -1.0]])
    s = 0.3
    log_p = tf.nn.log_softmax(logits).numpy()[0]
    target = (1 - s) * np.eye(3)[1] + s / 3
    assert tfb.cross_entropy(logits, tf.constant([1]), s).numpy()[0] == \
        pytest.approx(-(target * log_p).sum(), rel=1e-5)


def test_a_softmax_ending_model_is_told_and_its_probabilities_give_the_same_loss(tf, keras, tfb):
    inputs = keras.Input((4,))
    softmaxed = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(inputs))
    separate = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                                 keras.layers.Softmax()])
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    assert tfb.ends_in_softmax(softmaxed) and tfb.ends_in_softmax(separate)
    assert not tfb.ends_in_softmax(plain)
    logits = tf.constant([[1.0, 2.0, 0.5], [0.0, -3.0, 4.0]])
    targets = tf.constant([1, 0])
    assert tfb.probabilities_cross_entropy(tf.nn.softmax(logits), targets).numpy() == \
        pytest.approx(tfb.cross_entropy(logits, targets).numpy(), rel=1e-5)


def test_accuracy_and_top_k_with_ties_counting_in(tf, tfb):
    logits = tf.constant([[0.1, 0.9, 0.0, 0.0, 0.0, 0.0],
                          [0.5, 0.5, 0.5, 0.5, 0.5, 0.5],  # all tied: in every top-k
                          [0.6, 0.5, 0.4, 0.3, 0.2, 0.1]])
    m = tfb.accuracy(logits, tf.constant([1, 5, 5]), topk=5)
    assert m["accuracy"].numpy().tolist() == [1.0, 0.0, 0.0]
    assert m["top5"].numpy().tolist() == [1.0, 1.0, 0.0]
    assert set(tfb.accuracy(logits[:, :5], tf.constant([1, 4, 4]), topk=5)) == {"accuracy"}


@pytest.mark.parametrize("section, cls, settings", [
    ({"name": "sgd", "lr": 0.1, "momentum": 0.8}, "SGD", {"momentum": 0.8}),
    ({"name": "adam", "betas": (0.8, 0.99)}, "Adam", {"beta_1": 0.8, "beta_2": 0.99,
                                                      "epsilon": 1e-8}),
    ({"name": "adamw", "weight_decay": 0.05}, "AdamW", {"weight_decay": 0.05}),
])
def test_the_optimizer_of_each_config(tfb, section, cls, settings):
    opt = tfb.make_optimizer(OptimSection(**section), grad_clip=1.5)
    assert type(opt).__name__ == cls and opt.global_clipnorm == 1.5
    config = opt.get_config()
    for key, value in settings.items():
        assert config[key] == pytest.approx(value)
    assert tfb.make_optimizer(OptimSection(), None).weight_decay is None  # 0: none at all
    # AdamW with weight decay 0 (its default here): Keras' AdamW refuses None
    assert tfb.make_optimizer(OptimSection(name="adamw"), None).weight_decay == 0.0


def test_the_elastic_state_restores_the_committed_variables_and_values(tf, tfb):
    variables = [tf.Variable([1.0, 2.0]), tf.Variable(3.0)]
    state = tfb.VariablesState(variables, progress={"step": 0})
    variables[0].assign([5.0, 6.0])
    state.progress = {"step": 4}
    state.save()  # a commit (without the host check, which needs a running Horovod)
    variables[1].assign(9.0)
    state.progress = {"step": 7}
    state.restore()  # a lost worker: back to the commit
    assert variables[0].numpy().tolist() == [5.0, 6.0] and float(variables[1].numpy()) == 3.0
    assert state.progress == {"step": 4}
