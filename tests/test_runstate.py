"""train/runstate.py's signal handling before and after the first step: the start-up handlers
are an object the entry point installs and hands to the run (no class-level flag)."""

from __future__ import annotations

import os
import signal

from ringfeed.train.runstate import SignalRequests, StartupSignals


def test_a_sigusr1_during_start_up_is_a_save_request_for_the_first_step_only():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        startup = StartupSignals().install()
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs before kill() returns here
        signals = SignalRequests(False, startup)
        assert signals.take() == (1.0, 0.0)
        assert signals.take() == (0.0, 0.0)  # taken once
        assert SignalRequests(False, startup).take() == (0.0, 0.0)  # and handed over once
        assert SignalRequests(False, StartupSignals()).take() == (0.0, 0.0)  # another run's
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
