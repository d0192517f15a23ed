"""Our OffloadingManager seen through vLLM's manager interface.

vLLM's scheduler calls this with its own types; each call converts them and
forwards to the kvoffload manager. Subclassing vLLM's base gives us its
defaults for whatever a vLLM version adds (0.33: lock, config_info)
unless our manager has the same thing.

Resets (reset_prefix_cache(reset_connector=True)): vLLM drops the jobs in
flight and never completes them. Our managers forget their keys at once
and hold their slots back until told the workers are done with them
(on_reset_flushed). vLLM 0.33 says so itself, through on_reset_flushed().
vLLM 0.32 has no such call, but its worker waits for every job in flight at
a reset before it starts any job submitted after it; so here the first
completion of any job after a reset means the flush is done (and if no
slot was held back, no job was in flight: done at once). If a store finds
no room meanwhile, the held slots are released for vLLM's own later jobs
(which its worker orders after the flushed ones), promotions waiting for
that first completion (release_fenced_slots).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from kvoffload import abstractions as ko
from kvoffload.integrations.vllm import convert
from kvoffload.integrations.vllm._compat import HAS_LOAD_SOURCE, CacheHitSource, vbase


class VLLMOffloadingManager(vbase.OffloadingManager):
    def __init__(self, inner: ko.OffloadingManager, vllm_metric_names: bool = False):
        self.inner = inner
        self.vllm_metric_names = vllm_metric_names  # also under vLLM's own names (metrics_vllm)
        self._flush_due = False  # 0.32: a reset not known flushed yet

    _HAS_FLUSH_HOOK = hasattr(vbase.OffloadingManager, "on_reset_flushed")

    if hasattr(vbase.OffloadingManager, "lock"):
        @property
        def lock(self):  # 0.33: a manager with its own threads supplies a real lock
            own = getattr(self.inner, "lock", None)
            return own if own is not None else super().lock

    # hot path: one call per block, so no extra layers
    def lookup(self, key: bytes, req_context: Any) -> Any:
        return convert.LOOKUP_RESULTS[self.inner.lookup(key, convert.req_context(req_context))]

    if HAS_LOAD_SOURCE:
        def get_load_source(self, key: bytes, req_context: Any) -> Any:
            """HOST for the CPU tier, else unspecified."""
            if getattr(self.inner, "medium", None) is ko.Medium.CPU:
                return CacheHitSource.HOST
            return CacheHitSource.EXTERNAL_UNSPECIFIED

    def prepare_load(self, keys: Collection[bytes], req_context: Any) -> ko.LoadStoreSpec:
        # our spec travels to our worker as is (vLLM only passes it along)
        return self.inner.prepare_load(keys, convert.req_context(req_context))

    def touch(self, keys: Collection[bytes], req_context: Any) -> None:
        self.inner.touch(keys, convert.req_context(req_context))

    def complete_load(self, keys: Collection[bytes], req_context: Any) -> None:
        if self._flush_due:
            self._flushed()
        self.inner.complete_load(keys, convert.req_context(req_context))

    def prepare_store(self, keys: Collection[bytes], req_context: Any) -> Any:
        ctx = convert.req_context(req_context)
        out = self.inner.prepare_store(keys, ctx)
        if out is None and self._flush_due and hasattr(self.inner, "release_fenced_slots"):
            # 0.32, no room but slots fenced: no job may come to prove the
            # flush. vLLM's worker runs the flushed jobs before any later
            # one, so its own later jobs may reuse the slots (promotions,
            # our own writes, wait for the first completion): try again.
            self.inner.release_fenced_slots()
            out = self.inner.prepare_store(keys, ctx)
        return convert.prepare_store_output(out)

    def complete_store(self, keys: Collection[bytes], req_context: Any, success: bool = True) -> None:
        if self._flush_due:
            self._flushed()
        self.inner.complete_store(keys, convert.req_context(req_context), success)

    def on_new_request(self, req_context: Any) -> Any:
        return convert.request_offloading_context(self.inner.on_new_request(convert.req_context(req_context)))

    def on_request_finished(self, req_context: Any) -> None:
        self.inner.on_request_finished(convert.req_context(req_context))

    def take_events(self) -> Iterable[Any]:
        for e in self.inner.take_events():
            v = convert.event(e)
            if v is not None:
                yield v

    def on_schedule_end(self, context: Any) -> None:
        self.inner.on_schedule_end(convert.schedule_end_context(context))

    def has_pending_work(self) -> bool:
        return self.inner.has_pending_work()

    def reset_cache(self) -> None:
        self.inner.reset_cache()
        if not self._HAS_FLUSH_HOOK:  # 0.32: see the module docstring
            awaiting = getattr(self.inner, "awaiting_flush", None)
            self._flush_due = True
            if awaiting is None or not awaiting():
                self._flushed()

    def on_reset_flushed(self) -> None:  # 0.33 calls it; 0.32 through _flushed()
        self._flushed()

    def _flushed(self) -> None:
        self._flush_due = False
        hook = getattr(self.inner, "on_reset_flushed", None)
        if hook is not None:
            hook()

    def get_stats(self) -> Any:
        return convert.connector_stats(self.inner.get_stats(), self.vllm_metric_names)

    def shutdown(self) -> None:
        self.inner.shutdown()
