"""What keeps a run going or ends it cleanly: watchdog.py (the hang watchdog), elastic.py
(Horovod Elastic's retry loop around the trainer), supervise.py (`ringfeed run`: relaunch the
job after a failure) and faults.py (test-only fault injection, a no-op unless RINGFEED_FAULT).

Depends downwards: ringfeed/ and train's runstate; never loop.py or main.py at run time (the
trainer reaches elastic.py as an argument; its Trainer type hint is under TYPE_CHECKING only).
"""
