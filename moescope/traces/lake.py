"""The trace lake: the trace store as a directory of Parquet files (pyarrow, zstd) that any query engine reads,
and DuckDB as the embedded engine that reads it.

Layout (chosen by measured bytes per token-layer, docs/traces.md#trace-lake): one row per request with the very
columns of the SQLite store's ``requests`` table (routing as [tokens, layers, k] arrays in binary columns), so
the store's readers (``store.list_requests``, ``iter_routed``, ``load_request``) run their own SQL unchanged over
a DuckDB view named ``requests``: one reader path for both stores. Files are hive-partitioned::

    DIR/model=<model, URL-quoted>/date=<UTC day>/replica=<host>-r<rank>/{t,p}-<run>-<seq>.parquet

Each file carries ``moescope.schema`` (``LAKE_SCHEMA``) in its key-value metadata; a file of another schema is
skipped and counted like a corrupt one.

Writing (``LakeWriter``, on the trace writer's thread; nothing on the engine thread): every flush interval that
finished requests writes one small *tick* file ``t-<run>-<seq>.parquet`` (written under a hidden name, then
renamed: a reader never sees half a file; zstd level 3), so a request is readable within one interval
(0.5 s). Ticks are *rolled* (rewritten at zstd level 9) into one ``p-<run>-<first>-<last>.parquet`` when the
open segment is ``roll_s`` old or ``roll_bytes`` big: the rolled file is renamed into place first, the ticks
deleted after; its footer names the ticks it holds (``moescope.replaces``), and a reader that finds both
leaves the ticks out. A SIGKILL loses at most the interval being written; every renamed file is whole.
``compact`` merges a partition's small closed files (many short runs') the same way.

Reading (``open_lake``): a directory, a glob of directories (many replicas' lakes read as one), or an object
store URL DuckDB reaches (``s3://bucket/traces/``; read with ``**/*.parquet``, no file check). Local files are
listed and their footers checked first: a corrupt or partial file is skipped with one warning line and counted
(``LakeConn.skipped``).
"""

from __future__ import annotations

import glob
import importlib
import json
import os
import re
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import quote

from moescope.errors import BadInput

LAKE_SCHEMA = "1"
SCHEMA_KEY = b"moescope.schema"
REPLACES_KEY = b"moescope.replaces"  # a rolled or compacted file: the names (same directory) of the files it holds
ZSTD_LEVEL = 9  # rolled files: 15.5 bytes per token-layer at deepseek-v3-shape; 3: 16.5 (docs/traces.md#trace-lake)
TICK_ZSTD_LEVEL = 3  # tick files (rewritten at the roll): cheaper for the writer thread that shares the engine's cores
ROW_GROUP = 1024

# The SQLite store's ``requests`` columns, as Parquet types (store._SCHEMA).
_COLUMNS = (
    ("request_id", "string"), ("started", "float64"), ("model", "string"), ("rank", "int64"), ("domain", "string"),
    ("tenant", "string"), ("prompt", "string"), ("output", "string"), ("n_prompt", "int64"), ("n_output", "int64"),
    ("queue_s", "float64"), ("prefill_s", "float64"), ("ttft_s", "float64"), ("total_s", "float64"),
    ("finish_reason", "string"), ("flags", "string"), ("trace_id", "string"), ("n_layers", "int64"),
    ("top_k", "int64"), ("n_experts", "int64"), ("layers", "string"), ("tokens", "binary"), ("latencies", "binary"),
    ("ids", "binary"), ("weights", "binary"), ("entropy", "binary"), ("margin", "binary"), ("miss", "binary"),
    ("step", "binary"), ("steps", "string"),
)


# Min/max statistics (what an engine prunes row groups by) only for the scalar columns: a binary or text
# column's would copy whole values (a request's routing: hundreds of kB) into every footer.
_STATS = [name for name, kind in _COLUMNS if kind != "binary" and name not in ("prompt", "output", "steps", "layers")]


def is_lake(path: str | os.PathLike) -> bool:
    """A lake path: ends with a slash, is an existing directory, holds a glob character, or is a URL."""
    s = str(path)
    return s.endswith(("/", os.sep)) or os.path.isdir(s) or any(c in s for c in "*?[") or "://" in s


