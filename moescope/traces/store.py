"""The trace store: an embedded SQLite database (WAL) of requests and the routing of each of their tokens.

One row per kept request. Token-level data is stored as arrays per request, not a row per number:
``ids`` [N, L, k] int16, ``weights`` [N, L, k] float16, ``entropy``/``margin`` [N, L] float16, ``miss``
[N, L] bitmask of the token's experts that were cache misses, ``step`` [N] uint16 index into the request's
step list (each step: phase, seconds, per-layer router/expert/all-to-all seconds). N = the positions the
model routed for this request: its prompt, then each generated token fed back (the last generated token
is never fed back, so it has no routing). That is 12 bytes per token and layer at top-2 before SQLite's
own overhead.

Schema versioned in ``meta``; a store written by another schema version is refused with a clear message.
Retention by size: past ``max_bytes`` the oldest requests are deleted and the space reclaimed.

Corrupt rows (one request's columns holding what no writer of ours makes: blobs whose sizes disagree with the
token counts, expert ids out of range, JSON that does not parse) are checked when read: the readers that walk
many requests (``list_requests``, ``iter_routed``) skip such a row, warn about it on one line and count it in
a ``CorruptRows``; ``load_request`` (one request) raises ``BadInput``.
"""

from __future__ import annotations

import difflib
import json
import os
import sqlite3
import sys
import time
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from moescope.errors import BadInput
from moescope.runtime import tokenizer
from moescope.traces import lake
from moescope.traces.sanitize import sanitize

SCHEMA_VERSION = 1
DEFAULT_PATH = Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "moescope" / "traces.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS requests (
    request_id TEXT PRIMARY KEY,
    started REAL NOT NULL,          -- arrival, unix seconds
    model TEXT, rank INTEGER, domain TEXT, tenant TEXT,
    prompt TEXT NOT NULL, output TEXT NOT NULL,
    n_prompt INTEGER NOT NULL, n_output INTEGER NOT NULL,
    queue_s REAL, prefill_s REAL, ttft_s REAL, total_s REAL,
    finish_reason TEXT, flags TEXT NOT NULL DEFAULT '',
    trace_id TEXT,
    n_layers INTEGER, top_k INTEGER, n_experts INTEGER, layers TEXT,
    tokens BLOB,                    -- uint16 or int32 [n_prompt + n_output] token ids
    latencies BLOB,                 -- float32 [n_output] per output token (first = ttft)
    ids BLOB, weights BLOB, entropy BLOB, margin BLOB, miss BLOB, step BLOB,
    steps TEXT                      -- JSON: [{phase, seconds, layer_s: {layer: [router, experts, a2a]}, run, index,
                                    --        t (unix s), rss (bytes), kv (KV-cache tokens held after the step),
                                    --        peer_wait: {layer: [s per peer]},
                                    --        scored: false where the engine gave no router scores}]
);
CREATE INDEX IF NOT EXISTS requests_started ON requests(started);
CREATE INDEX IF NOT EXISTS requests_total ON requests(total_s);
-- the ids of the latest requests the writer served but did not keep (sampled out), bounded (``SAMPLED_OUT_MAX``):
-- what lets `moescope trace ID` say "served, not kept" instead of "no request". (Added beside schema 1: a store
-- written before it simply has no such table, and its readers say they cannot tell.)
CREATE TABLE IF NOT EXISTS sampled_out (
    request_id TEXT PRIMARY KEY,
    ended REAL NOT NULL,            -- unix seconds
    sample REAL NOT NULL            -- the writer's sample rate then (MOESCOPE_TRACE_SAMPLE)
);
"""

# The sampled-out ids remembered: the latest ``SAMPLED_OUT_MAX`` (100,000: a day at ~1 request/s kept whole; at
# ~60 bytes a row with its index, ~6 MB), never more than a tenth of the store's size budget (``sampled_out_max``)
# so that retention keeps room for the kept requests themselves.
SAMPLED_OUT_MAX = 100_000
SAMPLED_OUT_ROW_BYTES = 200  # a generous row size (an id of up to ~100 characters, twice: table and index)
# A client asks for one request to be kept by an id that starts with this (``X-Request-Id: moescope-keep-...``;
# vLLM's response id is then ``cmpl-moescope-keep-...`` or ``chatcmpl-moescope-keep-...``): ``keep_requested``.
KEEP_PREFIX = "moescope-keep-"


def keep_requested(request_id: str) -> bool:
    """Whether a request's id asks for it to be kept whatever the sample rate: the id starts with ``KEEP_PREFIX``,
    or an engine's id made of a prefix and the client's id does (``cmpl-`` + ``moescope-keep-...``)."""
    return isinstance(request_id, str) and (request_id.startswith(KEEP_PREFIX) or f"-{KEEP_PREFIX}" in request_id)


def sampled_out_max(max_bytes: int) -> int:
    """How many sampled-out ids a store of ``max_bytes`` remembers (``SAMPLED_OUT_MAX``, within a tenth of it)."""
    return max(1, min(SAMPLED_OUT_MAX, max_bytes // 10 // SAMPLED_OUT_ROW_BYTES))


def note_sampled_out(conn, rows: list[tuple[str, float, float]], keep: int) -> None:
    """Remember ``rows`` (request id, end unix s, sample rate) as served but not kept; forget all but the latest
    ``keep``. The caller commits."""
    if not rows:
        return
    conn.executemany("INSERT OR REPLACE INTO sampled_out (request_id, ended, sample) VALUES (?, ?, ?)", rows)
    last = conn.execute("SELECT MAX(rowid) FROM sampled_out").fetchone()[0]
    if last is not None and last > keep:
        conn.execute("DELETE FROM sampled_out WHERE rowid <= ?", (last - keep,))


def sampled_out(conn, request_id: str) -> tuple[float, float] | None:
    """(end unix s, sample rate) of a request the writer served but did not keep, or None: not among the latest
    it remembers, or a store that keeps no such record (a lake, a store written before the record existed)."""
    try:
        row = conn.execute("SELECT ended, sample FROM sampled_out WHERE request_id = ?", (request_id,)).fetchone()
    except Exception:  # noqa: BLE001 (no such table: SQLite's or DuckDB's error; nothing to tell)
        return None
    if row is None or not (_is_num(row[0]) and _is_num(row[1])):
        return None
    return float(row[0]), float(row[1])


def not_kept_message(request_id: str, ended: float, sample: float) -> str:
    """The one line ``trace`` says of a request that was served but not kept."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ended))
    return (f"request {request_id!r} was served (finished {when}) but not kept: the trace store keeps a random "
            f"{sample:.0%} of requests (MOESCOPE_TRACE_SAMPLE={sample:g}; flagged ones always). To keep every "
            f"request set MOESCOPE_TRACE_SAMPLE=1; to keep one, send it with an X-Request-Id starting with "
            f"{KEEP_PREFIX!r}")


