"""``moescope traces convert`` / ``retain``: operations on the Parquet trace lake (``traces.lake``)."""

from __future__ import annotations

import re

import click

from moescope.cli.options import echo, emit_json, json_option
from moescope.errors import BadInput
from moescope.traces import lake


@click.group("traces")
def traces() -> None:
    """The Parquet trace lake: convert SQLite stores into one, compact small files, trim by age and size."""


@traces.command("convert")
@click.argument("src", type=click.Path(dir_okay=False))
@click.argument("dst", type=click.Path(file_okay=False))
@json_option
def convert(src: str, dst: str, as_json: bool) -> None:
    """Copy the SQLite trace store SRC into the trace lake DST (a directory; other replicas' files kept)."""
    # start-up: numpy (traces.to_parquet), only when the command runs, not for --help
    from moescope.traces.to_parquet import sqlite_to_lake

    n, files = sqlite_to_lake(src, dst)
    if as_json:
        emit_json({"requests": n, "files": files, "lake": dst})
    else:
        echo(f"converted {n} requests from {src} into {dst} ({files} files in the lake)")


_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _size(text: str | None) -> int | None:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?", (text or "").strip().lower())
    if text is not None and not m:
        raise BadInput(f"--max-size {text!r}: use bytes or a size such as 500M, 20G")
    return int(float(m[1]) * _UNITS[m[2]]) if m else None


def _age(text: str | None) -> float | None:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", (text or "").strip())
    if text is not None and not m:
        raise BadInput(f"--max-age {text!r}: use a duration (30m, 12h, 7d)")
    return float(m[1]) * _SECONDS[m[2]] if m else None


@traces.command("retain")
@click.argument("lake_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--max-age", default=None, metavar="AGE", help="Delete files closed longer ago than this (7d, 12h).")
@click.option("--max-size", default=None, metavar="SIZE", help="Then delete the oldest files until the lake fits "
              "this (bytes, or 500M, 20G).")
@click.option("--replica", default=None, help="Only this replica's files (its replica= partition).")
@json_option
def retain(lake_dir: str, max_age: str | None, max_size: str | None, replica: str | None, as_json: bool) -> None:
    """Retention: delete LAKE_DIR's oldest files by age and size (the writer does this for its own files)."""
    if max_age is None and max_size is None:
        raise BadInput("give --max-age, --max-size or both")
    deleted = lake.enforce_retention(lake_dir, replica, max_bytes=_size(max_size), max_age_s=_age(max_age))
    if as_json:
        emit_json({"deleted": [str(p) for p in deleted]})
    else:
        echo(f"deleted {len(deleted)} file{'s' * (len(deleted) != 1)} from {lake_dir}")


@traces.command("compact")
@click.argument("lake_dir", type=click.Path(file_okay=False, exists=True))
@click.option("--min-age", default="10m", show_default=True, metavar="AGE",
              help="Only files closed at least this long ago (a live writer's open ticks are younger).")
@click.option("--target-size", default="256M", show_default=True, metavar="SIZE",
              help="Only files smaller than this are merged.")
@json_option
def compact(lake_dir: str, min_age: str, target_size: str, as_json: bool) -> None:
    """Merge each partition's small files in LAKE_DIR into one (readers never see a request twice)."""
    young: list[str] = []
    done = lake.compact(lake_dir, min_age_s=_age(min_age), target_bytes=_size(target_size), too_young=young)
    if as_json:
        emit_json({"compacted": [{"file": str(p), "merged": n} for p, n in done], "too_young": len(young)})
    else:
        why = (f"; skipped {len(young)} file{'s' * (len(young) != 1)} closed less than {min_age} ago (a live "
               "writer may still add to them; --min-age changes the limit)") if young else ""
        echo(f"merged {sum(n for _, n in done)} files into {len(done)} in {lake_dir}{why}")
