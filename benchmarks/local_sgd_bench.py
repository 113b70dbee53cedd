"""Local SGD on a slow link: step time and loss of the demo (digits cnn, Adam, 2 ranks) with
`train.sync_every` H = 1, 4, 8, each rank on its own network-namespace "host", the two joined
by one veth pair whose ends are rate-limited with `tc qdisc ... tbf`.

    .venv/bin/python benchmarks/local_sgd_bench.py            # H = 1, 4, 8 (+ H=8 without
                                                              # optimizer state), 240 steps
    .venv/bin/python benchmarks/local_sgd_bench.py --quick    # H = 1, 4, 16 steps

Every run trains the same number of steps on the same samples (global batch 64), so the
losses compare at a fixed number of samples. Step time: rank 0's metrics.jsonl time stamps
after the first logging window. Allreduce bytes per sample: the trainer's summary.json
("communication": the backend's comm_stats()), else computed from the model's parameter count,
the optimizer's moments and H. The link: both veth ends shaped to --rate
(tbf, full duplex); horovodrun runs in host A and starts the rank on host B through an `ssh`
stand-in that runs the command in B's namespace (no sshd needed). Needs root and `ip`/`tc`;
elsewhere the rows say "pending". Writes benchmarks/results/local_sgd[_quick].json and .png.
Measures, never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netns_hosts  # noqa: E402
from common import (  # noqa: E402
    REPO,
    RESULTS,
    Row,
    bench_env,
    check,
    finish,
    new_figure,
    pending_row,
    run,
)
from demo_run import CONFIG, demo_missing, demo_shards  # noqa: E402
from trainrun import TrainRun  # noqa: E402

NAME = "local_sgd"
ADDRESSES = ("192.168.78.1", "192.168.78.2")  # (test_multinode uses .77: both may run at once)
NS_PREFIX = "rflsgd"
BIN = Path(sys.executable).parent
GLOBAL_BATCH = 64  # the demo's 2 ranks x 32
MOMENTS = {"adam": 2, "adamw": 2, "sgd": 1}  # per-parameter optimizer tensors a sync averages


# -- two hosts on one throttled link -------------------------------------------------------------
def shape(namespaces: tuple[str, str], rate: str | None) -> None:
    """Rate-limit both ends of the link (tbf: one token bucket per direction), or lift it."""
    for ns in namespaces:
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root"],
                       capture_output=True)
        if rate:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0",
                            "root", "tbf", "rate", rate, "burst", "64kb", "latency", "100ms"],
                           check=True, capture_output=True, text=True, timeout=30)


@contextmanager
def two_hosts(tmp: Path) -> Iterator[tuple[tuple[str, str], dict[str, str]]]:
    """Hosts A and B (eth0 = 192.168.78.1 / .2, one veth link) and the environment for a
    horovodrun in A: PATH leads to an `ssh` that runs its command in the host's namespace."""
    with netns_hosts.two_hosts(NS_PREFIX, ADDRESSES) as pair:
        bindir = tmp / "bin"
        bindir.mkdir()
        hosts = dict(zip(ADDRESSES, pair, strict=True))
        # horovodrun runs `ssh [-o X]... HOST [-p P] [-i F] [-o X] COMMAND`; ssh would hand
        # COMMAND to the remote shell, this hands it to bash inside HOST's namespace.
        (bindir / "ssh").write_text(f"""#!{sys.executable}
import os, sys
hosts = {hosts!r}
args, host, i = sys.argv[1:], None, 0
while i < len(args) and (host is None or args[i] in ("-o", "-p", "-i")):
    if args[i] in ("-o", "-p", "-i"):
        i += 2
    else:
        host, i = args[i], i + 1
os.execvp("ip", ["ip", "netns", "exec", hosts[host], "bash", "-c", " ".join(args[i:])])
""")
        (bindir / "ssh").chmod(0o755)
        yield pair, bench_env(PATH=f"{bindir}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}")


def train_across(namespaces: tuple[str, str], env: dict[str, str], out: Path,
                 overrides: list[str], timeout: float) -> TrainRun:
    """The demo config on rank 0 in host A and rank 1 in host B."""
    cmd = ["ip", "netns", "exec", namespaces[0], str(BIN / "horovodrun"), "-np", "2",
           "-H", f"{ADDRESSES[0]}:1,{ADDRESSES[1]}:1", "--gloo", "--network-interface", "eth0",
           "--disable-cache", "--start-timeout", "60", str(BIN / "ringfeed"), "train",
           str(CONFIG), *[a for o in [f"output.dir={out}", *overrides] for a in ("--set", o)]]
    start = time.perf_counter()
    result = run(cmd, timeout=timeout, env=env, cwd=REPO)
    wall = time.perf_counter() - start
    check(result, f"ringfeed train across the namespaces ({' '.join(overrides)})")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    return TrainRun(wall, json.loads((out / "summary.json").read_text()), metrics)


# -- the measurement ----------------------------------------------------------------------------
def demo_parameters() -> tuple[int, str]:
    """The demo model's parameter count and optimizer (for bytes per sample)."""
    import yaml

    from ringfeed.train.data import CLASSIFY, DataSpec
    from ringfeed.train.models import build_model

    config = yaml.safe_load(CONFIG.read_text())
    side = config["data"]["image_size"]
    model = build_model("torch", config["model"]["name"], config["model"]["args"],
                        DataSpec(CLASSIFY, "png", "cls", (*side, 1), num_classes=10))
    return sum(p.numel() for p in model.parameters()), config["optim"]["name"]


