"""Prometheus metrics of the server: request counts, token counters, TTFT / inter-token latency histograms
(observed on the per-step deltas as the engine client receives them), and the engine's live state (running /
waiting, KV-cache use and kind, decode steps by graph vs eager) from the core's latest stats, read at scrape time."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanoserve.engine.output import RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
               0.75, 1.0, 2.5)


class _EngineCollector:
    """Engine gauges and counters read at scrape time from the stats the core sent last (`source.stats`)."""

    def __init__(self, source):
        self.source = source

    def collect(self):
        s = self.source.stats
        yield GaugeMetricFamily("nanoserve_num_requests_running", "Requests in the running batch", value=s.num_running)
        yield GaugeMetricFamily("nanoserve_num_requests_waiting", "Requests waiting to be scheduled",
                                value=s.num_waiting)
        yield GaugeMetricFamily("nanoserve_kv_cache_usage", "Fraction of KV-cache blocks in use (0..1)",
                                value=s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        yield GaugeMetricFamily("nanoserve_kv_cache_blocks_used", "KV-cache blocks in use", value=s.kv_blocks_used)
        yield GaugeMetricFamily("nanoserve_kv_cache_blocks_total", "KV-cache blocks in all", value=s.kv_blocks_total)
        yield GaugeMetricFamily("nanoserve_kv_cache_block_bytes", "Bytes of one KV-cache block over every layer "
                                "(an fp8 cache's scales included; one rank's heads)", value=s.kv_block_bytes)
        info = GaugeMetricFamily("nanoserve_kv_cache_info", "The KV cache's element type and fp8 scale design "
                                 "(none: the serving dtype, unscaled); the value is 1", labels=["dtype", "scales"])
        info.add_metric([s.kv_cache_dtype, s.kv_cache_scales or "none"], 1)
        yield info
        counters = [
            ("nanoserve_prompt_tokens", "Prompt tokens processed", s.prompt_tokens),
            ("nanoserve_generation_tokens", "Tokens generated", s.generation_tokens),
            ("nanoserve_padding_rows", "Padded rows in graph-replayed decode batches", s.padding_rows),
            ("nanoserve_padding_tokens", "Padded tokens in graph-replayed prompt / mixed steps", s.padding_tokens),
            ("nanoserve_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks", s.preemptions),
            ("nanoserve_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
             s.prefix_cache_hit_tokens),
            ("nanoserve_mixed_steps", "Steps that prefilled a prompt chunk (decode rows may ride along)",
             s.mixed_steps),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        steps = CounterMetricFamily("nanoserve_decode_steps", "Decode steps by how they ran", labels=["mode"])
        steps.add_metric(["graph"], s.decode_steps_graph)
        steps.add_metric(["eager"], s.decode_steps_eager)
        yield steps
        prefill = CounterMetricFamily("nanoserve_prefill_steps", "Prompt / mixed steps by how they ran", labels=["mode"])
        prefill.add_metric(["graph"], s.prefill_steps_graph)
        prefill.add_metric(["eager"], s.prefill_steps_eager)
        yield prefill
        loop = CounterMetricFamily("nanoserve_engine_loop_seconds", "The engine loop's time in the steps it launched: "
                                   "its own work (busy) and waiting for sampled tokens (wait)", labels=["part"])
        loop.add_metric(["busy"], s.host_busy_seconds)
        loop.add_metric(["wait"], s.host_wait_seconds)
        yield loop
        if s.spec_method is not None:
            yield from _speculation(s)


def _speculation(s):
    """Speculative decoding's counters (vLLM's spec_decode names), labelled by method."""
    for name, doc, value in [
            ("nanoserve_spec_decode_num_drafts", "Sequence steps that verified drafts", s.spec_num_drafts),
            ("nanoserve_spec_decode_num_draft_tokens", "Draft tokens verified", s.spec_draft_tokens),
            ("nanoserve_spec_decode_num_accepted_tokens", "Draft tokens accepted", s.spec_accepted_tokens)]:
        family = CounterMetricFamily(name, doc, labels=["method"])
        family.add_metric([s.spec_method], value)
        yield family
    per_position = CounterMetricFamily("nanoserve_spec_decode_num_accepted_tokens_per_pos",
                                       "Draft tokens accepted, by their position among a step's drafts",
                                       labels=["method", "position"])
    for position, value in enumerate(s.spec_accepted_per_position):
        per_position.add_metric([s.spec_method, str(position)], value)
    yield per_position
    yield GaugeMetricFamily("nanoserve_spec_decode_mean_accepted_length", "Tokens a verifying sequence step yields on "
                            "average (accepted drafts + 1)",
                            value=1 + s.spec_accepted_tokens / s.spec_num_drafts if s.spec_num_drafts else 0.0)


class ServerMetrics:
    """Prometheus metrics in the app's own registry (never the global one: several apps may share a process)."""

    def __init__(self, stats_source):
        self.registry = CollectorRegistry()
        self.requests = Counter("nanoserve_http_requests", "HTTP requests to the API routes (all but the probes) by "
                                "status code", ["status"], registry=self.registry)
        self.finished = Counter("nanoserve_completions_finished",
                                "Completions ended, by finish reason (abort: client went away; error: engine failed)",
                                ["reason"], registry=self.registry)
        self.ttft = Histogram("nanoserve_time_to_first_token_seconds", "Request arrival to its first output token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("nanoserve_inter_token_latency_seconds", "Time between successive output tokens",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("nanoserve_request_latency_seconds", "Request arrival to its last token",
                             buckets=TTFT_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(stats_source))


class Tracker:
    """Follows one API request (its prompts × n) through its deltas to observe TTFT / ITL / finish reasons."""

    def __init__(self, metrics: ServerMetrics, num_prompts: int, n: int):
        self.metrics, self.n = metrics, n
        self.arrival = time.perf_counter()
        self.last = [self.arrival] * num_prompts
        self.tokens = [0] * num_prompts
        self.done: set[tuple[int, int]] = set()  # (prompt, completion) pairs whose end was counted
        self.num_prompts = num_prompts

    def observe(self, i: int, out: RequestOutput) -> None:
        """One delta of prompt i (what a step added to its completions)."""
        now = time.perf_counter()
        new = max((len(c.token_ids) for c in out.outputs), default=0)
        if new:
            if self.tokens[i] == 0:
                self.metrics.ttft.observe(now - self.arrival)
            else:
                self.metrics.itl.observe((now - self.last[i]) / new)
            self.tokens[i] += new
            self.last[i] = now
        for c in out.outputs:
            if c.finish_reason is not None and (i, c.index) not in self.done:
                self.done.add((i, c.index))
                self.metrics.finished.labels(c.finish_reason).inc()
        if out.finished:
            self.metrics.e2e.observe(now - self.arrival)

    def end(self, reason: str) -> None:
        """Count every completion not yet finished as ended with `reason` (abort / error)."""
        for i in range(self.num_prompts):
            for j in range(self.n):
                if (i, j) not in self.done:
                    self.done.add((i, j))
                    self.metrics.finished.labels(reason).inc()
