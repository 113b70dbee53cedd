"""Token windows from flat token shards (issue 49): ringfeed's pipeline alone against LitData's
`StreamingDataset` + `TokensLoader` on the same tokens, tokens/s at two context lengths, and
the bytes each stores them in.

    .venv/bin/python benchmarks/token_bench.py            # 12 MB, seq_len 1024 and 128, 5 pairs
    .venv/bin/python benchmarks/token_bench.py --quick    # 1 MB, seq_len 1024, 1 pair, 1 epoch

The corpus: the .py files of this Python's standard library (sorted, up to --corpus-mb), one
JSONL document each, tokenized once by `ringfeed shard --format text --tokenizer bytes` into flat
token shards of --shard-tokens tokens. LitData's chunks are written by `litdata.optimize`
(`TokensLoader`, one item per document, chunks of the same --shard-tokens) from the tokens read
back out of ringfeed's shards, so both hold the same tokens (peers/token_worker.py). Each read
is its own process (ringfeed in .venv, LitData in the peers' venv): 2 loader workers, batches
of 8 windows of seq_len + 1 tokens, shuffled, 2 epochs, the second timed (both warm: the files
in the page cache, the workers started); tokens/s = windows x seq_len / seconds. The pairs
alternate which tool goes first, so a slow spell of a shared machine falls on both. Reported
per length: the medians, the median per-pair ratio and its range; storage as bytes on disk /
raw token bytes (2 a token). Writes benchmarks/results/tokens[_quick].json and .png. Measures,
never asserts. LitData needs `bash benchmarks/peers/setup.sh`: without it its rows say so.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULTS, Row, bench_env, finish, new_figure  # noqa: E402

from ringfeed.formats.manifest import Manifest  # noqa: E402
from ringfeed.formats.tokens import DOCS_MEMBER, TOKENS_MEMBER  # noqa: E402

NAME = "tokens"
WORKER = HERE / "peers" / "token_worker.py"
PEERS_PYTHON = HERE / ".peers-venv" / "bin" / "python"
PEER = "LitData TokensLoader"


def write_corpus(path: Path, limit: int) -> dict[str, int]:
    """The standard library's .py files (site-packages left out), sorted, as JSONL documents
    until `limit` bytes of text."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    documents = size = 0
    with path.open("w") as f:
        for p in files:
            text = p.read_bytes().decode("utf-8", "replace")
            f.write(json.dumps({"text": text}) + "\n")
            documents, size = documents + 1, size + len(text.encode())
            if size >= limit:
                break
    return {"documents": documents, "bytes": size}


def shard(corpus: Path, out: Path, shard_tokens: int) -> None:
    """`ringfeed shard` in this process (its own timing is not measured here)."""
    from ringfeed.train.cli import main as ringfeed

    code = ringfeed(["shard", str(corpus), str(out), "--format", "text", "--tokenizer",
                     "bytes", "--val-fraction", "0", "--max-count", str(shard_tokens),
                     "--workers", "2", "--no-progress"])
    if code:
        raise RuntimeError(f"ringfeed shard exited {code}")


