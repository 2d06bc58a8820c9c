"""Text by domain, from what every machine with Python has (no downloads), deterministic for a seed.

- code: the standard library's Python sources with docstrings removed;
- prose: the standard library's docstrings (doctest examples removed);
- numbers: generated tables, timestamps, arithmetic and measurements;
- unicode: generated multilingual text and emoji.

The demo model trains on the first 90% of each domain; the traffic generator samples prompts from the
last 10%, so served prompts are text the model has not memorised.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import random
import sys
import sysconfig
from pathlib import Path

from moescope import user_cache

DOMAINS = ("code", "prose", "numbers", "unicode")
HELD_OUT = 0.10


def _stdlib_files(limit_bytes: int) -> list[tuple[Path, int, int]]:
    """The standard library's first modules up to ``limit_bytes``: (path, size, modification time in ns)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            st = path.stat()
        except OSError:
            continue
        files.append((path, st.st_size, st.st_mtime_ns))
        total += st.st_size
        if total > limit_bytes:
            break
    return files


def _docstring_lines(tree: ast.AST) -> tuple[list[str], set[int]]:
    """Docstrings of a module and its classes/functions, and the source lines they occupy."""
    docs, lines = [], set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docs.append(first.value.value)
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return docs, lines


# Bump when what _parse_stdlib makes of the same files changes: cached corpora of an older version are not reused.
CORPUS_VERSION = 1


@functools.lru_cache(maxsize=4)
def _stdlib_text(limit_bytes: int) -> tuple[str, str]:
    """(code, prose) of the standard library's first files up to ``limit_bytes``. Parsing them (``ast``) costs
    ~1 CPU-s, and every demo, serve and benchmark process generates traffic from them: the result is kept in the
    user's cache (``moescope.user_cache``, ``corpus/``) under a key of everything it is made from (this Python's
    version, the stdlib's path, each file's name, size and modification time, the limit, ``CORPUS_VERSION``), so a
    changed standard library or another Python makes a new one. A cache that cannot be read or written is only a slower
    start."""
    files = _stdlib_files(limit_bytes)
    key = [CORPUS_VERSION, sys.version, str(Path(sysconfig.get_paths()["stdlib"])), limit_bytes,
           *([path.name, size, mtime] for path, size, mtime in files)]
    where = user_cache.root() / "corpus" / f"stdlib-{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]}.json"
    try:
        doc = json.loads(where.read_bytes())
        if doc.get("key") == key:
            return doc["code"], doc["prose"]
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    code, prose = _parse_stdlib([path for path, _, _ in files])
    user_cache.write_atomic(where, json.dumps({"key": key, "code": code, "prose": prose}).encode())
    return code, prose


def _parse_stdlib(files: list[Path]) -> tuple[str, str]:
    code_parts, prose_parts = [], []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        docs, doc_lines = _docstring_lines(tree)
        code_parts.append("\n".join(line for i, line in enumerate(source.splitlines(), 1)
                                    if i not in doc_lines and line.strip()))
        for doc in docs:
            paras = [" ".join(p.split()) for p in doc.split("\n\n")]
            prose_parts.extend(p for p in paras if len(p) > 40 and ">>>" not in p)
    return "\n".join(code_parts), "\n".join(prose_parts)


def _numbers(rng: random.Random, n_chars: int) -> str:
    out, size = [], 0
    while size < n_chars:
        kind = rng.randrange(4)
        if kind == 0:
            line = (f"{rng.randint(2019, 2026)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} "
                    f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}, "
                    f"{rng.uniform(-1e4, 1e4):.2f}, {rng.gauss(0, 1):.4f}, {rng.randint(0, 99999)}")
        elif kind == 1:
            a, b = rng.randint(1, 9999), rng.randint(1, 999)
            line = f"{a} * {b} = {a * b}; {a} + {b} = {a + b}; {a} - {b} = {a - b}"
        elif kind == 2:
            line = ", ".join(f"{rng.uniform(0, 1000):.{rng.randint(0, 4)}f}" for _ in range(rng.randint(3, 9)))
        else:
            line = " ".join(f"{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(0, 255)}"
                            if rng.random() < 0.3 else f"+{rng.randint(1, 99)} {rng.randint(100, 999)} "
                            f"{rng.randint(1000000, 9999999)}" for _ in range(rng.randint(1, 4)))
        out.append(line)
        size += len(line) + 1
    return "\n".join(out)


_SCRIPTS = [(0x1F300, 0x1F5FF), (0x1F600, 0x1F64F), (0x1F680, 0x1F6FF), (0x4E00, 0x4FFF), (0x3040, 0x309F),
            (0x0410, 0x044F), (0x0391, 0x03C9), (0x05D0, 0x05EA), (0x0627, 0x064A), (0x00C0, 0x00FF)]


def _unicode(rng: random.Random, n_chars: int) -> str:
    out, size = [], 0
    while size < n_chars:
        lo, hi = rng.choice(_SCRIPTS)
        words = ["".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 6)))
                 for _ in range(rng.randint(2, 8))]
        line = " ".join(words)
        out.append(line)
        size += len(line) + 1
    return "\n".join(out)


@functools.lru_cache(maxsize=8)
def domain_text(domain: str, *, seed: int = 0, max_chars: int = 600_000) -> str:
    """All text of a domain (train and held-out parts), at most ``max_chars`` characters."""
    if domain == "code":
        return _stdlib_text(4 * max_chars)[0][:max_chars]
    if domain == "prose":
        return _stdlib_text(4 * max_chars)[1][:max_chars]
    rng = random.Random(f"{domain}:{seed}")
    if domain == "numbers":
        return _numbers(rng, max_chars)
    if domain == "unicode":
        return _unicode(rng, max_chars // 3)  # ~3 bytes per character: similar byte counts to the others
    raise ValueError(f"unknown domain {domain!r}; choose one of {', '.join(DOMAINS)}")


def split(text: str, part: str) -> str:
    """``part`` is "train" (the first 90%) or "heldout" (the rest)."""
    cut = int(len(text) * (1 - HELD_OUT))
    return text[:cut] if part == "train" else text[cut:]