def _need(module: str):
    """``module`` imported, or the one-line error that says which extra brings it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise BadInput(f"the trace lake needs {module}: pip install 'moescope[lake]'") from None


def schema():
    import pyarrow as pa  # optional: pyarrow (the lake extra)

    return pa.schema([(name, getattr(pa, kind)()) for name, kind in _COLUMNS],
                     metadata={SCHEMA_KEY: LAKE_SCHEMA.encode()})


def to_table(rows: list[dict[str, Any]]):
    """A pyarrow table of store rows (dicts of the ``requests`` columns; missing ones are null)."""
    import pyarrow as pa  # optional: pyarrow (the lake extra)

    sch = schema()
    return pa.table({name: pa.array([r.get(name) for r in rows], sch.field(name).type) for name in sch.names},
                    schema=sch)


def _write_atomic(table, path: Path, level: int = ZSTD_LEVEL, replaces: list[str] | None = None) -> int:
    """Write ``table`` to ``path`` under a hidden name, then rename it into place; returns its size.
    ``replaces``: the files (names in the same directory) it holds, which readers then leave out."""
    import pyarrow.parquet as pq  # optional: pyarrow (the lake extra)

    if replaces:
        table = table.replace_schema_metadata({**table.schema.metadata, REPLACES_KEY: json.dumps(replaces).encode()})
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp, compression="zstd", compression_level=level, row_group_size=ROW_GROUP,
                   write_statistics=_STATS)
    os.replace(tmp, path)
    return path.stat().st_size


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text) or "_"


class LakeWriter:
    """Writes store rows into one replica's part of a lake (see the module docstring). Not thread-safe: the
    trace writer's thread calls it.

    Args:
        root: the lake directory (created).
        model, rank: the partition (``model=``, ``replica=<host>-r<rank>``).
        run_id: names this process's files (unique per process).
        roll_s, roll_bytes: roll the open tick files into one file at this age / size.
        max_bytes, max_age_s: retention of this replica's files (oldest first); None: keep.
    """

    def __init__(self, root: str | Path, *, model: str | None, rank: int, run_id: str, roll_s: float = 60.0,
                 roll_bytes: int = 64 * 2**20, max_bytes: int | None = None, max_age_s: float | None = None,
                 replica: str | None = None) -> None:
        self.root = Path(root)
        _need("pyarrow.parquet")  # at start, as a clear error: not a lost row per flush later
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BadInput(f"trace lake {root}: cannot create it ({exc.strerror})") from None
        self.model = quote(model or "unknown", safe="")
        self.replica = _safe(replica or f"{socket.gethostname()}-r{rank}")
        self.run_id = run_id
        self.roll_s, self.roll_bytes = roll_s, roll_bytes
        self.max_bytes, self.max_age_s = max_bytes, max_age_s
        self.seq = 0
        self.files = 0  # files written (ticks and rolled)
        self._open: list[tuple[int, Path]] = []  # (seq, tick file) not rolled yet
        # ticks a rolled file replaces, deleted one roll later: a reader that listed them just before the roll
        # still finds them (and leaves them out, by the rolled file's footer)
        self._rolled: list[Path] = []
        self._open_bytes, self._opened = 0, time.monotonic()

    def _dir(self, started: float) -> Path:
        day = time.strftime("%Y-%m-%d", time.gmtime(started))
        d = self.root / f"model={self.model}" / f"date={day}" / f"replica={self.replica}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def write(self, rows: list[dict[str, Any]]) -> None:
        """One flush interval's rows: one tick file (none for no rows); roll when the segment is due."""
        if rows:
            if not self._open:
                self._opened = time.monotonic()
            self.seq += 1
            path = self._dir(rows[0]["started"]) / f"t-{self.run_id}-{self.seq:06d}.parquet"
            self._open_bytes += _write_atomic(to_table(rows), path, TICK_ZSTD_LEVEL)
            self._open.append((self.seq, path))
            self.files += 1
        if self._open and (self._open_bytes >= self.roll_bytes or time.monotonic() - self._opened >= self.roll_s):
            self.roll()

    def roll(self) -> None:
        """Merge the open tick files into one file per partition directory, then delete the ticks."""
        # optional: pyarrow (the lake extra)
        import pyarrow as pa
        import pyarrow.parquet as pq

        by_dir: dict[Path, list[tuple[int, Path]]] = {}
        for seq, path in self._open:
            by_dir.setdefault(path.parent, []).append((seq, path))
        for d, ticks in by_dir.items():  # a single tick too: ticks are zstd 3, rolled files zstd 9
            table = pa.concat_tables([pq.read_table(p, schema=schema()) for _, p in ticks])
            _write_atomic(table, d / f"p-{self.run_id}-{ticks[0][0]:06d}-{ticks[-1][0]:06d}.parquet",
                          replaces=[p.name for _, p in ticks])
            self.files += 1
        for p in self._rolled:
            p.unlink(missing_ok=True)  # (`traces compact` may have taken them already)
        self._rolled = [p for _, p in self._open]
        self._open, self._open_bytes = [], 0
        if self.max_bytes is not None or self.max_age_s is not None:
            enforce_retention(self.root / f"model={self.model}", self.replica, max_bytes=self.max_bytes,
                              max_age_s=self.max_age_s)

    def close(self) -> None:
        if self._open:
            self.roll()
        for p in self._rolled:
            p.unlink(missing_ok=True)
        self._rolled = []


