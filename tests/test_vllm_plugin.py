"""The vLLM plugin's parts that need no vLLM server: its settings, the id the client sees, the entry point, and that
it stays inert unless configured. (The real server tests: tests/test_vllm.py.)"""

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from moescope.vllm import vllm_adapter, plugin


def test_the_entry_point_is_registered_in_vllms_plugin_group():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("moescope") == "moescope.vllm:register"


@pytest.mark.parametrize("engine_id, client", [
    # completions: "cmpl-<id>-<prompt index>-<8 random>" (vllm/v1/engine/input_processor.py, completion/serving.py)
    ("cmpl-8bfe1d2fe463b768-0-1a2b3c4d", "cmpl-8bfe1d2fe463b768"),
    ("cmpl-8bfe1d2fe463b768-1-1a2b3c4d", "cmpl-8bfe1d2fe463b768-1"),
    # chat: "chatcmpl-<id>-<8 random>", a client's X-Request-Id kept whole
    ("chatcmpl-5f0e-abcd-9e8d7c6b", "chatcmpl-5f0e-abcd"),
    ("chatcmpl-my-own-id-0-0badf00d", "chatcmpl-my-own-id-0"),
    ("cmpl-my-req-0-00000000", "cmpl-my-req"),
])
def test_client_id_is_the_responses_id(engine_id, client):
    assert vllm_adapter.client_id(engine_id) == client


@pytest.mark.parametrize("env, error", [
    ({"MOESCOPE_METRICS_PORT": "abc"}, "MOESCOPE_METRICS_PORT='abc' is not an integer"),
    ({"MOESCOPE_METRICS_PORT": "70000"}, "must be 1..65535"),
    ({"MOESCOPE_TRACES": "x.sqlite", "MOESCOPE_TRACE_SAMPLE": "2"}, "within 0..1"),
    ({"MOESCOPE_WINDOW_S": "0"}, "MOESCOPE_WINDOW_S: metrics window must be > 0"),
    ({"MOESCOPE_HOT_REFERENCE": "median"}, "MOESCOPE_HOT_REFERENCE: hot reference must be"),
    ({"MOESCOPE_BASELINE": "/nonexistent/baseline.json"}, "no such file"),
])
def test_bad_settings_are_one_clear_line(env, error):
    with pytest.raises(plugin.SettingsError, match=error.replace("(", r"\(").replace(".", r"\.")):
        plugin.Settings.from_env(env)


def test_settings_defaults_and_values():
    s = plugin.Settings.from_env({"MOESCOPE_METRICS_PORT": "9500", "MOESCOPE_TRACES": "/tmp/t/",
                                  "MOESCOPE_MODEL_NAME": "m"})
    assert (s.port, s.addr, s.traces, s.sample, s.model_name, s.window_s) == (9500, "127.0.0.1", "/tmp/t/",
                                                                             plugin.DEFAULT_TRACE_SAMPLE, "m", 60.0)


def test_unconfigured_plugin_imports_nothing_heavy():
    """A plain `vllm serve` without MOESCOPE_* variables: the entry point returns at once, importing neither vLLM
    nor torch nor moescope's sinks (run in a fresh interpreter)."""
    code = ("import os, sys\n"
            "for k in list(os.environ):\n"
            "    k.startswith('MOESCOPE_') and os.environ.pop(k)\n"
            "import moescope.vllm as v; v.register()\n"
            "heavy = [m for m in ('torch', 'vllm', 'moescope.metrics', 'moescope.vllm.plugin') if m in sys.modules]\n"
            "print(heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_rank_paths_keep_every_ranks_traces_apart(tmp_path):
    settings = plugin.Settings.from_env({"MOESCOPE_TRACES": str(tmp_path / "t.sqlite"),
                                         "MOESCOPE_METRICS_PORT": "9500"})
    assert settings.config(0).traces.path == str(tmp_path / "t.sqlite")
    assert settings.config(1).traces.path == str(tmp_path / "t.rank1.sqlite")
    assert (settings.config(0).metrics.port, settings.config(3).metrics.port) == (9500, 9503)
    lake = tmp_path / "lake"
    lake.mkdir()
    assert plugin.Settings.from_env({"MOESCOPE_TRACES": str(lake)}).config(1).traces.path == str(lake)


def test_a_bad_setting_turns_the_plugin_off_with_one_line():
    """What vLLM's plugin loader runs, in a fresh interpreter: a setting that does not parse is one warning naming
    it, nothing raised, vLLM not even imported (its server then starts as without moescope)."""
    code = ("import os, sys\n"
            "os.environ['MOESCOPE_METRICS_PORT'] = 'not-a-port'\n"
            "import moescope.vllm as v; v.register()\n"
            "print('vllm' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", (out.stdout, out.stderr)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines == ["moescope: off: MOESCOPE_METRICS_PORT='not-a-port' is not an integer"], lines


def test_the_attention_shape_of_a_config_is_what_a_step_reads_and_computes():
    """Per position: K and V of every KV head of every layer (GQA: 1 KV head of 2 query heads here); per attended
    position: q.k and p.v over every query head; an MLA model caches its latent and rope key (FLOPs unknown)."""
    from types import SimpleNamespace

    from moescope.vllm.vllm_adapter import attention_shape

    gqa = SimpleNamespace(num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                          hidden_size=96)  # head_dim given: not hidden / heads
    assert attention_shape(gqa) == (4 * 2 * 1 * 64, 4 * 4 * 2 * 64)
    mha = SimpleNamespace(num_hidden_layers=3, num_attention_heads=4, hidden_size=256)  # head_dim 64, kv = heads
    assert attention_shape(mha) == (3 * 2 * 4 * 64, 3 * 4 * 4 * 64)
    mla = SimpleNamespace(num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512, qk_rope_head_dim=64)
    assert attention_shape(mla) == (61 * (512 + 64), 0)


def _child(register, path):
    register(lambda: open(path, "a").write("closed\n"))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_worker_leaving_cleanly_closes_under_either_start_method(tmp_path, method):
    """vLLM's workers are multiprocessing children (spawned on the CPU build, forked by default elsewhere). A forked
    child leaves through os._exit, past atexit: plugin.on_exit must still close, once. The negative control shows the
    trap it avoids: atexit alone does not run in a forked child."""
    import atexit
    import multiprocessing

    ctx = multiprocessing.get_context(method)
    done = tmp_path / "closed"
    p = ctx.Process(target=_child, args=(plugin.on_exit, str(done)))
    p.start()
    p.join(60)
    assert p.exitcode == 0 and done.read_text() == "closed\n"  # once, though registered twice
    if method == "fork":
        control = tmp_path / "atexit-only"
        p = ctx.Process(target=_child, args=(atexit.register, str(control)))
        p.start()
        p.join(60)
        assert p.exitcode == 0 and not control.exists()
