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


# -- where the suite's time goes (one full run, every process logged, 2026-11-26) ------------
# Process launches: a torch rank spends ~7.3 CPU-s importing before it trains (torch 3 s, and
# torch._dynamo 3 s, which any torch.optim optimizer's constructor imports: add_param_group is
# @torch._disable_dynamo, whatever foreach/fused/capturable say, torch 2.13), a TensorFlow rank
# ~7.8 s, horovodrun ~1.3 s; the toy runs' training is 1-2 s a rank. `ringfeed train` ranks
# were 57% of the suite's CPU (since 2026-11-28 ~1-1.5 CPU-s less a rank: no collector passes
# over the start-up's heap, none over the heap at exit). A new test's 2-rank launch costs
# ~12 CPU-s before any training: reuse a module's reference run, and use as few ranks as what
# is tested needs.

# -- two workers (`make test` runs `pytest -n 2 --no-loadscope-reorder`) -----------------------
# Each file runs on one worker, so its module fixtures (shards, reference runs) are built once.
# The files that make network namespaces or a Slurm cluster share one group: they run one after
# the other, never beside each other. Groups start slowest first (seconds measured serially on
# the 2-core box, 2026-11-25), so the last to finish is a short one; the netns group mostly
# waits on Slurm's 30 s time-limit checks, which the other worker fills with CPU work.
NETNS_GROUP = {"test_slurm.py": "netns", "test_multinode.py": "netns", "test_bench.py": "netns"}
SLOWEST_FIRST = ["netns", "test_promises.py", "test_tune.py", "test_storage_faults.py",
                 "test_tabular_train.py", "test_fault.py", "test_local_sgd.py",
                 "test_fault_elastic.py", "test_throughput.py", "test_train.py",
                 "test_train_equivalence.py", "test_launcher_faults.py", "test_dead_host.py",
                 "test_trackers.py", "test_hang.py",
                 "test_global_order_train.py", "test_byo_model.py", "test_fuzz.py",
                 "test_checkpoint_remote.py", "test_shards_s3.py", "test_train_images.py",
                 "test_augment.py"]


def file_group(nodeid: str) -> str:
    file = nodeid.split("::")[0].rsplit("/", 1)[-1]
    return NETNS_GROUP.get(file, file)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's scheduler of whole scopes, with our groups as the scopes (its own `loadgroup`
    does not group under pytest 9.2, which ignores the node ids it rewrites)."""
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return file_group(nodeid)

    return FileGroups(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(file_group(item.nodeid), len(rank)))  # stable sort


# -- S3 on 127.0.0.1: moto's server, and a fault/shaping proxy in front of it (s3_proxy.py) ---
# Modules may define their own `s3_server` (test_pipeline_cache.py does); theirs wins there.
@pytest.fixture
def s3_server(monkeypatch: pytest.MonkeyPatch):
    """moto's S3 server in this process's threads, fake AWS credentials set: its URL."""
    pytest.importorskip("moto.server")
    from s3_proxy import moto_server_fixture

    yield from moto_server_fixture(monkeypatch)


@pytest.fixture
def s3_proxy(s3_server: str):
    """A started `s3_proxy.FaultProxy` in front of `s3_server` (mode "pass", no shaping)."""
    from s3_proxy import fault_proxy_fixture

    yield from fault_proxy_fixture(s3_server)
