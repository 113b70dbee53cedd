"""What every benchmark here shares: result rows with goals, atomic JSON/PNG output, the
machine description, and bounded subprocess launches (horovodrun, torchrun).

Benchmarks measure and print; they never assert timings. A row compares ringfeed with a peer
measured in the same run (absolute times drift on a shared machine, ratios hold).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
WORKERS = REPO / "benchmarks" / "workers"
if str(REPO) not in sys.path:
    # appended: the installed package (or gpu-check's linked one) wins; the repository's own
    # ringfeed/ folder alone lacks ringfeed.train, .pipeline and .shards (pyproject package-dir)
    sys.path.append(str(REPO))

from ringfeed.fsutil import atomic_open, atomic_write_text  # noqa: E402


def _load_test_helpers():
    """tests/helpers.py: `run` (own process group, killed on timeout), `horovodrun`, `test_env`.
    Loaded by path: tests/ is not a package."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ringfeed_test_helpers",
                                                  REPO / "tests" / "helpers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_helpers = _load_test_helpers()
Result = _helpers.Result
run = _helpers.run
horovodrun = _helpers.horovodrun
bench_env = _helpers.test_env  # OMP_NUM_THREADS=1, PYTHONPATH=repo, the venv's bin on PATH


@dataclass
class Row:
    """One line of the closing table: `value` (ours) against `peer_value`, their ratio, and
    the goal for the ratio as (">=" | "<=", bound), or None where the issue sets none."""

    bench: str
    metric: str
    value: float | None
    unit: str = ""
    peer: str = ""
    peer_value: float | None = None
    ratio: float | None = None
    goal: tuple[str, float] | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if self.ratio is None and self.value is not None and self.peer_value:
            self.ratio = self.value / self.peer_value

    @property
    def met(self) -> bool | None:
        if self.goal is None or self.ratio is None:
            return None
        op, bound = self.goal
        return self.ratio >= bound if op == ">=" else self.ratio <= bound

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "met": self.met}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Row:
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if fields.get("goal") is not None:
            fields["goal"] = tuple(fields["goal"])
        return cls(**fields)


def pending_row(bench: str, metric: str, why: str, goal: tuple[str, float] | None = None) -> Row:
    """A measurement that could not be taken in this run, kept in the table with the reason."""
    return Row(bench, metric, None, goal=goal, note=why)


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def result_stem(name: str, quick: bool) -> str:
    return f"{name}_quick" if quick else name


def save_json(results_dir: Path, stem: str, data: dict[str, Any]) -> Path:
    path = Path(results_dir) / f"{stem}.json"
    atomic_write_text(path, json.dumps(data, indent=2, default=_jsonable) + "\n")
    return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, Row):
        return value.to_dict()
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 3.8):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def save_figure(fig, results_dir: Path, stem: str) -> Path:
    import matplotlib.pyplot as plt

    path = Path(results_dir) / f"{stem}.png"
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return path


def finish(name: str, quick: bool, results_dir: Path, rows: list[Row], data: dict[str, Any],
           fig=None) -> dict[str, Any]:
    """Print this benchmark's rows, write <name>[_quick].json (+ .png) and return the result
    dict every `main(argv)` returns: rows, ratios {metric: ratio}, data, machine, paths."""
    stem = result_stem(name, quick)
    results_dir = Path(results_dir)
    result: dict[str, Any] = {
        "name": name, "quick": quick, "machine": machine(),
        "rows": [r.to_dict() for r in rows],
        "ratios": {r.metric: r.ratio for r in rows if r.ratio is not None},
        "data": data,
    }
    if fig is not None:
        result["png"] = str(save_figure(fig, results_dir, stem))
    result["json"] = str(results_dir / f"{stem}.json")
    save_json(results_dir, stem, result)
    print(format_table(rows))
    return result


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


TABLE_HEADER = ("benchmark", "metric", "value", "peer", "ratio", "goal", "met?")


def table_cells(r: Row, no: str = "NO") -> tuple[str, ...]:
    """One row as the closing table shows it (`no`: how a missed goal is written)."""
    value = "-" if r.value is None else f"{_num(r.value)} {r.unit}".strip()
    peer = r.peer + (f" = {_num(r.peer_value)}" if r.peer_value is not None else "")
    goal = f"{r.goal[0]} {r.goal[1]:g}" if r.goal else "-"
    met = {True: "yes", False: no, None: "-"}[r.met]
    if r.value is None and r.ratio is None and r.note:
        met = r.note  # why it was not measured
    ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x"
    return (r.bench, r.metric, value, peer or "-", ratio, goal, met)


def format_table(rows: list[Row]) -> str:
    lines = [TABLE_HEADER, *(table_cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(TABLE_HEADER))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
                     for line in lines)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, script: Path, args: list[str], timeout: float) -> Result:
    """`torchrun --nproc_per_node N` with a static rendezvous on 127.0.0.1, bounded."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
           "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), *args]
    return run(cmd, timeout=timeout, env=bench_env(GLOO_SOCKET_IFNAME="lo"))


def hvd_launch(nproc: int, script: Path, args: list[str], timeout: float,
               **env: str) -> Result:
    """`horovodrun -np N -H localhost:N --gloo python script args`, bounded."""
    return horovodrun(nproc, [sys.executable, str(script), *args], timeout=timeout,
                      env=bench_env(**env))


def check(result: Result, what: str) -> None:
    """Raise with the tail of the output when a launched job failed or timed out."""
    if result.returncode != 0 or result.timed_out:
        tail = "\n".join(result.output.strip().splitlines()[-15:])
        state = "timed out" if result.timed_out else f"exited {result.returncode}"
        raise RuntimeError(f"{what} {state}:\n{tail}")


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
