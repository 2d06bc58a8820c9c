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
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from moescope.errors import BadInput

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
                                    --        t (unix s), rss (bytes), peer_wait: {layer: [s per peer]}}]
);
CREATE INDEX IF NOT EXISTS requests_started ON requests(started);
CREATE INDEX IF NOT EXISTS requests_total ON requests(total_s);
"""


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


def open_store(path: str | Path, *, create: bool = False) -> sqlite3.Connection:
    """Open (or create) a store and check its schema version."""
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
    return RequestRow(r[0], r[1], r[2], r[3], r[4], r[5], tuple(f for f in (r[6] or "").split(",") if f), r[7], r[8])


def list_requests(conn, *, flag: list[str] | None = None, since: float | None = None, slowest: int | None = None,
                  limit: int = 50) -> list[RequestRow]:
    where, args = [], []
    for f in flag or []:
        where.append("(',' || flags || ',') LIKE ?")
        args.append(f"%,{f},%")
    if since is not None:
        where.append("started >= ?")
        args.append(since)
    sql = f"SELECT {LIST_COLUMNS} FROM requests"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY total_s DESC" if slowest else " ORDER BY started DESC"
    sql += " LIMIT ?"
    args.append(slowest or limit)
    return [_row(r) for r in conn.execute(sql, args)]


def nearest_ids(conn, request_id: str, n: int = 3) -> list[str]:
    """Stored ids closest to ``request_id`` (shared prefix first, then edit similarity)."""
    import difflib

    ids = [r[0] for r in conn.execute("SELECT request_id FROM requests ORDER BY started DESC LIMIT 5000")]
    return difflib.get_close_matches(request_id, ids, n=n, cutoff=0.0)[:n]


def _arr(blob, dtype, shape) -> np.ndarray:
    return np.frombuffer(blob, dtype=dtype).reshape(shape) if blob is not None else np.zeros(shape, dtype)


def _ints(blob, n: int) -> np.ndarray:
    """An integer array stored as uint16 or int32: the blob's length tells which."""
    if blob is None or n == 0:
        return np.zeros(n, dtype=np.int64)
    return np.frombuffer(blob, dtype=np.uint16 if len(blob) == 2 * n else np.int32).astype(np.int64)


_ROUTED_COLUMNS = ("request_id, started, model, domain, tenant, n_prompt, n_output, layers, top_k, n_experts, "
                   "ids, tokens, entropy, miss, step, steps")


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

    @property
    def n_routed(self) -> int:
        return self.n_prompt + max(0, self.n_output - 1)

    @cached_property
    def layers(self) -> list[int]:
        return json.loads(self.layers_json)

    @cached_property
    def ids(self) -> np.ndarray:
        """[n_routed, layers, k] int16 experts; the sentinel ``n_experts`` marks a dropped slot."""
        try:
            return np.frombuffer(self.ids_blob, dtype=np.int16).reshape(self.n_routed, len(self.layers),
                                                                        self.top_k)
        except ValueError:
            raise BadInput(f"request {self.request_id!r}: its stored routing does not match its token counts "
                           "(corrupt row)") from None

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
    def steps(self) -> list[dict]:
        return json.loads(self.steps_json or "[]")


def iter_routed(conn, *, since: float | None = None, limit: int | None = None,
                newest: bool = False) -> Iterator[Routed]:
    """The stored requests that carry routing, oldest first; ``since``: started at or after; ``limit``: at most
    that many, the oldest (or with ``newest`` the newest, still yielded oldest first)."""
    sql = f"SELECT {_ROUTED_COLUMNS} FROM requests WHERE ids IS NOT NULL"
    args: list = []
    if since is not None:
        sql += " AND started >= ?"
        args.append(since)
    sql += " ORDER BY started DESC, rowid DESC" if newest else " ORDER BY started, rowid"
    if limit is not None:
        sql += " LIMIT ?"
        args.append(limit)
    rows = conn.execute(sql, args)
    for row in (list(rows)[::-1] if newest else rows):
        yield Routed(*row)


def load_request(conn, request_id: str) -> dict[str, Any]:
    """The whole trace of one request (the `moescope trace --json` document, before sanitising)."""
    cur = conn.execute("SELECT * FROM requests WHERE request_id = ?", (request_id,))
    row = cur.fetchone()
    if row is None:
        near = nearest_ids(conn, request_id)
        hint = f"; nearest stored ids: {', '.join(near)}" if near else "; the store holds no requests"
        raise BadInput(f"no request {request_id!r} in the trace store{hint}")
    r = dict(zip([d[0] for d in cur.description], row))
    try:
        return _document(r)
    except ValueError:  # arrays whose sizes disagree with the token counts: a row no writer of ours makes
        raise BadInput(f"request {request_id!r}: its stored arrays do not match its token counts (corrupt row)") \
            from None


def _document(r: dict) -> dict[str, Any]:
    from moescope.runtime import tokenizer

    n_prompt, n_output = r["n_prompt"], r["n_output"]
    tokens = _ints(r["tokens"], n_prompt + n_output).tolist()
    lat = np.frombuffer(r["latencies"], dtype=np.float32).tolist()
    layers = json.loads(r["layers"] or "[]")
    n_l, k = len(layers), r["top_k"] or 0
    n_routed = n_prompt + max(0, n_output - 1)
    ids = _arr(r["ids"], np.int16, (n_routed, n_l, k))
    weights = _arr(r["weights"], np.float16, (n_routed, n_l, k))
    ent = _arr(r["entropy"], np.float16, (n_routed, n_l))
    mar = _arr(r["margin"], np.float16, (n_routed, n_l))
    miss = _arr(r["miss"], np.uint8, (n_routed, n_l))
    step = _ints(r["step"], n_routed)
    steps = json.loads(r["steps"] or "[]")
    out_tokens = []
    for i, tok in enumerate(tokens):
        phase = "prefill" if i < n_prompt else "decode"
        entry: dict[str, Any] = {"index": i, "phase": phase, "token": tok, "text": tokenizer.token_text(tok),
                                 "latency_s": lat[i - n_prompt] if i >= n_prompt else None, "flags": [],
                                 "layers": []}
        if i < n_routed:
            st = steps[int(step[i])] if steps else {}
            entry["step"] = int(step[i])
            for j, layer in enumerate(layers):
                e_ids = ids[i, j].tolist()
                ls = (st.get("layer_s") or {}).get(str(layer), [None, None, None])
                entry["layers"].append({
                    "layer": layer, "experts": e_ids, "weights": [round(float(w), 4) for w in weights[i, j]],
                    "entropy": float(ent[i, j]), "margin": float(mar[i, j]),
                    "cache": ["miss" if (int(miss[i, j]) >> s) & 1 else "hit" for s in range(k)],
                    "dropped": [e == r["n_experts"] for e in e_ids],
                    "router_s": ls[0], "expert_s": ls[1], "all_to_all_s": ls[2], "rank": r["rank"]})
            if any(not np.isfinite(float(ent[i, j])) for j in range(n_l)):
                entry["flags"].append("nonfinite")
            if any(d for lay in entry["layers"] for d in lay["dropped"]):
                entry["flags"].append("dropped")
            if int(miss[i].any()):
                entry["flags"].append("cache_miss")
        out_tokens.append(entry)
    lat_sorted = sorted(lat)
    if lat_sorted:
        median = lat_sorted[len(lat_sorted) // 2]
        for e in out_tokens:
            if e["latency_s"] is not None and median > 0 and e["latency_s"] > 3 * median and e["index"] > n_prompt:
                e["flags"].append("slow")
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
