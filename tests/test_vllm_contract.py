"""What the plugin relies on of vLLM (``moescope.vllm.contract.USES``: both model runners' seams, Model Runner V2's
included, the scheduler's output, the routers' capture slot) exists in every release ``SUPPORTED`` lists: the
installed CPU builds (``.vllm``: 0.32, ``.vllm031``: 0.31) and vLLM 0.33.0's GPU build, whose wheel ``make
vllm-src`` downloads without its dependencies and unpacks (its Python files only: read with ``ast``, never
imported). Model Runner V2 needs Triton, which the CPU build's environment lacks; ``tests/test_vllm.py`` runs it
for real through Triton's interpreter (``tests/mrv2/``), and this test covers it on the releases that do not run
here.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from moescope.vllm import contract
from moescope.vllm.plugin import SUPPORTED

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.vllm


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, timeout=60, check=True)
    return Path(out.stdout.strip())


def _version(src: Path) -> str:
    import re

    text = (src / "vllm" / "_version.py").read_text()
    m = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text)
    assert m, f"no version in {src}/vllm/_version.py"
    return m.group(1)


def _trees() -> dict[str, Path]:
    """Each vLLM source tree there is to check: release -> folder holding ``vllm/``."""
    found = {}
    for env in (".vllm", ".vllm031"):
        python = ROOT / env / "bin" / "python"
        if python.exists():
            src = _site_packages(python)
            found[_version(src)] = src
    src = ROOT / "build" / "vllm-src" / "vllm-0.33.0"
    if (src / "vllm").is_dir():
        found[_version(src)] = src
    return found


EXPECTED = ("0.31.0", "0.32.0", "0.33.0")  # the releases `make test` checks: two CPU builds, the GPU build's source


def test_every_supported_release_has_what_the_plugin_uses():
    trees = _trees()
    missing = [v for v in EXPECTED if v not in trees]
    if missing and os.environ.get("CI") == "true":
        pytest.fail(f"vLLM source trees missing in CI: {missing} (make vllm-env vllm-src)")
    if len(missing) == len(EXPECTED):
        pytest.skip("no vLLM source tree here (make vllm-env vllm-src)")
    for version, src in sorted(trees.items()):
        assert contract.check(src) == [], version
    # SUPPORTED names exactly the release lines checked here
    assert sorted(SUPPORTED) == sorted({".".join(v.split(".")[:2]) + "." for v in EXPECTED})


def test_the_check_finds_what_a_release_lacks(tmp_path):
    """The check can fail: a renamed attribute, a dropped parameter, a missing class or module are each named."""
    trees = _trees()
    if not trees:
        pytest.skip("no vLLM source tree here")
    src = next(iter(trees.values()))
    uses = (contract.Use("vllm.v1.core.sched.output", "SchedulerOutput", attrs=("total_num_scheduled_tokens_v9",)),
            contract.Use("vllm.v1.worker.gpu.model_runner", "GPUModelRunner",
                         methods=(("execute_model", ("scheduler_output", "no_such_kwarg")),)),
            contract.Use("vllm.v1.worker.gpu.model_runner", "NoSuchRunner"),
            contract.Use("vllm.v1.worker.no_such_module", "X"),
            contract.Use("vllm.v1.worker.gpu.model_runner", None, functions=(("sort_batch_req_ids", ("draft",)),)))
    problems = contract.check(src, uses)
    assert len(problems) == 5, problems
    for needle in ("total_num_scheduled_tokens_v9", "no_such_kwarg", "NoSuchRunner", "no_such_module",
                   "sort_batch_req_ids"):
        assert any(needle in p for p in problems), (needle, problems)
