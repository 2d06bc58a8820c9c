import json
import os
from pathlib import Path

import pytest

from helpers import run_cli
from moescope.cli import main
from moescope.runtime import weights


def test_demo_json_summary(capsys):
    rc = main(["demo", "--no-tui", "--requests", "6", "--rate", "0", "--metrics-port", "0", "--json"])
    assert rc == 0
    s = json.loads(capsys.readouterr().out)
    assert s["completed"] == s["requests"] == 6
    assert len(set(s["request_ids"])) == 6
    assert s["tokens"]["output"] == sum(r["output_tokens"] for r in s["requests_detail"])
    # Expert load per MoE layer: every computed slot is counted, k slots per token.
    cfg = weights.read_config(weights.DEMO_WEIGHTS)
    n_tokens_run = s["tokens"]["prompt"] + s["tokens"]["output"] - s["completed"]
    assert set(s["expert_load"]) == {str(i) for i in cfg.moe_layers}
    for counts in s["expert_load"].values():
        assert len(counts) == cfg.n_experts
        assert sum(counts) == cfg.top_k * n_tokens_run


@pytest.mark.parametrize("argv,needle", [
    (["demo", "--requests", "0"], "--requests"),
    (["demo", "--bogus"], "No such option"),
    (["demo", "--model", "nope"], "neither a preset"),
    (["demo", "--weights", "/nonexistent.safetensors"], "does not exist"),
    (["demo", "--device", "cuda:0"], None),
    (["demo", "--rate", "-1"], "--rate"),
    (["demo", "--rebalance-steps", "5"], "needs --world-size > 1"),
    (["demo", "--rebalance-below", "0.9"], "give it too"),
    (["demo", "--world-size", "2", "--rebalance-steps", "5", "--rebalance-slots", "2"], "cannot hold 8 experts"),
    (["requests", "--traces", "/nonexistent-lake/"], "does not exist"),
    (["serve", "--port", "0", "--world-size", "2", "--slow-rank", "2"], "is not a rank of world size 2"),
    (["serve", "--port", "0", "--scenario", "drift"], "needs the demo's synthetic traffic"),
])
def test_bad_input_is_one_line_exit_2(argv, needle, capsys):
    import torch

    if argv[-1].startswith("cuda") and torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moescope: error:")
    assert "Traceback" not in err
    if needle:
        assert needle in err


