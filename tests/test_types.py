"""The static type check `make lint` runs (mypy, [tool.mypy] in pyproject.toml) passes over the observer seam, the
assembly point, the metrics and the vLLM plugin, and it can fail: a planted observer whose hook takes the wrong
payload, and a hook called with one, are reported. Its silences are targeted: no ``ignore_errors``, and every
``# type: ignore`` in the checked paths names its error code and says why."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MYPY = [sys.executable, "-m", "mypy"]
CHECKED = ["moescope/capture", "moescope/api.py", "moescope/metrics", "moescope/vllm"]


def _config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]


def test_make_lint_runs_mypy_over_the_four_paths():
    recipe = re.search(r"^lint:.*?\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert "$(BIN)/mypy" in recipe
    assert _config()["files"] == CHECKED


def test_the_tree_passes_and_a_wrong_payload_is_reported(tmp_path):
    run = subprocess.run(MYPY, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "Success: no issues found" in run.stdout
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from moescope.capture.observer import FanOut, Observer\n"
        "\n"
        "\n"
        "class Wrong(Observer):\n"
        "    def on_step(self, step: int) -> None:  # a StepRecord, the seam says\n"
        "        pass\n"
        "\n"
        "\n"
        "FanOut([Wrong()]).on_request('r1')  # a RequestRecord, the seam says\n")
    run = subprocess.run([*MYPY, "--config-file", str(ROOT / "pyproject.toml"), str(planted)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 1, run.stdout[-3000:]
    assert re.search(r"planted\.py:5: error: .*on_step.*incompatible with supertype.*\[override\]", run.stdout)
    assert re.search(r"planted\.py:9: error: .*\"on_request\".*\"RequestRecord\".*\[arg-type\]", run.stdout)


def test_silences_are_targeted_and_say_why():
    config = _config()
    assert "ignore_errors" not in config
    assert not any("ignore_errors" in o for o in config.get("overrides", []))
    bare = []
    for base in CHECKED:
        path = ROOT / base
        for file in [path] if path.is_file() else sorted(path.rglob("*.py")):
            lines = file.read_text().splitlines()
            for i, line in enumerate(lines):
                if "type: ignore" not in line:
                    continue
                coded = re.search(r"type: ignore\[[a-z-]+(, [a-z-]+)*\]", line)
                reason = re.search(r"type: ignore\[[^]]*\]\s+#\s*\S", line) or lines[i - 1].strip().startswith("#")
                if not (coded and reason):
                    bare.append(f"{file.relative_to(ROOT)}:{i + 1}: {line.strip()}")
    assert not bare, bare