def _connect(path: Path, *, create: bool) -> sqlite3.Connection:
    if not create and not path.exists():
        raise BadInput(f"trace store {path} does not exist (run `moescope demo` first, or pass --traces PATH)")
    try:
        conn = sqlite3.connect(str(path), timeout=10, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn
    except sqlite3.DatabaseError as exc:
        raise BadInput(f"trace store {path} is not readable: {exc}") from None


def open_store(path: str | Path, *, create: bool = False):
    """Open (or create) a store and check its schema version: the one place readers open a store. A lake path
    (a directory, a glob of them, a URL: ``lake.is_lake``) opens the Parquet trace lake read-only through
    DuckDB (``lake.LakeConn``: the same ``execute`` the readers below use); anything else the SQLite file."""
    if not create and lake.is_lake(path):
        return lake.open_lake(path)
    path = Path(path)
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
    conn = _connect(path, create=create)
    try:
        if create:
            conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
            conn.executescript(_SCHEMA)
            conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            conn.commit()
        row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise BadInput(f"trace store {path} is corrupt or not a moescope trace store: {exc}") from None
    if row is None:
        conn.close()
        raise BadInput(f"trace store {path} has no schema version: not a moescope trace store")
    version = int(row[0])
    if version != SCHEMA_VERSION:
        conn.close()
        newer = "a newer" if version > SCHEMA_VERSION else "an older"
        raise BadInput(f"trace store {path} was written by {newer} moescope (schema {version}; this version reads "
                       f"schema {SCHEMA_VERSION}): upgrade moescope or start a new store")
    return conn


class CorruptRow(BadInput):
    """One stored request's columns hold what no writer of ours makes; the message says which column."""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class CorruptRows:
    """The corrupt rows a read skipped, counted; each warned about on one line (the first ``max_warnings``,
    then one line saying the rest are counted, not shown). A row skipped twice (a command reading the store
    twice) counts and warns once.

    Args:
        warn: where the warning lines go (default: stderr); ``None``-returning callable of one string.
        max_warnings: warning lines before going quiet.
    """

    def __init__(self, warn: Callable[[str], None] | None = _stderr, max_warnings: int = 10) -> None:
        self.rows: dict[str, str] = {}  # request id (or rowid) -> why
        self._warn = warn
        self._max = max_warnings
        self._noted_shapes = False

    @property
    def count(self) -> int:
        return len(self.rows)

    def add(self, key: str, reason: str) -> None:
        if key in self.rows:
            return
        self.rows[key] = reason
        if self._warn is None or self.count > self._max + 1:
            return
        if self.count == self._max + 1:
            self._warn("moescope: warning: more corrupt rows skipped (counted, not shown)")
        else:
            self._warn(f"moescope: warning: skipped corrupt row {self.count} ({key}): {reason}")

    def other_shapes(self, n: int, read: "Routed", others: Callable[[], list[tuple[str | None, int]]]) -> None:
        """Note (once) that ``n`` requests of other model shapes were left out of a read of ``read``'s shape;
        ``others`` gives those requests' models and counts (asked only when the note is written), which the note
        names with the option that reads one of them."""
        if self._warn is None or self._noted_shapes:
            return
        self._noted_shapes = True
        models = _named(others())
        self._warn(f"moescope: note: read the requests of one model shape ({_shown(read.model)}: "
                   f"{len(read.layers)} MoE layers, {read.n_experts} experts, top-{read.top_k}); {n} of other shapes "
                   "left out" + (f": {models}; read another with --model NAME" if models else ""))

    def nothing_left(self, message: str) -> BadInput:
        """The error for a read that found nothing usable: ``message``, plus the skipped count if any."""
        if self.count:
            message += f" ({self.count} corrupt row{'s' if self.count > 1 else ''} skipped, nothing readable left)"
        return BadInput(message)


def _shown(name) -> str:
    """A stored name (a model's) fit for one line of terminal text."""
    return "(no model name)" if name is None else sanitize(str(name), keep_newlines=False)[:80]


def _named(models: list[tuple[str | None, int]], most: int = 12) -> str:
    """``a (12 requests), b (8 requests)``: models and their request counts, the first ``most`` of them."""
    more = f", and {len(models) - most} more" if len(models) > most else ""
    return ", ".join(f"{_shown(m)} ({n} request{'s' * (n != 1)})" for m, n in models[:most]) + more


def _row_key(rowid, request_id) -> str:
    name = sanitize(request_id, keep_newlines=False)[:60] if isinstance(request_id, str) else None
    return f"request {name!r}" if name else f"row {rowid}"


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise CorruptRow(what)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_time(x) -> bool:
    """Unix seconds a calendar can show (year 1970 to 5000)."""
    return _is_num(x) and 0 <= x < 9.5e10


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_blob(x, sizes: tuple[int, ...], nullable: bool = True) -> bool:
    if x is None:
        return nullable
    return isinstance(x, bytes) and len(x) in sizes


@dataclass(frozen=True)
class RequestRow:
    request_id: str
    started: float
    n_prompt: int
    n_output: int
    total_s: float
    ttft_s: float
    flags: tuple[str, ...]
    domain: str | None
    tenant: str | None


LIST_COLUMNS = "request_id, started, n_prompt, n_output, total_s, ttft_s, flags, domain, tenant"


def _row(r) -> RequestRow:
    rid, started, n_prompt, n_output, total_s, ttft_s, flags, domain, tenant = r
    _check(isinstance(rid, str), "request_id is not text")
    _check(_is_time(started), "started is not a time")
    _check(_is_count(n_prompt) and _is_count(n_output), "token counts are not counts")
    _check(_is_num(total_s) and _is_num(ttft_s), "timings are not numbers")
    _check(flags is None or isinstance(flags, str), "flags are not text")
    _check(all(x is None or isinstance(x, str) for x in (domain, tenant)), "domain/tenant are not text")
    return RequestRow(rid, started, n_prompt, n_output, total_s, ttft_s,
                      tuple(f for f in (flags or "").split(",") if f), domain, tenant)


def list_requests(conn, *, flag: list[str] | None = None, since: float | None = None, slowest: int | None = None,
                  limit: int = 50, corrupt: CorruptRows | None = None) -> list[RequestRow]:
    """The newest (or with ``slowest`` the slowest) stored requests; corrupt rows are skipped into ``corrupt``
    (a fresh ``CorruptRows`` warning on stderr when not given)."""
    corrupt = CorruptRows() if corrupt is None else corrupt
    where, args = [], []
    for f in flag or []:
        where.append("(',' || flags || ',') LIKE ?")
        args.append(f"%,{f},%")
    if since is not None:
        where.append("started >= ?")
        args.append(since)
    sql = f"SELECT rowid, {LIST_COLUMNS} FROM requests"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY total_s DESC" if slowest else " ORDER BY started DESC"
    sql += " LIMIT ?"
    args.append(slowest or limit)
    out = []
    for r in _rows(conn, sql, args):
        try:
            out.append(_row(r[1:]))
        except CorruptRow as exc:
            corrupt.add(_row_key(r[0], r[1]), str(exc))
    return out


def _rows(conn, sql: str, args) -> Iterator[tuple]:
    """The rows of a query; a store damaged below the row level (SQLite's own pages) is one clear error."""
    try:
        yield from conn.execute(sql, args)
    except sqlite3.DatabaseError as exc:
        raise BadInput(f"the trace store is not readable: {exc}") from None


def nearest_ids(conn, request_id: str, n: int = 3) -> list[str]:
    """Stored ids closest to ``request_id`` (shared prefix first, then edit similarity)."""
    ids = [r[0] for r in conn.execute("SELECT request_id FROM requests ORDER BY started DESC LIMIT 5000")
           if isinstance(r[0], str)]
    return difflib.get_close_matches(request_id, ids, n=n, cutoff=0.0)[:n]


def _arr(blob, dtype, shape) -> np.ndarray:
    return np.frombuffer(blob, dtype=dtype).reshape(shape) if blob is not None else np.zeros(shape, dtype)


def _ints(blob, n: int) -> np.ndarray:
    """An integer array stored as uint16 or int32: the blob's length tells which."""
    if blob is None or n == 0:
        return np.zeros(n, dtype=np.int64)
    return np.frombuffer(blob, dtype=np.uint16 if len(blob) == 2 * n else np.int32).astype(np.int64)


_ROUTED_COLUMNS = ("request_id, started, model, domain, tenant, n_prompt, n_output, layers, top_k, n_experts, "
                   "ids, tokens, entropy, miss, step, steps, finish_reason")


def routed_rows(n_prompt: int, n_output: int, finish_reason: str | None) -> int:
    """How many of a request's tokens a forward routed: the prompt and every output token but the last (no
    forward routed it), and for a request that ended on non-finite numbers ("error") that last one too (its
    forward gave them; no next token was made). The writer stores exactly these rows."""
    return n_prompt + (n_output if finish_reason == "error" else max(0, n_output - 1))


@dataclass
class Routed:
    """One stored request's routing, decoded on first use. Rows are its routed tokens: the prompt, then the
    generated tokens but the last (which no forward routed)."""

    request_id: str
    started: float
    model: str
    domain: str | None
    tenant: str | None
    n_prompt: int
    n_output: int
    layers_json: str
    top_k: int
    n_experts: int
    ids_blob: bytes
    tokens_blob: bytes | None
    entropy_blob: bytes | None
    miss_blob: bytes | None
    step_blob: bytes | None
    steps_json: str | None
    finish_reason: str | None = None

    @property
    def n_routed(self) -> int:
        return routed_rows(self.n_prompt, self.n_output, self.finish_reason)

    @cached_property
    def layers(self) -> list[int]:
        return json.loads(self.layers_json)

    @cached_property
    def ids(self) -> np.ndarray:
        """[n_routed, layers, k] int16 experts; the sentinel ``n_experts`` marks a dropped slot."""
        return np.frombuffer(self.ids_blob, dtype=np.int16).reshape(self.n_routed, len(self.layers), self.top_k)

    @cached_property
    def tokens(self) -> np.ndarray:
        """[n_routed] token ids of the routed rows."""
        return _ints(self.tokens_blob, self.n_prompt + self.n_output)[: self.n_routed]

    @cached_property
    def entropy(self) -> np.ndarray:
        return _arr(self.entropy_blob, np.float16, (self.n_routed, len(self.layers))).astype(np.float32)

    @cached_property
    def miss(self) -> np.ndarray:
        """[n_routed, layers] uint8: bit s set when slot s missed the expert cache."""
        return _arr(self.miss_blob, np.uint8, (self.n_routed, len(self.layers)))

    @cached_property
    def step_of(self) -> np.ndarray:
        """[n_routed] index into ``steps`` of the engine step that routed each row."""
        return _ints(self.step_blob, self.n_routed)

    @cached_property
    def nonfinite(self) -> np.ndarray:
        """[n_routed, layers] bool: the router's output was NaN/Inf at that token and layer (``nonfinite_cells``:
        a row of a step whose engine gave no router scores is never non-finite, its NaN means unknown)."""
        return nonfinite_cells(self.entropy, self.steps, self.step_of)

    @cached_property
    def steps(self) -> list[dict]:
        return json.loads(self.steps_json or "[]")

    @property
    def run(self) -> str | None:
        """The id of the writer run that stored this request (its steps' ``run``: one run per request), as
        ``RUN_SQL`` reads it; None when its steps name none."""
        first = next((st["run"] for st in self.steps if isinstance(st, dict) and "run" in st), None)
        return first if isinstance(first, str) and first else None

    def check(self) -> None:
        """Raise ``CorruptRow`` unless every column decodes and agrees with the token counts: what the readers
        index with (expert ids, step indices, step records) is checked, so a reader never meets garbage."""
        _check(isinstance(self.request_id, str), "request_id is not text")
        _check(_is_time(self.started), "started is not a time")
        _check(_is_count(self.n_prompt) and _is_count(self.n_output), "token counts are not counts")
        _check(all(x is None or isinstance(x, str) for x in (self.model, self.domain, self.tenant)),
               "model/domain/tenant are not text")
        _check(_valid_shape(self.layers_json, self.top_k, self.n_experts), "layers, top_k or n_experts are not "
               "sizes")
        layers = json.loads(self.layers_json)
        try:
            steps = json.loads(self.steps_json) if isinstance(self.steps_json, str) else [] if self.steps_json \
                is None else None
        except ValueError:
            raise CorruptRow("steps are not JSON") from None
        n, cells = self.n_routed, self.n_routed * len(layers)
        _check(_is_blob(self.ids_blob, (2 * cells * self.top_k,), nullable=False),
               "routing (ids) does not match the token counts")
        n_tokens = self.n_prompt + self.n_output
        _check(_is_blob(self.tokens_blob, (2 * n_tokens, 4 * n_tokens)), "tokens do not match the token counts")
        _check(_is_blob(self.entropy_blob, (2 * cells,)), "entropy does not match the token counts")
        _check(_is_blob(self.miss_blob, (cells,)), "cache misses do not match the token counts")
        _check(_is_blob(self.step_blob, (2 * n, 4 * n)), "step indices do not match the token counts")
        _check(isinstance(steps, list) and all(_valid_step(st) for st in steps), "steps are not step records")
        self.__dict__["layers"], self.__dict__["steps"] = layers, steps  # (the cached properties' values)
        ids = self.ids
        _check(bool(((ids >= 0) & (ids <= self.n_experts)).all()), "expert ids out of range")
        step_of = self.step_of
        _check(not len(step_of) or (bool((step_of >= 0).all()) and int(step_of.max()) < len(steps)),
               "step indices point past the request's steps")


def unscored_rows(steps: list, step_of: np.ndarray) -> np.ndarray:
    """[n_routed] bool: the rows routed by a step whose engine gave no router scores (its record says
    ``"scored": false``; vLLM's capture sees the chosen ids only), whose stored entropy, margin and weights are
    NaN meaning unknown."""
    unscored = [j for j, st in enumerate(steps) if isinstance(st, dict) and st.get("scored") is False]
    if not unscored or not len(step_of):
        return np.zeros(len(step_of), dtype=bool)
    return np.isin(np.asarray(step_of), unscored)


def nonfinite_cells(entropy: np.ndarray, steps: list, step_of: np.ndarray) -> np.ndarray:
    """[n_routed, layers] bool: where the router's output was non-finite (stored entropy NaN/Inf), on the rows of
    scored steps only: every reader that tells a NaN router from a healthy one asks this, never ``isfinite`` of
    the entropy (an unscored row's NaN is not a fault)."""
    bad = ~np.isfinite(entropy)
    unscored = unscored_rows(steps, step_of)
    if unscored.any():
        bad &= ~unscored[:, None]
    return bad


def _valid_shape(layers_json, top_k, n_experts) -> bool:
    """The columns a model shape is read by: a JSON list of layer numbers, 0 < top_k <= n_experts, and
    n_experts within what int16 ids can name."""
    try:
        layers = json.loads(layers_json) if isinstance(layers_json, str) else None
    except ValueError:
        return False
    return (isinstance(layers, list) and bool(layers) and all(_is_count(x) for x in layers)
            and _is_count(top_k) and _is_count(n_experts) and 0 < top_k <= n_experts < 2**15)


_TIME = frozenset({int, float, type(None)})  # what a layer time may be, as json.loads gives it (no bool)


def _valid_step(st) -> bool:
    """A step record as the recorder writes it: numbers where numbers go, layer times as 3-lists."""
    if not isinstance(st, dict):
        return False
    if any(st.get(key) is not None and not _is_num(st[key]) for key in ("seconds", "t", "rss", "index")):
        return False
    if not all(st.get(key) is None or isinstance(st[key], str) for key in ("phase", "run")):
        return False
    layer_s, peer_wait = st.get("layer_s") or {}, st.get("peer_wait") or {}
    if not isinstance(layer_s, dict) or not isinstance(peer_wait, dict):
        return False
    times = layer_s.values()  # one entry per layer and step (~6k a request at 58 layers): checked by type sets
    if not all(type(v) is list and len(v) == 3 for v in times) or not {type(x) for v in times for x in v} <= _TIME:
        return False
    return all(isinstance(v, list) and all(_is_num(x) for x in v) for v in peer_wait.values())


# one model shape, NULL equal to NULL, in SQL both engines read: SQLite before 3.39 (Ubuntu 22.04's 3.37) has
# no ``IS NOT DISTINCT FROM``; DuckDB, the lake's engine, has no ``IS ?``
_SHAPE = "coalesce(layers, '') = coalesce(?, '') AND coalesce(top_k, -1) = coalesce(?, -1) AND " \
    "coalesce(n_experts, -1) = coalesce(?, -1)"


# The writer run of a stored request, in SQL both engines read (SQLite, DuckDB over the lake): the first ``"run"``
# key's string value in the head of its ``steps`` JSON (the writer puts ``run`` among a step's first keys, and a
# request's steps share one run), without decoding the JSON or the routing arrays. NULL where the head names none.
_HEAD = "substr(steps, 1, 512)"
_AFTER = f"ltrim(substr({_HEAD}, instr({_HEAD}, '\"run\"') + 5), ' :')"
_VALUE = f"substr({_AFTER}, 2)"  # after the opening quote
RUN_SQL = (f"(CASE WHEN instr({_HEAD}, '\"run\"') > 0 AND substr({_AFTER}, 1, 1) = '\"' AND instr({_VALUE}, '\"') > 1 "
           f"THEN substr({_VALUE}, 1, instr({_VALUE}, '\"') - 1) END)")


@dataclass(frozen=True)
class RunSpan:
    """One writer run's stored requests that carry routing: its id, how many rows (as stored: not checked), and
    the arrival of its first and last."""

    run: str
    requests: int
    first: float
    last: float


def routed_where(since: float | None, model: str | None) -> tuple[str, list]:
    """The WHERE clause (and its arguments) of the stored requests that carry routing, started at or after
    ``since``, of ``model`` (None: every model): plain SQL that SQLite and DuckDB (the lake) both read."""
    where, args = "ids IS NOT NULL", []
    if since is not None:
        where += " AND started >= ?"
        args.append(since)
    if model is not None:
        where += " AND model = ?"
        args.append(model)
    return where, args


def stored_models(conn) -> list[tuple[str | None, int]]:
    """The models of the stored requests that carry routing, with how many each, most first."""
    counts: dict[str | None, int] = {}
    for model, n in _rows(conn, "SELECT model, COUNT(*) FROM requests WHERE ids IS NOT NULL GROUP BY model", []):
        if model is None or isinstance(model, str):  # (another type: a corrupt row, counted where it is read)
            counts[model] = counts.get(model, 0) + int(n)
    return sorted(counts.items(), key=lambda mc: (-mc[1], mc[0] or ""))


def check_model(conn, model: str | None) -> None:
    """``BadInput`` (one line, naming the stored models) unless ``model`` is None or a model of the stored
    requests that carry routing: what ``--model`` names."""
    if model is None:
        return
    stored = stored_models(conn)
    if any(m == model for m, _ in stored):
        return
    raise BadInput(f"--model {_shown(model)}: no such model in the trace store; "
                   + (f"stored models: {_named(stored)}" if stored else "the store holds no routed requests"))


def routed_runs(conn, *, since: float | None = None, model: str | None = None) -> list[RunSpan]:
    """The writer runs of the stored requests that carry routing (started at or after ``since``; of ``model``,
    None: every model), newest first (by their last request's arrival): one SQL query over the head of each
    row's steps, the routing never decoded. Rows whose steps name no run (none of our writers makes one:
    corrupt) belong to no run; readers given ``runs`` read them with any run, where their check skips them. A
    ``model`` the store does not hold is ``BadInput`` naming the stored models."""
    where, args = routed_where(since, model)
    spans: dict[str, list] = {}  # run -> [requests, first, last]
    for run, started in _rows(conn, f"SELECT {RUN_SQL}, started FROM requests WHERE {where}", args):
        if not (isinstance(run, str) and run and _is_time(started)):  # corrupt: counted where the rows are read
            continue
        span = spans.setdefault(run, [0, started, started])
        span[0] += 1
        span[1], span[2] = min(span[1], started), max(span[2], started)
    out = [RunSpan(run, n, float(first), float(last)) for run, (n, first, last) in spans.items()]
    out.sort(key=lambda r: (-r.last, -r.first, r.run))
    if not out:
        check_model(conn, model)
    return out


def iter_routed(conn, *, since: float | None = None, limit: int | None = None, newest: bool = False,
                corrupt: CorruptRows | None = None, runs=None, model: str | None = None) -> Iterator[Routed]:
    """The stored requests that carry routing, oldest first; ``since``: started at or after; ``limit``: at most
    that many rows, the oldest (or with ``newest`` the newest, still yielded oldest first); ``runs``: only the
    requests of these writer runs (ids as ``routed_runs`` gives them; None: every run); ``model``: only this
    model's requests (None: every model; one the store does not hold is ``BadInput`` naming the stored ones).

    One model shape at a time (layers, top-k, experts: what the readers stack arrays by): the shape most
    requests in the window have; requests of other shapes are left out, with one note on stderr naming their
    models and ``--model``. Every yielded request has passed ``Routed.check``; a corrupt row is skipped into
    ``corrupt`` (a fresh ``CorruptRows`` warning on stderr when not given)."""
    corrupt = CorruptRows() if corrupt is None else corrupt
    where, args = routed_where(since, model)
    if runs is not None:  # (and the rows that name no run: corrupt ones, skipped below with their warning)
        runs = list(runs)
        where += f" AND ({RUN_SQL} IS NULL" + (f" OR {RUN_SQL} IN ({', '.join('?' * len(runs))})" if runs else "") + ")"
        args += runs
    shapes = list(_rows(conn, f"SELECT layers, top_k, n_experts, COUNT(*) FROM requests WHERE {where} "
                              "GROUP BY layers, top_k, n_experts ORDER BY COUNT(*) DESC, MAX(started) DESC", args))
    for shape in [sh for sh in shapes if not _valid_shape(*sh[:3])]:  # corrupt, not another model
        for rowid, rid in _rows(conn, f"SELECT rowid, request_id FROM requests WHERE {where} AND {_SHAPE} "
                                      "ORDER BY started, rowid", [*args, *shape[:3]]):
            corrupt.add(_row_key(rowid, rid), "layers, top_k or n_experts are not sizes")
    shapes = [sh for sh in shapes if _valid_shape(*sh[:3])]
    if not shapes:
        check_model(conn, model)
    total = sum(shape[3] for shape in shapes)
    order = " ORDER BY started DESC, rowid DESC" if newest else " ORDER BY started, rowid"
    for shape in shapes:  # the next shape only when every row of this one was corrupt
        sql = f"SELECT rowid, {_ROUTED_COLUMNS} FROM requests WHERE {where} AND {_SHAPE}{order}" + \
            (" LIMIT ?" if limit is not None else "")
        rows = _rows(conn, sql, [*args, *shape[:3], *([limit] if limit is not None else [])])
        found = False
        for row in (list(rows)[::-1] if newest else rows):
            r = Routed(*row[1:])
            try:
                r.check()
            except CorruptRow as exc:
                corrupt.add(_row_key(row[0], row[1]), str(exc))
                continue
            if not found and total > shape[3]:
                corrupt.other_shapes(total - shape[3], r, partial(_other_models, conn, where, args, shape[:3]))
            found = True
            yield r
        if found:
            return


def _other_models(conn, where: str, args: list, read: tuple) -> list[tuple[str | None, int]]:
    """The models (and how many requests each) of the rows of ``where`` whose valid shape is not ``read``'s
    (layers, top_k, n_experts), most first."""
    counts: dict[str | None, int] = {}
    for *shape, name, n in _rows(conn, f"SELECT layers, top_k, n_experts, model, COUNT(*) FROM requests WHERE {where} "
                                       "GROUP BY layers, top_k, n_experts, model", args):
        if tuple(shape) != tuple(read) and _valid_shape(*shape) and (name is None or isinstance(name, str)):
            counts[name] = counts.get(name, 0) + int(n)
    return sorted(counts.items(), key=lambda mc: (-mc[1], mc[0] or ""))


def load_request(conn, request_id: str, *, layers: list[int] | None = None) -> dict[str, Any]:
    """The whole trace of one request (the `moescope trace --json` document). ``layers``: only these MoE
    layers' routing (the document's ``layers`` lists them); None: every layer.

    Each routed token's ``layers`` holds per MoE layer: ``layer``, ``experts`` (k ids; ``n_experts`` marks a
    dropped slot), ``weights``, ``entropy``, ``margin`` and ``misses`` (the slots that missed the expert cache).
    Timings are per step, once: ``steps[token["step"]]["layer_s"][str(layer)]`` = [router, experts, a2a] s."""
    cur = conn.execute("SELECT * FROM requests WHERE request_id = ?", (request_id,))
    row = cur.fetchone()
    if row is None:
        dropped = sampled_out(conn, request_id)
        if dropped is not None:
            raise BadInput(not_kept_message(request_id, *dropped))
        near = nearest_ids(conn, request_id)
        hint = f"; nearest stored ids: {', '.join(near)}" if near else "; the store holds no requests"
        raise BadInput(f"no request {request_id!r} in the trace store{hint}{_other_rank(conn, request_id)}"
                       f"{_sampling_note(conn)}")
    r = dict(zip([d[0] for d in cur.description], row))
    try:
        routed = _check_document(r)
        return _document(r, layers, routed.steps if routed is not None else None)
    except CorruptRow as exc:
        raise BadInput(f"request {request_id!r}: corrupt row: {exc}") from None
    except BadInput:  # a layer the trace does not hold
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):  # what the checks do not foresee
        raise BadInput(f"request {request_id!r}: its stored columns do not decode (corrupt row)") from None


