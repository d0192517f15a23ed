"""The engine-time model (EngineOptions.time_model "engine"): a step lasts
its compute time, and the tiers below CPU work for as long as the engine
computes, on a simulated clock (tier_clock.py), so a tiered replay shows
what an engine at that speed would see, the same on a quiet or a busy
machine.

A step's compute time: the prompt tokens it computes at
prefill_tokens_per_s, plus the output tokens of the requests whose prefill
it finishes at decode_tokens_per_s (both the batch's throughput: with one
request at a time the replay charges each request its share of a loaded
engine's time). A step that computes nothing (every request waits for a
promotion) lasts until the next tier job lands, or IDLE_TICK_S when none is
in flight: the engine's wait on its tiers, counted as tier_wait_s.

"fast" (the default without tiers below CPU): no clock; the tiers' threads
run as fast as the machine lets them (CPU-only runs do not depend on it).

A mixin of ReplayEngine (engine.py): it reads and writes the engine's state.
"""

from __future__ import annotations

from kvoffload.config import ConfigError
from kvoffload.replay.tier_clock import PacedWorker, SimClock, default_bandwidth

IDLE_TICK_S = 0.001  # an idle step with no tier job in flight (the fast clock's minimum step too)
TIME_MODELS = ("auto", "engine", "fast")


class EngineTime:
    def _install_clock(self) -> None:
        """Engine time: every tier below CPU's worker paced by the clock."""
        self.clock: SimClock | None = None
        self._paced: dict[str, PacedWorker] = {}
        self._step_decode = 0.0  # output tokens charged to this step
        self._step_busy = False  # the step computed something (prefill or decode)
        if self.opts.time_model != "engine":
            return
        self.clock = SimClock()
        block_bytes = self.opts.model_kv_bytes_per_token * self.trace.block_size
        rates = self.opts.tier_bandwidth or {}
        tiers = [t for t in getattr(self.manager, "tiers", None) or () if t.worker is not None]
        unknown = sorted(set(rates) - {t.name for t in tiers})
        if unknown:
            raise ConfigError(f"tier bandwidth given for {', '.join(map(repr, unknown))}: no such tier below CPU "
                              f"(the tiers: {', '.join(t.name for t in tiers) or 'none'})")
        for t in tiers:
            bw = rates.get(t.name, default_bandwidth(t))
            t.worker = self._paced[t.name] = PacedWorker(t.worker, self.clock, bw, block_bytes)

    def _advance_clock(self, now_ms: float) -> float:
        """The simulated time (ms) after this step."""
        opts, c = self.opts, self.c
        if self.clock is None:  # the fast clock: prompt tokens only, at least 1 ms a step
            return now_ms + max(1.0, 1000.0 * self._step_tokens / opts.prefill_tokens_per_s)
        clock = self.clock
        clock.now_s = max(clock.now_s, now_ms / 1000.0)
        step_s = self._step_tokens / opts.prefill_tokens_per_s + self._step_decode / opts.decode_tokens_per_s
        self._step_decode = 0.0
        if step_s > 0:
            c["compute_s"] += step_s
        elif not self._step_busy:
            due = [t for t in (w.next_due() for w in self._paced.values()) if t is not None]
            step_s = max(0.0, min(due) - clock.now_s) if due else IDLE_TICK_S
            c["tier_wait_s"] += step_s
        self._step_busy = False
        clock.now_s += step_s
        return clock.now_s * 1000.0

    def _finish_clock(self) -> None:
        """After the last step: every tier job lands (the engine idles until they do)."""
        if self.clock is None:
            return
        last = max((w.free_at for w in self._paced.values()), default=0.0)
        self.clock.now_s = max(self.clock.now_s, last)

    def time_report(self) -> dict[str, dict[str, float]]:
        """Per paced tier: its modeled bandwidth, busy share of the run, and
        how often the machine was slower than the modeled tier."""
        if self.clock is None:
            return {}
        total = self.clock.now_s or 1.0
        return {name: {"bandwidth_Bps": w.bandwidth, "busy_s": w.busy_s, "busy_share": w.busy_s / total,
                       "peak_backlog_s": w.peak_backlog_s, "late_waits": w.late_waits,
                       "late_wait_s": w.late_wait_s} for name, w in self._paced.items()}
