"""The server's periodic stats lines (server/stat_log.py, vLLM's LoggingStatLogger): throughput, requests, KV cache and
prefix hits over each interval, the speculative-decoding line with acceptance by draft position; one line when the
engine goes idle, then none; `--disable-log-stats` reaches the app."""
from __future__ import annotations

import pytest

from nanoserve.engine.messages import EngineStats
from nanoserve.server.stat_log import StatLogger


class _Source:
    def __init__(self):
        self.stats = EngineStats(kv_blocks_total=100, spec_method="ngram", spec_accepted_per_position=[0, 0])


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_lines_over_an_interval_then_quiet_when_idle():
    source, clock = _Source(), _Clock()
    log = StatLogger(source, interval=10.0, clock=clock)
    clock.t = 10.0
    source.stats = EngineStats(num_running=3, num_waiting=1, kv_blocks_total=100, kv_blocks_used=25,
                               prompt_tokens=2000, generation_tokens=500, prefix_cache_hit_tokens=500, preemptions=2,
                               spec_method="ngram", spec_num_drafts=100, spec_draft_tokens=400,
                               spec_accepted_tokens=150, spec_accepted_per_position=[80, 50])
    engine, spec = log.lines()
    assert engine == ("engine: prompt 200.0 tokens/s, generation 50.0 tokens/s, running 3, waiting 1, KV cache 25.0% "
                      "used, prefix cache hit rate 25.0%, preemptions 2")
    assert spec == ("speculative decoding (ngram): mean accepted length 2.50, acceptance 37.5% (by draft position: "
                    "0.80, 0.50), drafted 40.0 tokens/s, accepted 15.0 tokens/s")
    clock.t = 20.0
    source.stats = EngineStats(**{**{f: getattr(source.stats, f) for f in EngineStats.__struct_fields__},
                                  "num_running": 0, "num_waiting": 0})
    idle = log.lines()  # the first idle interval: one line, no speculation verified
    assert idle == ["engine: prompt 0.0 tokens/s, generation 0.0 tokens/s, running 0, waiting 0, KV cache 25.0% used, "
                    "prefix cache hit rate 0.0%, preemptions 0"]
    clock.t = 30.0
    assert log.lines() == []
    with pytest.raises(ValueError, match="interval"):
        StatLogger(source, interval=0)


def test_the_live_servers_stats_read_as_lines(model_dir, serve_app):
    """Over the tiny model served with n-gram drafts: the lines of the interval a stream ran in count its tokens and
    its verified drafts."""
    from nanoserve.server.app import build_app
    from tests.server.conftest import API_KEY, ENGINE_OPTIONS, MODEL
    from tests.server.test_speculative_server import NGRAM, PROMPTS

    server = serve_app(build_app(model_dir, api_key=API_KEY, served_model_name=MODEL, speculative_config=NGRAM,
                                 log_stats=False, **ENGINE_OPTIONS))
    log = StatLogger(server.engine_client)
    server.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    server.wait_idle()
    engine, spec = log.lines()
    assert "generation 0.0 tokens/s" not in engine and engine.startswith("engine: prompt ")
    assert spec.startswith("speculative decoding (ngram): mean accepted length ")


def test_disable_log_stats_reaches_the_app(monkeypatch, tmp_path):
    import nanoserve.server.app as app
    from nanoserve.cli import main

    seen = []
    monkeypatch.setattr(app, "serve", lambda config, **kw: seen.append(kw["log_stats"]) or 0)
    assert main(["serve", "--model", str(tmp_path), "--port", "0", "--disable-log-stats"]) == 0
    assert main(["serve", "--model", str(tmp_path), "--port", "0"]) == 0
    assert seen == [False, True]