def flat_tokens(shards: Path) -> tuple[np.ndarray, np.ndarray]:
    """The train split's token stream, shard after shard, and its documents' starts."""
    manifest = Manifest.load(shards)
    streams, starts, offset = [], [], 0
    for info in manifest.split("train").shards:
        with tarfile.open(shards / info.name) as tar:
            members = {Path(m.name).name.split(".", 1)[1]: m for m in tar.getmembers()
                       if m.isfile()}
            tokens = np.load(io.BytesIO(tar.extractfile(members[TOKENS_MEMBER]).read()))
            docs = np.load(io.BytesIO(tar.extractfile(members[DOCS_MEMBER]).read()))
        streams.append(tokens)
        starts.append(docs.astype(np.int64) + offset)
        offset += len(tokens)
    return np.concatenate(streams), np.concatenate(starts)


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def worker(python: Path, args: list[str], timeout: float) -> dict[str, Any]:
    res = subprocess.run([str(python), str(WORKER), *args], capture_output=True, text=True,
                         env=bench_env(), timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"token_worker {args[:3]} exited {res.returncode}: "
                           f"{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def read_rate(tool: str, data: Path, seq_len: int, epochs: int, timeout: float) -> float:
    """tokens/s of the last epoch of one read by `tool` in a process of its own."""
    python = Path(sys.executable) if tool == "ringfeed" else PEERS_PYTHON
    out = worker(python, ["read", "--tool", tool, "--data", str(data), "--seq-len",
                          str(seq_len), "--epochs", str(epochs)], timeout)
    return float(out["epochs"][-1]["tokens_per_s"])


def peers_missing() -> str | None:
    if not PEERS_PYTHON.exists():
        return "pending: peers venv missing (bash benchmarks/peers/setup.sh)"
    probe = subprocess.run([str(PEERS_PYTHON), "-c", "import litdata"], capture_output=True,
                           text=True, timeout=120)
    return None if probe.returncode == 0 else "pending: litdata does not import in the peers venv"


def measure(rf: Path, ld: Path | None, seq_lens: list[int], pairs: int, epochs: int,
            timeout: float) -> dict[int, dict[str, list[float]]]:
    """{seq_len: {"ringfeed": [tokens/s], "litdata": [...]}}, pairs interleaved."""
    rates: dict[int, dict[str, list[float]]] = {n: {"ringfeed": [], "litdata": []}
                                                for n in seq_lens}
    for pair in range(pairs):
        for seq_len in seq_lens:
            order = ["ringfeed", "litdata"] if pair % 2 == 0 else ["litdata", "ringfeed"]
            for tool in order:
                if tool == "ringfeed" or ld is not None:
                    data = rf if tool == "ringfeed" else ld
                    rates[seq_len][tool].append(read_rate(tool, data, seq_len, epochs, timeout))
    return rates


def rows_for(rates: dict[int, dict[str, list[float]]], storage: dict[str, float],
             missing: str | None, pairs: int) -> list[Row]:
    rows = []
    for seq_len, r in rates.items():
        metric = f"tokens/s, seq_len {seq_len}, 2 workers"
        ours = statistics.median(r["ringfeed"])
        if missing:
            rows.append(Row(NAME, metric, ours, "tokens/s", peer=PEER, goal=(">=", 1.0),
                            note=missing))
            continue
        ratios = [a / b for a, b in zip(r["ringfeed"], r["litdata"], strict=True)]
        rows.append(Row(NAME, metric, ours, "tokens/s", peer=PEER,
                        peer_value=statistics.median(r["litdata"]),
                        ratio=statistics.median(ratios), goal=(">=", 1.0),
                        note=f"{pairs} pairs; per-pair ratio {min(ratios):.2f}-"
                             f"{max(ratios):.2f}"))
    rows.append(Row(NAME, "storage / raw token bytes", storage["ringfeed"], "x",
                    peer="LitData chunks", peer_value=storage.get("litdata"),
                    ratio=storage["ringfeed"], goal=("<=", 1.05)))
    return rows


def plot(rates: dict[int, dict[str, list[float]]]) -> Any:
    fig, axes = new_figure(ncols=len(rates), width=4.0, height=3.5)
    for ax, (seq_len, r) in zip(axes, rates.items(), strict=True):
        for tool, marker in (("ringfeed", "o"), ("litdata", "s")):
            if r[tool]:
                ax.plot(range(1, len(r[tool]) + 1), [v / 1e6 for v in r[tool]], marker + "-",
                        label=tool)
        ax.set_title(f"seq_len {seq_len}")
        ax.set_xlabel("pair")
        ax.set_ylabel("M tokens/s")
        ax.legend(fontsize=8)
    return fig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 MB of text, 1 pair")
    ap.add_argument("--corpus-mb", type=float, default=None, help="default 12 (quick: 1)")
    ap.add_argument("--pairs", type=int, default=None, help="default 5 (quick: 1)")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=None,
                    help="default 1024 128 (quick: 1024)")
    ap.add_argument("--epochs", type=int, default=None,
                    help="epochs a read, the last timed (default 2; quick: 1)")
    ap.add_argument("--shard-tokens", type=int, default=None,
                    help="tokens per shard and per LitData chunk (default 1 Mi; quick: 128 Ki)")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--timeout", type=float, default=600, help="per process (s)")
    opts = ap.parse_args(argv)
    mb = opts.corpus_mb or (1.0 if opts.quick else 12.0)
    pairs = opts.pairs or (1 if opts.quick else 5)
    seq_lens = opts.seq_lens or ([1024] if opts.quick else [1024, 128])
    epochs = opts.epochs or (1 if opts.quick else 2)
    shard_tokens = opts.shard_tokens or (1 << 17 if opts.quick else 1 << 20)
    missing = peers_missing()
    with tempfile.TemporaryDirectory(prefix="ringfeed-token-bench-") as tmp:
        work = Path(tmp)
        corpus = write_corpus(work / "corpus.jsonl", int(mb * 1e6))
        rf, ld = work / "ringfeed", work / "litdata"
        shard(work / "corpus.jsonl", rf, shard_tokens)
        stream, starts = flat_tokens(rf)
        raw = stream.nbytes
        storage = {"ringfeed": disk_bytes(rf) / raw}
        if missing is None:
            np.save(work / "stream.npy", stream)
            np.save(work / "starts.npy", starts)
            worker(PEERS_PYTHON, ["prepare", "--stream", str(work / "stream.npy"), "--starts",
                                  str(work / "starts.npy"), "--out", str(ld),
                                  "--chunk-tokens", str(shard_tokens)], opts.timeout)
            storage["litdata"] = disk_bytes(ld) / raw
        rates = measure(rf, None if missing else ld, seq_lens, pairs, epochs, opts.timeout)
    rows = rows_for(rates, storage, missing, pairs)
    data = {"corpus": corpus, "tokens": int(len(stream)), "documents": int(len(starts)),
            "dtype": str(stream.dtype), "shard_tokens": shard_tokens, "pairs": pairs, "epochs": epochs,
            "rates": rates, "storage": storage}
    return finish(NAME, opts.quick, opts.results, rows, data, plot(rates))


if __name__ == "__main__":
    main()