def _sampling_note(conn) -> str:
    """What the error of an unknown id adds when the store's writer samples: the id may be of a request that
    ended moments ago (rows are written within about a second), or one sampled out before the latest ones it
    remembers."""
    try:
        row = conn.execute("SELECT MIN(sample), COUNT(*) FROM sampled_out").fetchone()
    except Exception:  # noqa: BLE001 (no such table: nothing to add)
        return ""
    if not row or not row[1] or not _is_num(row[0]):
        return ""
    return (f" (the store keeps a sample of requests, MOESCOPE_TRACE_SAMPLE={row[0]:g}, and remembers the ids of "
            f"the latest {row[1]} it did not keep; a request that just ended is written within about a second)")


def _launch_ranks(conn, request_id: str, sample: int = 20) -> int | None:
    """How many ranks the launch had that wrote the stored requests ``request_id`` would be among (None: one
    rank, or not known): the requests whose id shares its launch prefix (a multi-rank launch's ids are
    ``<launch>-<index>`` on every rank), else the newest ones. Only expert-parallel ranks record their wait on
    each peer (``peer_wait``, one number per rank), so a step that holds one tells the world size."""
    launch, dash, _ = request_id.rpartition("-")
    queries = [("SELECT steps FROM requests ORDER BY started DESC LIMIT ?", [sample])]
    if dash:  # the same launch's ids first: a range of the primary key, not a scan
        prefix = launch + dash
        queries.insert(0, ("SELECT steps FROM requests WHERE request_id >= ? AND request_id < ? LIMIT ?",
                           [prefix, prefix + "\U0010ffff", sample]))
    for sql, args in queries:
        rows = list(_rows(conn, sql, args))
        for (steps,) in rows:
            if not (isinstance(steps, str) and '"peer_wait"' in steps):
                continue
            try:
                waits = [v for st in json.loads(steps) if isinstance(st, dict)
                         for v in (st.get("peer_wait") or {}).values()]
            except (ValueError, AttributeError):  # a corrupt row: judged by the next
                continue
            world = max((len(v) for v in waits if isinstance(v, list)), default=0)
            if world > 1:
                return world
        if rows:
            return None
    return None