def enforce_retention(root: str | Path, replica: str | None = None, *, max_bytes: int | None = None,
                      max_age_s: float | None = None, now: float | None = None) -> list[Path]:
    """Delete a lake's rolled and tick files (only ``replica``'s when given) older than ``max_age_s`` and then,
    oldest first, until the rest fit ``max_bytes``; returns the deleted paths. A file is dated by its mtime
    (when it was closed)."""
    now = time.time() if now is None else now
    pattern = f"**/replica={replica}/*.parquet" if replica else "**/*.parquet"
    files = []
    for name in glob.glob(os.path.join(glob.escape(str(root)), pattern), recursive=True):
        try:
            st = os.stat(name)
        except OSError:
            continue
        files.append((st.st_mtime, st.st_size, Path(name)))
    files.sort()
    total = sum(size for _, size, _ in files)
    deleted = []
    for mtime, size, path in files:
        too_old = max_age_s is not None and now - mtime > max_age_s
        too_big = max_bytes is not None and total > max_bytes
        if not (too_old or too_big):
            break
        path.unlink(missing_ok=True)
        total -= size
        deleted.append(path)
    return deleted


def compact(root: str | Path, *, min_age_s: float = 600.0, target_bytes: int = 256 * 2**20,
            now: float | None = None, too_young: list[str] | None = None) -> list[tuple[Path, int]]:
    """Merge each partition directory's small files (under ``target_bytes``, closed ``min_age_s`` ago or more:
    never a live writer's open ticks) into one ``c-<id>.parquet`` that names them in its footer, then delete
    them (and any file an earlier roll or compaction replaced but did not delete). Returns (new file, files
    merged) per directory merged. ``too_young``: a list that receives the small files left alone because they
    closed less than ``min_age_s`` ago."""
    # optional: pyarrow (the lake extra)
    import pyarrow as pa
    import pyarrow.parquet as pq

    now = time.time() if now is None else now
    done = []
    for d in sorted({os.path.dirname(f) for f in data_files(str(root))}):
        skipped: dict[str, str] = {}
        files = readable_files(d, skipped)
        leftover = [f for f in data_files(d) if f not in files and f not in skipped]
        small = [f for f in files if os.path.getsize(f) < target_bytes]
        merge = [f for f in small if now - os.path.getmtime(f) >= min_age_s]
        if too_young is not None:
            too_young.extend(f for f in small if f not in merge)
        if len(merge) >= 2:
            table = pa.concat_tables([pq.read_table(f, schema=schema()) for f in merge])
            dst = Path(d) / f"c-{uuid.uuid4().hex[:12]}.parquet"
            _write_atomic(table, dst, replaces=[os.path.basename(f) for f in merge + leftover])
            done.append((dst, len(merge)))
            leftover += merge
        for f in leftover:
            Path(f).unlink(missing_ok=True)
    return done


# -- reading ------------------------------------------------------------------------------------------------


def data_files(path: str) -> list[str]:
    """The Parquet files under ``path`` (a directory, or a glob of directories and files)."""
    roots = sorted(glob.glob(path, recursive=True)) if any(c in path for c in "*?[") else [path]
    files: set[str] = set()
    for root in roots:
        if os.path.isdir(root):
            files.update(glob.glob(os.path.join(glob.escape(root), "**", "*.parquet"), recursive=True))
        elif root.endswith(".parquet") and os.path.isfile(root):
            files.add(root)
    return sorted(files)


def _footers(files: list[str], duck=None) -> dict[str, tuple[str | None, list[str]]]:
    """Per file: (why it is not a readable lake file or None, the paths it replaces). Footers are read with
    DuckDB (``parquet_kv_metadata``; importing pyarrow would cost a command 0.6 s): all files in one call, and
    file by file only when that call fails (a damaged file among them). ``duck``: a connection to use (a new
    one costs about 0.1 s), else one of its own."""
    import duckdb  # optional: duckdb (the lake extra)

    own = duck is None
    duck = duckdb.connect() if own else duck
    kv: dict[str, dict[bytes, bytes]] = {f: {} for f in files}
    out: dict[str, tuple[str | None, list[str]]] = {}

    def read(batch: list[str]) -> None:
        for name, key, value in duck.execute("SELECT file_name, key, value FROM parquet_kv_metadata(?)",
                                             [batch]).fetchall():
            kv[name][bytes(key)] = bytes(value)

    try:
        if files:
            read(files)
    except duckdb.Error:
        for f in files:
            try:
                read([f])
            except duckdb.Error as exc:
                out[f] = (f"not a readable Parquet file ({str(exc).splitlines()[0][:120]})", [])
    if own:
        duck.close()
    for f in files:
        if f in out:
            continue
        version = kv[f].get(SCHEMA_KEY)
        if version != LAKE_SCHEMA.encode():
            out[f] = (f"lake schema {version.decode(errors='replace') if version else 'missing'} (this moescope "
                      f"reads {LAKE_SCHEMA})", [])
            continue
        try:
            replaces = json.loads(kv[f].get(REPLACES_KEY, b"[]"))
        except ValueError:
            out[f] = ("its list of replaced files is not JSON", [])
            continue
        out[f] = (None, [os.path.join(os.path.dirname(f), str(name)) for name in replaces])
    return out


