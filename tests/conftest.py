"""Shared test setup: the environment every test sees, and the three test tiers.

- unit (no marker): one process, no subprocess, no server: `make test-fast` (< 2 min), what a
  developer runs while editing;
- integration (`@pytest.mark.integration`): one process with real files, real servers on
  127.0.0.1 (http.server, moto's S3), pipelines with worker processes, in-process training;
- system (`@pytest.mark.system`): other processes - horovodrun, the CLI,
  network namespaces, faults.

`make test` runs all three. A test without the system marker that starts a subprocess fails
with a line saying to mark it, so the fast tier cannot quietly grow slow.
"""

from __future__ import annotations

import os
import subprocess

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(autouse=True)
def _only_system_tests_start_processes(request: pytest.FixtureRequest,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("system") is not None:
        return
    node = request.node.nodeid

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{node} starts a subprocess: mark it @pytest.mark.system "
                           "(tests/conftest.py: test tiers)")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