def bytes_per_sample(params: int, optimizer: str, h: int, with_state: bool) -> float:
    """What one rank hands to allreduces per sample it trains: fp32 gradients every step
    (H=1), or parameters (+ moments) every H steps."""
    tensors = 1 if h == 1 or not with_state else 1 + MOMENTS[optimizer]
    return params * 4 * tensors / (h * GLOBAL_BATCH / 2)


def label(h: int, with_state: bool) -> str:
    return f"H={h}" + ("" if with_state or h == 1 else " params only")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="H = 1, 4 for a few steps")
    ap.add_argument("--rate", default="50mbit", help="tc rate of each link direction")
    ap.add_argument("--steps", type=int, default=None, help="default: 240 (quick: 16)")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--timeout", type=float, default=None, help="per training run (s)")
    opts = ap.parse_args(argv)
    steps = opts.steps or (16 if opts.quick else 240)  # a multiple of 8: every run ends synced
    timeout = opts.timeout or (240 if opts.quick else 600)
    setups = [(1, True), (4, True)] if opts.quick else [(1, True), (4, True), (8, True),
                                                        (8, False)]
    why = netns_hosts.missing_prerequisite(NS_PREFIX, ("ip", "tc")) or demo_missing()
    if why:
        rows = [pending_row(NAME, f"step time, {label(h, s)} vs H=1", f"pending: {why}")
                for h, s in setups[1:]]
        return finish(NAME, opts.quick, opts.results, rows, {})

    params, optimizer = demo_parameters()
    common = [f"data.train={demo_shards()}", "framework=torch", f"train.max_steps={steps}",
              "train.log_every=4" if opts.quick else "train.log_every=10",
              "checkpoint.every_steps=null", "output.tensorboard=false"]
    if opts.quick:
        common.append("data.val_split=null")
    runs: dict[str, TrainRun] = {}
    with tempfile.TemporaryDirectory(prefix="ringfeed-local-sgd-") as tmp, \
            two_hosts(Path(tmp)) as (namespaces, env):
        shape(namespaces, opts.rate)
        for h, with_state in setups:
            runs[label(h, with_state)] = train_across(
                namespaces, env, Path(tmp) / f"h{h}{with_state}",
                [*common, f"train.sync_every={h}",
                 f"train.sync_optimizer_state={str(with_state).lower()}"], timeout)
        if not opts.quick:  # the same job on the link unshaped: what the link costs
            shape(namespaces, None)
            runs["H=1 unthrottled"] = train_across(namespaces, env, Path(tmp) / "free",
                                                   [*common, "train.sync_every=1"], timeout)

    warm = 4 if opts.quick else 20  # the first logging windows include tracing and warm-up
    step_ms = {name: 1e3 * r.step_s(after_step=warm) for name, r in runs.items()}
    base = runs["H=1"]
    rows = []
    for h, with_state in setups[1:]:
        name = label(h, with_state)
        r = runs[name]
        rows.append(Row(NAME, f"step time, {name} vs H=1 ({opts.rate} link)", step_ms[name],
                        "ms", "H=1", step_ms["H=1"]))
        rows.append(Row(NAME, f"train loss after {steps * GLOBAL_BATCH} samples, {name} vs "
                        "H=1", r.summary["final_loss"], "", "H=1", base.summary["final_loss"]))
        if r.summary.get("val"):
            for metric in ("loss", "accuracy"):
                rows.append(Row(NAME, f"val {metric} after {steps * GLOBAL_BATCH} samples, "
                                f"{name} vs H=1", r.summary["val"][metric], "", "H=1",
                                base.summary["val"][metric]))
        comm = r.summary.get("communication") or {}
        rows.append(Row(NAME, f"allreduce bytes/sample, {name} vs H=1",
                        comm.get("allreduce_bytes_per_sample",
                                 bytes_per_sample(params, optimizer, h, with_state)), "B",
                        "H=1", bytes_per_sample(params, optimizer, 1, True),
                        note="summary.json" if comm else "computed"))
    if "H=1 unthrottled" in runs:
        rows.append(Row(NAME, f"step time, H=1 on the {opts.rate} link vs unthrottled",
                        step_ms["H=1"], "ms", "unthrottled", step_ms["H=1 unthrottled"]))

    fig, axes = new_figure(ncols=2, width=5.5, height=3.6)
    for name, r in runs.items():
        train = [m for m in r.metrics if "loss" in m and "data_wait" in m]
        axes[0].plot([m["step"] * GLOBAL_BATCH for m in train], [m["loss"] for m in train],
                     label=name)
    axes[0].set_xlabel("samples")
    axes[0].set_ylabel("train loss (window mean)")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    names = list(step_ms)
    axes[1].bar(range(len(names)), [step_ms[n] for n in names])
    axes[1].set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    axes[1].set_ylabel("ms per step")
    axes[1].set_title(f"demo, 2 hosts, {opts.rate} link")
    data = {"rate": opts.rate, "steps": steps, "global_batch": GLOBAL_BATCH,
            "parameters": params, "optimizer": optimizer, "step_ms": step_ms,
            "summaries": {n: r.summary for n, r in runs.items()},
            "wall_s": {n: r.wall_s for n, r in runs.items()}}
    return finish(NAME, opts.quick, opts.results, rows, data, fig)


if __name__ == "__main__":
    main()