def readable_files(path: str, skipped: dict[str, str] | None = None, duck=None) -> list[str]:
    """The files a read of ``path`` uses: whole lake files, less those another one replaces (a roll or a
    compaction killed between its rename and its deletes leaves both); the rest go into ``skipped`` (path ->
    why)."""
    skipped = {} if skipped is None else skipped
    ok, replaced = [], set()
    for f, (why, replaces) in _footers(data_files(path), duck).items():
        if why is None:
            ok.append(f)
            replaced.update(replaces)
        else:
            skipped[f] = why
    return [f for f in ok if f not in replaced]


class _Cursor:
    """DuckDB's result as the slice of a sqlite3 cursor the store's readers use."""

    def __init__(self, cur) -> None:
        self._cur = cur
        self.description = cur.description

    def fetchone(self):
        return self._cur.fetchone()

    def fetchall(self):
        return self._cur.fetchall()

    def __iter__(self) -> Iterator[tuple]:
        while batch := self._cur.fetchmany(256):
            yield from batch


class LakeConn:
    """A DuckDB connection over a lake with a view ``requests`` of the SQLite store's columns: what
    ``store.open_store`` returns for a lake, read by the same functions (``execute``, ``close``)."""

    def __init__(self, duck, skipped: dict[str, str], files: int) -> None:
        self.duck, self.skipped, self.files = duck, skipped, files

    def execute(self, sql: str, args=()) -> _Cursor:
        import duckdb  # optional: duckdb (the lake extra)

        try:
            return _Cursor(self.duck.execute(sql, list(args)))
        except duckdb.Error as exc:
            raise BadInput(f"the trace lake is not readable: {str(exc).splitlines()[0]}") from None

    def commit(self) -> None:
        pass

    def close(self) -> None:
        self.duck.close()


def _sql_list(items: list[str]) -> str:
    return "[" + ", ".join("'" + s.replace("'", "''") + "'" for s in items) + "]"


def open_lake(path: str | os.PathLike, *, warn=None) -> LakeConn:
    """Open a lake for reading (see the module docstring); ``warn``: where the one line about skipped files
    goes (default stderr)."""
    duckdb = _need("duckdb")

    s = str(path)
    duck = duckdb.connect()
    skipped: dict[str, str] = {}
    if "://" in s:  # an object store: DuckDB lists and reads it (httpfs); no footer check here
        files_sql, n = "'" + s.rstrip("/").replace("'", "''") + "/**/*.parquet'", -1
    else:
        if not any(c in s for c in "*?[") and not os.path.isdir(s):
            raise BadInput(f"trace lake {s} does not exist (run `moescope demo --traces {s.rstrip('/')}/` first)")
        if any(c in s for c in "*?[") and not glob.glob(s, recursive=True):
            raise BadInput(f"trace lake {s}: the pattern matches nothing")
        files = readable_files(s, skipped, duck)
        if skipped:
            first, why = next(iter(skipped.items()))
            line = (f"moescope: warning: skipped {len(skipped)} unreadable trace file{'s' * (len(skipped) > 1)} "
                    f"(counted; first: {first}: {why})")
            (warn or (lambda t: print(t, file=sys.stderr, flush=True)))(line)
        files_sql, n = _sql_list(files), len(files)
    if n == 0:
        types = {"string": "VARCHAR", "float64": "DOUBLE", "int64": "BIGINT", "binary": "BLOB"}
        duck.execute("CREATE VIEW requests AS SELECT " + ", ".join(f"NULL::{types[kind]} AS {name}" for name, kind
                                                                   in _COLUMNS) + ", 0::BIGINT AS rowid WHERE false")
    else:
        duck.execute("CREATE VIEW requests AS SELECT * EXCLUDE (file_row_number), file_row_number AS rowid FROM "
                     f"read_parquet({files_sql}, hive_partitioning=true, union_by_name=true, file_row_number=true)")
    return LakeConn(duck, skipped, n)
