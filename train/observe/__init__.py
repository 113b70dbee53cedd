"""What a run tells: reporter.py (the loop's Reporter: logs, samples, summary), metrics.py
(metrics.jsonl and the console), ranks.py (every rank's times, the straggler), throughput.py
(samples/s, FLOPs, MFU), trackers.py (TensorBoard, MLflow, W&B), runfiles.py (the files rank 0
appends to) and profiler.py (profiler traces on demand).

Depends downwards: ringfeed/, train's config, data and runstate, backends/base.py and
checkpoint's types; never loop.py or main.py, which drive it.
"""
