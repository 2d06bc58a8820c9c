"""The layering contracts in pyproject.toml ([tool.importlinter]) hold on the tree, and they can fail: the same
contracts on a copy of the package with one forbidden import added (a probe importing the metrics sink) break."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = str(Path(sys.executable).with_name("lint-imports"))


def _lint(src: Path, cwd: Path):
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([LINT, "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_tree_keeps_its_layering():
    run = _lint(ROOT, ROOT)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "0 broken" in run.stdout


def test_a_forbidden_import_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "moescope", tmp_path / "moescope", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "moescope" / "capture" / "leaky.py").write_text("from moescope.metrics import state  # noqa\n")
    run = _lint(tmp_path, tmp_path)
    assert run.returncode != 0
    assert "moescope.capture is not allowed to import moescope.metrics" in run.stdout, run.stdout[-3000:]
    assert "moescope.capture.leaky -> moescope.metrics.state" in run.stdout


def test_module_names_are_unique_within_the_package():
    """[contract] 5: a module's file name says which module it is (``from moescope.x import config`` and
    ``from moescope.y import config`` in one file were two different things); ``__init__``/``__main__`` aside.
    The reference is a plain walk of the tree, not the package's own listing."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "moescope").rglob("*.py")):
        if path.stem not in ("__init__", "__main__"):
            seen.setdefault(path.stem, []).append(str(path.relative_to(ROOT)))
    repeated = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not repeated, f"module names used more than once: {repeated}"
