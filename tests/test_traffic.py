import collections
import json

import pytest

from moescope.errors import ConfigError
from moescope.runtime import corpus, traffic


def test_traffic_is_deterministic_and_within_bounds():
    cfg = traffic.TrafficConfig(rate=10.0, seed=4)
    a, b = traffic.generate(cfg, 200), traffic.generate(cfg, 200)
    assert a == b
    assert a != traffic.generate(traffic.TrafficConfig(rate=10.0, seed=5), 200)
    arrivals = [r.arrival_s for r in a]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    # Poisson at 10/s: the mean gap is 0.1 s (loose bound for 199 gaps).
    assert 0.07 < arrivals[-1] / 199 < 0.13
    for r in a:
        assert 1 <= len(r.prompt.encode()) <= 256
        assert 4 <= r.max_new_tokens <= 96
    counts = collections.Counter(r.domain for r in a)
    assert set(counts) == set(corpus.DOMAINS)
    assert counts["code"] > counts["unicode"]  # 0.35 vs 0.1


def test_prompts_come_from_held_out_text():
    held = {d: corpus.split(corpus.domain_text(d), "heldout") for d in corpus.DOMAINS}
    for r in traffic.generate(traffic.TrafficConfig(seed=1), 40):
        assert r.prompt in held[r.domain]


def test_domain_shift():
    cfg = traffic.TrafficConfig(shift_after=100, shifted_domains={"numbers": 1.0}, seed=2)
    reqs = traffic.generate(cfg, 200)
    assert all(r.domain == "numbers" for r in reqs[100:])
    assert len({r.domain for r in reqs[:100]}) > 1


def test_narrow_traffic_repeats_a_few_requests_with_broad_arrivals():
    """``distinct_prompts``: arrivals as broad traffic's (same times), each request one of the few templates
    (prompt, length, domain and tenant together); after a domain shift, templates of the shifted mix."""
    broad = traffic.generate(traffic.TrafficConfig(rate=10.0, seed=3), 300)
    narrow = traffic.generate(traffic.TrafficConfig(rate=10.0, seed=3, distinct_prompts=4), 300)
    assert [r.arrival_s for r in narrow] == [r.arrival_s for r in broad]
    assert [r.index for r in narrow] == list(range(300))
    kinds = {(r.prompt, r.max_new_tokens, r.domain, r.tenant) for r in narrow}
    templates = traffic.generate(traffic.TrafficConfig(rate=10.0, seed=0), 4)  # a product's fixed prompts
    assert kinds == {(r.prompt, r.max_new_tokens, r.domain, r.tenant) for r in templates}
    assert min(collections.Counter(r.prompt for r in narrow).values()) > 30  # each repeated, none starved
    other = traffic.generate(traffic.TrafficConfig(rate=10.0, seed=4, distinct_prompts=4), 300)
    assert {r.prompt for r in other} == {r.prompt for r in narrow} and other != narrow  # same prompts, new order
    shifted = traffic.generate(traffic.TrafficConfig(seed=2, shift_after=100, shifted_domains={"numbers": 1.0},
                                                     distinct_prompts=3), 200)
    assert all(r.domain == "numbers" for r in shifted[100:]) and len({r.prompt for r in shifted[100:]}) <= 3
    assert len({r.prompt for r in shifted[:100]}) <= 3


@pytest.mark.parametrize("kwargs", [{"domains": {"klingon": 1.0}}, {"rate": -1}, {"domains": {}},
                                    {"prompt_bytes_range": (10, 5)}, {"distinct_prompts": 0}])
def test_bad_traffic_config(kwargs):
    with pytest.raises(ConfigError):
        traffic.TrafficConfig(**kwargs)


def test_the_stdlib_corpus_is_cached_on_disk_and_equal_to_a_fresh_parse(tmp_path, monkeypatch):
    """Every demo process builds its traffic from the parsed standard library (~1 CPU-s): corpus keeps it in the
    user's cache. What a later process reads is what parsing the same files gives (the reference: _parse_stdlib
    on _stdlib_files); a corrupt file is parsed again; a cache that cannot be written still serves the text."""
    limit = 200_000  # a few files: the test parses them several times
    reference = corpus._parse_stdlib([path for path, _, _ in corpus._stdlib_files(limit)])
    assert reference[0] and reference[1]
    monkeypatch.setenv("MOESCOPE_CACHE", str(tmp_path))
    corpus._stdlib_text.cache_clear()
    assert corpus._stdlib_text(limit) == reference  # parsed, then written
    (written,) = (tmp_path / "corpus").glob("stdlib-*.json")

    corpus._stdlib_text.cache_clear()  # a new process: read from the file, nothing parsed
    with monkeypatch.context() as m:
        m.setattr(corpus, "_parse_stdlib", lambda files: pytest.fail("parsed although the cache holds it"))
        assert corpus._stdlib_text(limit) == reference

    written.write_text('{"key": [')  # cut short: parsed again, and rewritten whole
    corpus._stdlib_text.cache_clear()
    assert corpus._stdlib_text(limit) == reference
    assert json.loads(written.read_text())["code"] == reference[0]

    blocked = tmp_path / "a-file-not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv("MOESCOPE_CACHE", str(blocked))  # corpus/ cannot be made under a file
    corpus._stdlib_text.cache_clear()
    assert corpus._stdlib_text(limit) == reference
    corpus._stdlib_text.cache_clear()
