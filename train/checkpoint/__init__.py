"""Checkpoints: files.py the files of one checkpoint (staging, verification, retention,
resume), store.py where they live (a local directory or object storage), checkpointer.py when
a run saves (now or in the background), restores, and how a failed save is handled.

Depends downwards: ringfeed/, train's config and runstate, backends/base.py (the payload's
interface) and resilience/faults.py's test hooks; never loop.py or main.py, which drive it.
"""