def _other_rank(conn, request_id: str) -> str:
    """What the error of an id a SQLite store lacks adds when a multi-rank launch wrote the store: the id may be
    another rank's, which only a lake stores (a lake holds every rank's requests: nothing to add)."""
    if not isinstance(conn, sqlite3.Connection):
        return ""
    world = _launch_ranks(conn, request_id)
    if world is None:
        return ""
    return (f"; it may be another rank's: this store was written by a {world}-rank launch, and a SQLite store holds "
            "rank 0's requests only (--traces DIR/, a trace lake, stores every rank's)")


def _check_document(r: dict) -> Routed | None:
    """``CorruptRow`` unless the columns of ``trace``'s document decode: the listing's columns, the routing's
    (as ``Routed.check``), and the per-token arrays only the document reads. Returns the checked routing (its
    decoded steps serve the document), None for a request without routing."""
    _row(tuple(r[c.strip()] for c in LIST_COLUMNS.split(",")))
    n_routed = routed_rows(r["n_prompt"], r["n_output"], r["finish_reason"])
    _check(_is_blob(r["latencies"], (4 * r["n_output"],), nullable=False), "latencies do not match the token "
           "counts")
    if r["ids"] is None:
        _check(r["layers"] in (None, "[]"), "layers without routing")
        return None
    routed = Routed(*(r[c.strip()] for c in _ROUTED_COLUMNS.split(",")))
    routed.check()
    cells = n_routed * len(json.loads(r["layers"]))
    _check(_is_blob(r["weights"], (2 * cells * r["top_k"],)), "weights do not match the token counts")
    _check(_is_blob(r["margin"], (2 * cells,)), "margins do not match the token counts")
    return routed


