"""The server's stats lines, as `vllm serve` logs them: every LOG_STATS_INTERVAL_S while the engine works, the prompt
and generation throughput over the interval, the running and waiting requests, KV-cache use, the prefix-cache hit
rate and preemptions; with speculative decoding a second line, its mean accepted length, acceptance rate by draft
position and drafted / accepted throughput. Read from the stats the core sent last (no call to the core); an idle
engine gets one line, then none until it works again. `--disable-log-stats` turns it off."""
from __future__ import annotations

import asyncio
import logging
import time

from nanoserve.config import LOG_STATS_INTERVAL_S
from nanoserve.engine.messages import EngineStats

logger = logging.getLogger("nanoserve")


class StatLogger:
    def __init__(self, source, interval: float = LOG_STATS_INTERVAL_S, clock=time.monotonic):
        """source: anything with the core's latest `stats` (the engine client)."""
        if not interval > 0:
            raise ValueError(f"the stats interval must be > 0 seconds, got {interval!r}")
        self.source, self.interval, self.clock = source, interval, clock
        self._last, self._at, self._idle = source.stats, clock(), False

    def lines(self) -> list[str]:
        """The lines for the interval since the last call (none while idle, after the first idle one)."""
        now, at = self.source.stats, self.clock()
        before, seconds = self._last, max(at - self._at, 1e-9)
        self._last, self._at = now, at
        busy = now.num_running or now.num_waiting or now.prompt_tokens != before.prompt_tokens \
            or now.generation_tokens != before.generation_tokens
        if not busy and self._idle:
            return []
        self._idle = not busy
        return [engine_line(before, now, seconds)] + ([spec] if (spec := speculation_line(before, now, seconds)) else [])

    async def run(self) -> None:
        """Log the lines every interval until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            for line in self.lines():
                logger.info("%s", line)


def engine_line(before: EngineStats, now: EngineStats, seconds: float) -> str:
    prompt = now.prompt_tokens - before.prompt_tokens
    hits = now.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    used = now.kv_blocks_used / now.kv_blocks_total if now.kv_blocks_total else 0.0
    return (f"engine: prompt {prompt / seconds:.1f} tokens/s, generation "
            f"{(now.generation_tokens - before.generation_tokens) / seconds:.1f} tokens/s, running {now.num_running}, "
            f"waiting {now.num_waiting}, KV cache {used:.1%} used, prefix cache hit rate "
            f"{hits / prompt if prompt else 0.0:.1%}, preemptions {now.preemptions - before.preemptions}")


def speculation_line(before: EngineStats, now: EngineStats, seconds: float) -> str | None:
    """None when speculation is off or verified nothing in the interval."""
    spec = now.speculation_since(before)
    if spec is None or not spec["num_drafts"]:
        return None
    by_position = ", ".join(f"{n / spec['num_drafts']:.2f}" for n in spec["accepted_per_position"])
    return (f"speculative decoding ({spec['method']}): mean accepted length {spec['mean_accepted_length']:.2f}, "
            f"acceptance {spec['acceptance_rate']:.1%} (by draft position: {by_position}), drafted "
            f"{spec['draft_tokens'] / seconds:.1f} tokens/s, accepted {spec['accepted_tokens'] / seconds:.1f} tokens/s")


__all__ = ["StatLogger", "engine_line", "speculation_line"]
