"""``moescope traces convert``: a SQLite trace store copied into a Parquet trace lake.

The one piece of the traces package that needs both stores: it reads the SQLite file through ``store.open_store``
and writes with ``lake.LakeWriter``. Here rather than in ``lake``, which ``store.open_store`` imports to open a
lake: ``lake`` imports nothing of ``store`` (the import-linter contract "the trace lake never imports the trace
store" in pyproject.toml).
"""

from __future__ import annotations

import uuid
from pathlib import Path

from moescope.traces import lake, store


def sqlite_to_lake(src: str | Path, dst: str | Path, *, batch: int = 256) -> tuple[int, int]:
    """Copy a SQLite store's requests into a lake (one rolled file per partition and model); returns (requests,
    files). Rows are read in batches of ``batch``; the source is only read."""
    conn = store.open_store(src)
    cols = [name for name, _ in lake._COLUMNS]
    writers: dict[tuple[str | None, int], lake.LakeWriter] = {}
    n = 0
    try:
        cur = conn.execute(f"SELECT {', '.join(cols)} FROM requests ORDER BY started")
        while chunk := cur.fetchmany(batch):
            rows = [dict(zip(cols, r)) for r in chunk]
            by_writer: dict[tuple, list] = {}
            for r in rows:
                by_writer.setdefault((r["model"], r["rank"] or 0), []).append(r)
            for (model, rank), part in by_writer.items():
                if (model, rank) not in writers:
                    writers[model, rank] = lake.LakeWriter(dst, model=model, rank=rank, run_id=uuid.uuid4().hex[:12],
                                                           roll_s=float("inf"), replica=f"{Path(src).stem}-r{rank}")
                writers[model, rank].write(part)
            n += len(rows)
    finally:
        conn.close()
    for w in writers.values():
        w.close()
    return n, len(lake.data_files(str(dst)))
