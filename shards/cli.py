"""`ringfeed shard | verify | inspect`: argument parsing and the lines a user reads."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from ringfeed.errors import EXIT_STORAGE_UNAVAILABLE, UserError
from ringfeed.remote import RetryPolicy
from ringfeed.shards.options import DEFAULT_MAX_SIZE, FORMATS, TABLE_FORMATS, ShardOptions


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "shard", help="turn a raw dataset into WebDataset tar shards + manifest.json",
        description="Write SRC as WebDataset shards OUT/{split}-{000000..}.tar and "
                    "OUT/manifest.json. Rerunning an interrupted command resumes it.")
    p.add_argument("src", metavar="SRC", nargs="?",
                   help="the raw dataset (file or folder, or its URL: s3://...)")
    p.add_argument("out", metavar="OUT", nargs="?",
                   help="output folder or URL (new or empty; wds-index: defaults to SRC)")
    p.add_argument("--format", metavar="FORMAT",
                   help=f"input format: {', '.join(FORMATS)}")
    _table_options(p)
    p.add_argument("--max-size", metavar="SIZE",
                   help=f"max bytes per shard, e.g. 256MB (default {DEFAULT_MAX_SIZE // 10**6}MB "
                        "when --max-count is not given either)")
    p.add_argument("--max-count", type=int, metavar="N", help="max samples per shard")
    p.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                   help="draw this fraction of samples into a `val` split (stratified by "
                        "class when samples have a cls; text: whole documents)")
    p.add_argument("--shuffle-seed", type=int, metavar="S",
                   help="shuffle samples across shards with this seed (default: source order)")
    p.add_argument("--workers", type=int, default=1, metavar="K",
                   help="write shards in K processes (same bytes for any K)")
    p.add_argument("--strict", action="store_true",
                   help="imagefolder: fail on a non-image or unreadable file instead of skipping it")
    p.add_argument("--overwrite", action="store_true", help="replace shards already in OUT")
    _text_options(p)
    p.add_argument("--split", metavar="NAME",
                   help="wds-index: put every shard in this split (default: from the file "
                        "name, e.g. val-0001.tar, else train); imagefolder: add SRC to OUT's "
                        "shards as this split, with OUT's class ids")
    _part_options(p)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")
    _storage_option(p)
    p.add_argument("--staging", metavar="DIR",
                   help="OUT or SRC a URL: the local folder shards are written to before their "
                        "upload and a remote SRC is fetched into (default: "
                        "~/.cache/ringfeed/shard/<hash of SRC and OUT>, the same for a rerun)")
    p.set_defaults(func=run_shard)

    v = subparsers.add_parser("verify", help="re-hash and re-count shards against manifest.json "
                                             "and check their index sidecars")
    v.add_argument("out", metavar="OUT", help="the folder or URL holding manifest.json")
    v.add_argument("--workers", type=int, default=1, metavar="K")
    _storage_option(v)
    v.set_defaults(func=run_verify)

    i = subparsers.add_parser("inspect", help="summarize a sharded dataset")
    i.add_argument("out", metavar="OUT", help="the folder or URL holding manifest.json")
    i.add_argument("--samples", type=int, default=3, metavar="N", help="samples to show per split")
    i.add_argument("--workers", type=int, default=1, metavar="K")
    _storage_option(i)
    i.set_defaults(func=run_inspect)


def _part_options(p: argparse.ArgumentParser) -> None:
    """One set of shards written by N processes on any machines (shards/parts.py)."""
    p.add_argument("--part", metavar="I/N",
                   help="write part I (0..N-1) of N of the shards, N processes on any machines "
                        "(default: the rank/size of mpirun, horovodrun, srun or a Slurm array; "
                        "--part 0/1: all of it in this process, whatever the launcher); the "
                        "last part to finish writes the manifest")
    p.add_argument("--merge", metavar="OUT",
                   help="write OUT's manifest from its finished parts (naming any part that did "
                        "not finish); no SRC")
    p.add_argument("--scan", action="store_true",
                   help="csv/jsonl/parquet/text: only scan SRC, leaving the scan in OUT for the parts "
                        "started next (with the same options) to read instead of each scanning")


def _table_options(p: argparse.ArgumentParser) -> None:
    """jsonl/csv/parquet/npz: which columns become which members."""
    p.add_argument("--field", action="append", default=[], metavar="NAME=EXT",
                   help="jsonl/csv/parquet/npz: store field NAME as tar member EXT (e.g. "
                        "text=txt, label=cls, price=y.npy, path=jpg for an image file path or "
                        "a parquet image column); numeric columns no --field names go to x.npy, "
                        "the rest to `json`")
    p.add_argument("--features", action="append", default=[], metavar="COLS=EXT",
                   help="jsonl/csv/parquet: store columns COLS as one float32 vector member EXT "
                        "(e.g. 'a,b,c=x.npy', 'pixel_*=x.npy', numeric=x.npy for every numeric "
                        "column not named elsewhere); replaces the default x.npy")
    p.add_argument("--categorical", action="append", default=[], metavar="COL",
                   help="jsonl/csv/parquet: map the values of column COL to ids 0..V-1 "
                        "(vocabulary in the manifest): the id as a --field, one-hot in features")
    p.add_argument("--fill", type=float, metavar="VALUE",
                   help="jsonl/csv/parquet: put VALUE into missing numeric cells (default: a "
                        "missing cell is an error naming its row and column)")
    p.add_argument("--key", dest="key_field", metavar="FIELD",
                   help="jsonl/csv/parquet: take sample keys from FIELD (default: row numbers)")


def _text_options(p: argparse.ArgumentParser) -> None:
    """text: tokenising documents into flat token shards, or rows of --seq-len tokens."""
    p.add_argument("--seq-len", type=int, metavar="N",
                   help="text: write the row layout, N tokens per sample, the context fixed "
                        "here (default: flat token shards, the context chosen in training by "
                        "data.seq_len; --max-count then caps tokens per shard)")
    p.add_argument("--tokenizer", default="bytes", metavar="SPEC",
                   help="text: 'bytes' (ids 0..255, EOS 256; the default), a Hugging Face "
                        "tokenizer.json (or its folder), or module:attr of an installed tokenizer "
                        "(a factory with arguments: 'tiktoken:get_encoding(gpt2)'); append "
                        "'#eos=TOKEN' to name the end-of-document token")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="text: the document field of .jsonl files or column of .parquet files "
                        "(default text)")
    p.add_argument("--glob", default="*", metavar="PATTERN",
                   help="text: file name pattern inside a SRC folder, searched recursively "
                        "(default: every file; e.g. '*.txt')")


def _storage_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an fsspec option for a URL's storage (repeatable), e.g. "
                             "endpoint_url=http://127.0.0.1:9000, key=..., secret=..., anon=true "
                             "(a JSON VALUE is taken as such); the pipeline's storage_options")
    parser.add_argument("--retry-budget", type=float, metavar="SECONDS",
                        help="how long one call to storage may keep failing (connection "
                             "errors, 5xx, throttling) before the command stops with exit "
                             f"{EXIT_STORAGE_UNAVAILABLE} (default {RetryPolicy.budget_s:g})")


def options_from_args(args: argparse.Namespace) -> ShardOptions:
    """Validate the command line; every problem is one UserError line."""
    from ringfeed.fsutil import parse_size
    from ringfeed.shards.remote import default_staging, is_url

    part = _check_command(args)
    fields = dict(_name_ext(spec, "--field", "label=cls") for spec in args.field)
    features = [_name_ext(spec, "--features", "'a,b,c=x.npy'", last=True)
                for spec in args.features] or None
    if args.fill is not None and not math.isfinite(args.fill):
        raise UserError(f"--fill {args.fill}: must be a finite number")
    max_size = None
    if args.max_size is not None:
        try:
            max_size = parse_size(args.max_size)
        except ValueError as e:
            raise UserError(f"--max-size: {e}") from None
    for flag, value, low in (("--max-count", args.max_count, 1), ("--workers", args.workers, 1),
                             ("--max-size", max_size, 1)):
        if value is not None and value < low:
            raise UserError(f"{flag} {value}: must be at least {low}")
    if not 0 <= args.val_fraction < 1:
        raise UserError(f"--val-fraction {args.val_fraction}: must be in [0, 1)")
    storage_options, policy = _storage(args)
    out_arg = args.out if args.out else args.src
    src_url = args.src if is_url(args.src) else None
    out_url = out_arg.rstrip("/") if is_url(out_arg) else None
    src = Path(args.src).expanduser().resolve() if src_url is None else Path(args.src)
    out = Path(out_arg) if out_url is None else Path()
    staging = Path(args.staging).expanduser().resolve() if args.staging else None
    if (src_url and out_url and args.format != "wds-index"
            and f"{out_url}/".startswith(f"{src_url.rstrip('/')}/")):
        raise UserError(f"{out_url} is inside SRC {src_url}: the shards would be read as input; "
                        "choose an OUT outside SRC")
    if (src_url or out_url) and args.format != "wds-index":
        staging = staging or default_staging(out_url or str(out.resolve()), args.src)
        if part is not None:  # parts on one machine must not share a staging folder
            staging = staging / f"part-{part[0]}-of-{part[1]}"
        # the shards are written here before their upload; a remote SRC is fetched here
        out = staging if out_url else out
        src = staging / "src" if src_url else src
    return ShardOptions(
        src=src, out=out, format=args.format, fields=fields,
        key_field=args.key_field, features=features, categorical=list(args.categorical),
        fill=args.fill, max_size=max_size, max_count=args.max_count,
        val_fraction=args.val_fraction, shuffle_seed=args.shuffle_seed, workers=args.workers,
        strict=args.strict, overwrite=args.overwrite, seq_len=args.seq_len,
        tokenizer=args.tokenizer, text_field=args.text_field, glob=args.glob, split=args.split,
        progress=args.progress, out_url=out_url, src_url=src_url, part=part,
        scan_only=args.scan,
        storage_options=storage_options, staging=staging, policy=policy)


def _check_command(args: argparse.Namespace) -> tuple[int, int] | None:
    """What the command names and which flags apply to its format; the part it writes (None:
    all of it)."""
    from ringfeed.shards.parts import part_from
    from ringfeed.shards.remote import is_url

    if args.src is None:
        raise UserError("SRC is missing: ringfeed shard SRC OUT --format ... (or --merge OUT)")
    if args.format is None:
        raise UserError("--format is missing: ringfeed shard SRC OUT --format FORMAT "
                        f"({', '.join(FORMATS)})")
    if args.format not in FORMATS:
        raise UserError(f"unknown --format {args.format!r} (choose from: {', '.join(FORMATS)})")
    part, where = part_from(args.part, os.environ)
    if part is not None and (args.format == "wds-index" or args.split is not None):
        raise UserError(f"{where} ({part[0]}/{part[1]}): --format wds-index and --split run "
                        "in one process, not in parts; run the command once")
    if args.out is None and args.format != "wds-index":
        raise UserError("OUT is missing: ringfeed shard SRC OUT --format ...")
    if args.scan and (args.format not in (*TABLE_FORMATS, "text") or part is not None
                      or is_url(args.src)):
        raise UserError("--scan: for a local csv, jsonl, parquet or text SRC, in one process before "
                        "the parts (not with --part or under a launcher); drop --scan")
    for flag, value, formats in (("--field", args.field, (*TABLE_FORMATS, "npz", "npy")),
                                 ("--features", args.features, TABLE_FORMATS),
                                 ("--categorical", args.categorical, TABLE_FORMATS),
                                 ("--fill", args.fill, TABLE_FORMATS),
                                 ("--key", args.key_field, TABLE_FORMATS),
                                 ("--split", args.split, ("wds-index", "imagefolder"))):
        if value is not None and value != [] and args.format not in formats:
            raise UserError(f"{flag} does not apply to --format {args.format} "
                            f"(only to {', '.join(formats)})")
    if args.split is not None and args.format == "imagefolder" and (
            args.val_fraction or is_url(args.src) or is_url(args.out)):
        raise UserError(f"--split {args.split} adds SRC as one split of a local OUT: drop "
                        "--val-fraction; SRC and OUT must be local folders")
    return part


def _name_ext(spec: str, flag: str, example: str, last: bool = False) -> tuple[str, str]:
    """NAME=EXT split at the first '=' (at the last with `last`: column lists may hold '=')."""
    name, sep, ext = spec.rpartition("=") if last else spec.partition("=")
    if not sep or not name or not ext:
        form = "COLS=EXT" if last else "NAME=EXT"
        raise UserError(f"{flag} {spec!r}: expected {form}, e.g. {flag} {example}")
    return name, ext


def run_shard(args: argparse.Namespace) -> int:
    from ringfeed.shards.sources.parquet import PYARROW_ENV

    for name, value in PYARROW_ENV:  # before anything loads pyarrow (the parquet reader)
        os.environ.setdefault(name, value)
    from ringfeed.shards.progress import human_bytes, rate

    if args.merge is not None:
        return _run_merge(args)
    opts = options_from_args(args)
    if opts.scan_only:
        from ringfeed.shards.remote_build import scan_for_parts

        print(f"ringfeed shard: scan shared in {scan_for_parts(opts)}; now run the parts (--part "
              "I/N) with the same SRC, OUT and options", flush=True)
        return 0
    if opts.part is not None:
        from ringfeed.shards.parts import part_from

        print(f"ringfeed shard: part {opts.part[0]}/{opts.part[1]} (from "
              f"{part_from(args.part, os.environ)[1]})", flush=True)
    if opts.format == "wds-index":
        from ringfeed.shards.wds_index import index_shards

        run = index_shards(opts)
    elif opts.split is not None:
        from ringfeed.shards.addsplit import add_split

        run = add_split(opts)
    elif opts.src_url or opts.out_url:
        from ringfeed.shards.remote_build import shard_remote

        run = shard_remote(opts)
    else:
        from ringfeed.shards.build import shard_dataset

        run = shard_dataset(opts)
    m = run.manifest
    if m is None:
        assert run.part is not None
        print(f"ringfeed shard: part {run.part[0]}/{run.part[1]} done: {len(run.written)} "
              f"shard(s) written, {len(run.kept)} kept, {run.seconds:.1f} s; the last part to "
              f"finish writes {opts.out_url or run.out}/manifest.json (or: ringfeed shard "
              f"--merge {opts.out_url or run.out})")
        return 0
    per_split = ", ".join(f"{name} {len(s.shards)}" for name, s in m.splits.items())
    samples = sum(s.num_samples for s in m.splits.values())
    nbytes = sum(s.num_bytes for s in m.splits.values())
    notes = ""
    if run.kept:
        notes += f"; resumed: kept {len(run.kept)} finished shard(s)"
    if m.skipped:
        notes += f"; skipped {len(m.skipped)} input file(s), listed in the manifest"
    print(f"ringfeed shard: {samples:,} samples, {sum(len(s.shards) for s in m.splits.values())} "
          f"shards ({per_split}), {human_bytes(nbytes)}, {run.seconds:.1f} s, "
          f"{rate(nbytes, run.seconds)} -> {opts.out_url or run.out}/manifest.json{notes}")
    return 0


def _run_merge(args: argparse.Namespace) -> int:
    """`ringfeed shard --merge OUT`: the manifest from the parts' markers."""
    from ringfeed.shards.remote_build import merge_parts

    if args.src is not None or args.out is not None:
        raise UserError(f"--merge {args.merge} takes no SRC or OUT: ringfeed shard --merge OUT")
    manifest = merge_parts(args.merge, *_storage(args))
    shards = sum(len(s.shards) for s in manifest.splits.values())
    samples = sum(s.num_samples for s in manifest.splits.values())
    print(f"ringfeed shard --merge: {samples:,} samples, {shards} shards -> "
          f"{args.merge.rstrip('/')}/manifest.json")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from ringfeed.shards.progress import human_bytes
    from ringfeed.shards.verify import verify

    result = verify(args.out, args.workers, *_storage(args))
    for check in result.bad:
        print(f"BAD {check.split}/{check.name}: {'; '.join(check.problems)}")
    if result.unlisted:
        print(f"note: {len(result.unlisted)} .tar file(s) in {args.out} are not in the manifest "
              f"(e.g. {result.unlisted[0]}); the pipeline does not read them")
    samples = sum(c.num_samples for c in result.checks)
    nbytes = sum(c.bytes for c in result.checks)
    verdict = (f"{len(result.bad)} BAD" if result.bad
               else "all OK (sha256, size, sample counts and index sidecars)")
    print(f"ringfeed verify: {len(result.checks)} shards, {samples:,} samples, "
          f"{human_bytes(nbytes)}: {verdict}", flush=True)
    if result.bad:  # bad data, like every other: exit 2 (ringfeed/errors.py's table)
        first = result.bad[0]
        raise UserError(f"verify: {len(result.bad)} of {len(result.checks)} shard(s) in "
                        f"{args.out} are BAD (listed above; first {first.split}/{first.name}): "
                        "re-download or re-create them")
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from ringfeed.shards.inspection import inspect_dataset

    print(inspect_dataset(args.out, args.samples, args.workers, *_storage(args)))
    return 0


def _storage(args: argparse.Namespace) -> tuple[dict, RetryPolicy]:
    """--storage-option's dictionary, and --retry-budget's policy for this command's storage
    calls."""
    from ringfeed.shards.remote import parse_storage_options, retry_policy

    policy = retry_policy(args.retry_budget)
    return parse_storage_options(args.storage_option), policy
