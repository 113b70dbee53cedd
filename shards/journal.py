"""The record of an unfinished `ringfeed shard` run, for resuming it after a crash or kill -9.

`OUT/.ringfeed-journal.jsonl`: a first line naming the plan (its fingerprint), then one line per
shard renamed to its final name: name, samples, bytes, sha256. Lines are appended and flushed
as shards finish; a torn last line (power loss) is ignored. A resumed run keeps a listed shard
only if the file still hashes to the listed sha256. The journal is removed once the manifest is
written.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ringfeed.formats.manifest import ShardInfo
from ringfeed.fsutil import atomic_write_text

JOURNAL = ".ringfeed-journal.jsonl"


class Journal:
    def __init__(self, out_dir: Path, name: str = JOURNAL):
        self.path = out_dir / name  # a part of a run (parts.py) has its own

    def exists(self) -> bool:
        return self.path.exists()

    def read(self) -> tuple[str | None, dict[str, ShardInfo]]:
        """(plan fingerprint, {shard name: info}) of the run recorded here."""
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return None, {}
        plan, done = None, {}
        for number, line in enumerate(lines):
            try:
                entry = json.loads(line)
                if number == 0:
                    plan = entry["plan"]
                else:
                    done[entry["name"]] = ShardInfo(**entry)
            except (ValueError, KeyError, TypeError):
                continue  # a line torn by a crash: that shard is simply written again
        return plan, done

    def start(self, plan: str, done: dict[str, ShardInfo]) -> None:
        """Begin (or restart) the record for `plan` with the shards already kept."""
        lines = [json.dumps({"plan": plan})] + [json.dumps(asdict(i)) for i in done.values()]
        atomic_write_text(self.path, "\n".join(lines) + "\n")

    def record(self, info: ShardInfo) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(asdict(info)) + "\n")

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
