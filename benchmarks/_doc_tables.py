"""Tables in the docs printed from results files, never typed by hand.

A docs page holds a block

    <!-- table: benchmarks/X.py --markdown benchmarks/results/Y.json -->
    ...
    <!-- /table -->

whose body is exactly what that command prints (run from the repository root with this Python).
``python benchmarks/_doc_tables.py`` rewrites every block; ``--check`` exits 1 naming the blocks that differ
(tests/test_docs.py runs it).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- table: (?P<cmd>[^>]+?) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def render(cmd: str) -> str:
    argv = cmd.split()
    if not argv or not argv[0].startswith("benchmarks/") or "--markdown" not in argv:
        raise SystemExit(f"doc table command must be `benchmarks/X.py --markdown RESULTS`: {cmd!r}")
    out = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return out if out.endswith("\n") else out + "\n"


def blocks(text: str):
    return list(BLOCK.finditer(text))


def main() -> int:
    check = "--check" in sys.argv[1:]
    stale = []
    for page in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        text = page.read_text()
        new = BLOCK.sub(lambda m: m.group(1) + render(m.group("cmd")) + m.group(4), text)
        if new != text:
            stale.append(str(page.relative_to(ROOT)))
            if not check:
                page.write_text(new)
    if check and stale:
        print(f"tables out of date with their results files in: {', '.join(stale)} "
              "(python benchmarks/_doc_tables.py rewrites them)", file=sys.stderr)
        return 1
    if not check:
        print(f"rewrote {len(stale)} page(s)" + (f": {', '.join(stale)}" if stale else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
