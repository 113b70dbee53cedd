"""What a run carries besides the model: its progress (`TrainState`, the one progress counter),
what it survived (`Recovery`), and the signal requests the loop agrees on across ranks. The
loop (train/loop.py) and the elastic strategy (train/resilience/elastic.py) both use them."""

from __future__ import annotations

import signal
from dataclasses import asdict, dataclass
from typing import Any

from ringfeed.errors import EXIT_PREEMPTED


@dataclass
class TrainState:
    """All progress of a run in one place (what an elastic state object commits)."""

    step: int = 0  # optimizer steps completed
    epoch: int = 0  # the train pipeline's epoch
    last_checkpoint: str | None = None  # its path or URL
    saved_step: int = -1
    last_val_step: int = -1

    def as_plain(self) -> dict[str, Any]:
        """Plain values (the checkpoint path as text): what an elastic commit holds."""
        return asdict(self)

    @classmethod
    def from_plain(cls, plain: dict[str, Any]) -> TrainState:
        """The inverse of as_plain()."""
        return cls(**plain)


@dataclass
class Recovery:
    """What this run survived, reported at the end (summary.json "recovery")."""

    restarts: int = 0  # relaunches by `ringfeed run` before this one
    elastic_resets: int = 0  # world-size changes and failures handled by Horovod Elastic
    rollbacks: int = 0  # resets that went back to the last commit
    steps_redone: int = 0  # optimizer steps lost to those rollbacks
    failed_checkpoints: int = 0  # saves that failed under checkpoint.on_error: warn

    def count_reset(self, lost_steps: int) -> None:
        """An elastic reset; the `lost_steps` trained past the last commit are redone (a
        rollback when there are any)."""
        self.elastic_resets += 1
        self.rollbacks += int(lost_steps > 0)
        self.steps_redone += lost_steps

    def describe(self) -> str:
        text = (f"{self.restarts} restart(s), {self.elastic_resets} elastic reset(s), "
                f"{self.rollbacks} rollback(s) ({self.steps_redone} step(s) redone)")
        if self.failed_checkpoints:
            text += f", {self.failed_checkpoints} checkpoint(s) NOT written"
        return text




class StartupSignals:
    """Until the first step (imports, Horovod, planning, waiting for shards, restoring): SIGTERM
    stops the process at once with exit 143 - nothing new to save, the newest checkpoint is
    where a relaunch resumes - and SIGUSR1 is remembered, so the first step saves. Installed by
    `ringfeed train` before anything slow; SignalRequests takes over at the first step."""

    def __init__(self) -> None:
        self.save_requested = False

    def install(self) -> StartupSignals:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGUSR1, self._on_usr1)
        return self

    def take_save(self) -> bool:
        """Whether a SIGUSR1 came during start-up (consumed by taking it)."""
        requested, self.save_requested = self.save_requested, False
        return requested

    @staticmethod
    def _on_term(signum, frame) -> None:
        print(f"ringfeed train: SIGTERM before the first step: stopping (exit {EXIT_PREEMPTED}; "
              "a relaunch resumes from the newest checkpoint)", flush=True)
        raise SystemExit(EXIT_PREEMPTED)

    def _on_usr1(self, signum, frame) -> None:
        self.save_requested = True


class SignalRequests:
    """SIGTERM (what schedulers send before killing a job): save, then stop. SIGUSR1: save and
    carry on. The handlers only set flags; the loop agrees on them across ranks at the next
    step, so a signal that reaches one rank stops all of them at the same step. A SIGUSR1 that
    came during start-up (`startup`'s) is a save request for the first step."""

    def __init__(self, enabled: bool, startup: StartupSignals | None = None):
        self.save, self.stop = startup is not None and startup.take_save(), False
        self._previous: dict[int, Any] = {}
        if enabled:
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_term)
            self._previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_usr1)

    def _on_term(self, signum, frame) -> None:
        self.stop = True

    def _on_usr1(self, signum, frame) -> None:
        self.save = True

    def take(self) -> tuple[float, float]:
        """(save, stop) for this step; a save request is consumed by taking it."""
        requests = (float(self.save), float(self.stop))
        self.save = False
        return requests

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