def test_console_entry_points_bad_config(tmp_path):
    bad = tmp_path / "k.yaml"
    bad.write_text("preset: tiny-demo\ntop_k: 9\n")
    proc = run_cli("demo", "--model", str(bad), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "moescope: error: top_k (9) must be <= n_experts (8)"


def test_corrupt_weights_file(tmp_path):
    bad = tmp_path / "w.safetensors"
    bad.write_bytes(b"\x00garbage")
    assert main(["demo", "--weights", str(bad), "--requests", "1"]) == 2


def test_check_determinism_passes_healthy_and_fails_jitter(capsys):
    assert main(["check", "determinism", "--runs", "3", "--json"]) == 0
    ok = json.loads(capsys.readouterr().out)
    assert ok["passed"] and all(v == 0.0 for v in ok["flip_rate"].values()) and not ok["flipped"]
    assert main(["check", "determinism", "--runs", "3", "--scenario", "jitter", "--json"]) == 1
    captured = capsys.readouterr()
    bad = json.loads(captured.out)
    assert not bad["passed"] and max(bad["flip_rate"].values()) > 0.01
    # The examples are real flips: before and after differ.
    assert bad["flipped"] and all(f["before"] != f["after"] for f in bad["flipped"])
    assert captured.err.startswith("moescope: error: routing is not deterministic")


def test_group_config_that_cannot_split_experts_is_one_line(tmp_path):
    bad = tmp_path / "g.yaml"
    bad.write_text("n_experts: 256\ntop_k: 8\nn_group: 3\n")
    proc = run_cli("demo", "--model", str(bad), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "moescope: error: n_experts (256) must be divisible by n_group (3)"


def test_triton_router_request_on_a_sigmoid_model_is_a_notice(capsys, monkeypatch):
    from moescope.runtime.model_config import PRESETS
    from moescope.runtime.model import MoETransformer

    cfg = PRESETS["deepseek-v3-shape"].replace(n_layers=4, dense_layers=(0,))
    model = MoETransformer(cfg)
    notice = model.set_router_impl("triton")
    assert notice.startswith("note: the Triton router implements softmax top-k only") and "\n" not in notice
    assert all(m.router.impl == "triton" and not m.router.kernel_supported for m in model.moe_layers())
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernel on a CPU: Triton's interpreter
    assert MoETransformer(PRESETS["qwen3-moe-shape"].replace(n_layers=2)).set_router_impl("triton") is None


def test_triton_router_asked_for_where_it_cannot_run_is_one_line():
    """docs/runtime.md's `demo --router-impl triton` on a CPU without Triton's interpreter: one line naming why and
    what runs it, exit 2 (it was Triton's own traceback, "0 active drivers")."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = run_cli("demo", "--no-tui", "--router-impl", "triton", "--requests", "1", "--metrics-port", "-1",
                   "--traces", "none", timeout=120, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "moescope: error: --router-impl triton runs the fused kernel on a CUDA device (the model is on cpu); on a CPU "
        "only under Triton's interpreter, TRITON_INTERPRET=1 (slow: for checks)"]


def test_option_groups_hand_a_command_frozen_typed_objects():
    """The model and instrumentation flags reach a command as one frozen object each, parsed once by click (the
    dataclass's fields are the options' parameter names: a field without its option fails here)."""
    import dataclasses

    import click
    from click.testing import CliRunner

    from moescope.cli.config_options import InstrumentOptions, ModelOptions, instrument_options, model_options

    seen = {}

    @click.command()
    @model_options
    @instrument_options
    def cmd(model, instrument):
        seen.update(model=model, instrument=instrument)

    result = CliRunner().invoke(cmd, ["--model", "deepseek-v3-shape", "--seed", "3", "--cache-size", "4",
                                      "--scenario", "hot, drop=0.8"], standalone_mode=False)
    assert result.exception is None, result.output
    assert seen["model"] == ModelOptions("deepseek-v3-shape", "auto", "auto", "float32", None, 16, 3)
    assert isinstance(seen["instrument"], InstrumentOptions) and seen["instrument"].cache_size == 4
    assert seen["instrument"].scenarios == ("hot", "drop=0.8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        seen["model"].seed = 1


@pytest.mark.parametrize("command", ["demo", "serve"])
def test_a_taken_metrics_port_names_the_flag(command, capsys):
    """The exporter's port is in use: one line, exit 2, naming the option that chose it (the library's own error
    names no flag)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["--requests", "1", "--rate", "0", "--no-tui"] if command == "demo" else ["--port", "0"]
        assert main([command, *argv, "--metrics-port", str(port), "--traces", "none"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"moescope: error: cannot serve metrics on 127.0.0.1:{port}")
    assert "pick another --metrics-port" in err


def test_train_demo_writes_a_user_file_not_the_bundled_model(tmp_path, monkeypatch, capsys):
    """The documented `moescope train-demo` line (no --out) leaves the package's bundled model alone: it writes
    under the user's data directory and says how to use the file. (The training itself is stubbed: minutes.)"""
    from moescope.runtime import train

    written = []

    def fake_main(out, cfg, *, log):
        written.append(Path(out))
        return {"specialisation": {"mean_pairwise_jsd_bits": {"1": 0.5}}}

    monkeypatch.setattr(train, "main", fake_main)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert main(["train-demo", "--steps", "1"]) == 0
    assert written == [tmp_path / "data" / "moescope" / "tiny-demo.safetensors"]
    assert written[0].parent.is_dir() and weights.ASSETS not in written[0].parents
    assert f"--weights {written[0]}" in capsys.readouterr().out
    assert main(["train-demo", "--out", str(tmp_path / "mine.safetensors")]) == 0  # an explicit --out is kept
    assert written[-1] == tmp_path / "mine.safetensors"
