"""The framework layer: what the loop asks of a framework (base.py: Backend, StepResult, Dist),
its two implementations (torch.py, tf.py), Horovod's own knobs (horovod_env.py), and
select.py's make_backend, the one place that imports a framework backend, lazily: importing
this package imports neither torch nor TensorFlow.

Depends downwards: ringfeed/, pipeline/'s framework adapters, train's config, data, losses and
models/, and the other rooms' modules it uses (checkpoint, observe, resilience); never loop.py
or main.py, which build and drive it.
"""