def select_layers(stored: list[int], wanted: list[int] | None, where: str = "in this trace") -> list[int]:
    """Indices into ``stored`` of the ``wanted`` layers (every one for None); BadInput names what is stored."""
    if wanted is None:
        return list(range(len(stored)))
    missing = sorted(set(wanted) - set(stored))
    if missing and stored:
        raise BadInput(f"no MoE layer {', '.join(map(str, missing))} {where} (layers {stored[0]}-{stored[-1]})")
    return [stored.index(layer) for layer in sorted(set(wanted)) if layer in stored]


def _flag_slow(out_tokens: list[dict], lat: list[float], n_prompt: int) -> None:
    """Flag "slow" the output tokens (after the first) whose latency is over 3x the request's median."""
    lat_sorted = sorted(lat)
    if not lat_sorted:
        return
    median = lat_sorted[len(lat_sorted) // 2]
    for e in out_tokens:
        if e["latency_s"] is not None and median > 0 and e["latency_s"] > 3 * median and e["index"] > n_prompt:
            e["flags"].append("slow")


def _document(r: dict, wanted: list[int] | None = None, steps: list[dict] | None = None) -> dict[str, Any]:
    n_prompt, n_output = r["n_prompt"], r["n_output"]
    tokens = _ints(r["tokens"], n_prompt + n_output).tolist()
    lat = np.frombuffer(r["latencies"], dtype=np.float32).tolist()
    stored = json.loads(r["layers"] or "[]")
    sel = select_layers(stored, wanted)
    layers = [stored[j] for j in sel]
    n_l, k = len(stored), r["top_k"] or 0
    n_routed = routed_rows(n_prompt, n_output, r["finish_reason"])
    ids = _arr(r["ids"], np.int16, (n_routed, n_l, k))
    ent = _arr(r["entropy"], np.float16, (n_routed, n_l)).astype(np.float64)
    miss = _arr(r["miss"], np.uint8, (n_routed, n_l))
    step = _ints(r["step"], n_routed).tolist()
    steps = json.loads(r["steps"] or "[]") if steps is None else steps
    # Flags judge every stored layer; the entries hold the selected ones. Whole arrays become lists at once:
    # at 58 layers x 300 tokens a Python loop per number would cost a second.
    nonfinite = nonfinite_cells(ent, steps, np.asarray(step, dtype=np.int64)).any(1).tolist()
    dropped = (ids == r["n_experts"]).any((1, 2)).tolist()
    missed = miss.any(1).tolist()
    ids_l = ids[:, sel].tolist()
    w_l = np.round(_arr(r["weights"], np.float16, (n_routed, n_l, k))[:, sel].astype(np.float64), 4).tolist()
    ent_l = np.round(ent[:, sel], 4).tolist()
    mar_l = np.round(_arr(r["margin"], np.float16, (n_routed, n_l))[:, sel].astype(np.float64), 4).tolist()
    miss_l = miss[:, sel].tolist()
    misses = [[s for s in range(k) if (m >> s) & 1] for m in range(256)]  # bitmask -> slots
    out_tokens = []
    for i, tok in enumerate(tokens):
        phase = "prefill" if i < n_prompt else "decode"
        entry: dict[str, Any] = {"index": i, "phase": phase, "token": tok, "text": tokenizer.token_text(tok),
                                 "latency_s": lat[i - n_prompt] if i >= n_prompt else None, "flags": [],
                                 "layers": []}
        if i < n_routed:
            entry["step"] = step[i]
            e_i, w_i, h_i, m_i, x_i = ids_l[i], w_l[i], ent_l[i], mar_l[i], miss_l[i]
            entry["layers"] = [{"layer": layer, "experts": e_i[j], "weights": w_i[j], "entropy": h_i[j],
                                "margin": m_i[j], "misses": misses[x_i[j]]} for j, layer in enumerate(layers)]
            if nonfinite[i]:
                entry["flags"].append("nonfinite")
            if dropped[i]:
                entry["flags"].append("dropped")
            if missed[i]:
                entry["flags"].append("cache_miss")
        out_tokens.append(entry)
    _flag_slow(out_tokens, lat, n_prompt)
    return {
        "request_id": r["request_id"], "started": r["started"], "model": r["model"], "rank": r["rank"],
        "domain": r["domain"], "tenant": r["tenant"], "prompt": r["prompt"], "output": r["output"],
        "timings": {"queue_s": r["queue_s"], "prefill_s": r["prefill_s"], "ttft_s": r["ttft_s"],
                    "total_s": r["total_s"]},
        "flags": [f for f in (r["flags"] or "").split(",") if f], "finish_reason": r["finish_reason"],
        "trace_id": r["trace_id"], "n_experts": r["n_experts"], "top_k": k, "layers": layers,
        "steps": steps, "tokens": out_tokens,
    }


def enforce_retention(conn, max_bytes: int) -> int:
    """Delete the oldest requests until the database fits ``max_bytes``; returns how many were deleted."""
    page = conn.execute("PRAGMA page_size").fetchone()[0]

    def used() -> int:
        count = conn.execute("PRAGMA page_count").fetchone()[0]
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
        return (count - free) * page

    deleted = 0
    while used() > max_bytes:
        n = conn.execute("SELECT COUNT(*) FROM requests").fetchone()[0]
        if n == 0:
            break
        batch = max(1, n // 10)
        conn.execute("DELETE FROM requests WHERE request_id IN (SELECT request_id FROM requests ORDER BY started "
                      "LIMIT ?)", (batch,))
        deleted += batch
        conn.commit()
    if deleted:
        conn.execute("PRAGMA incremental_vacuum")
        conn.commit()
    return deleted


def now() -> float:
    return time.time()
