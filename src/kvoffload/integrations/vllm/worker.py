"""Our OffloadingWorker seen through vLLM's worker interface: GPU specs and
transfer results are converted, our own (CPU/storage) specs pass through."""

from __future__ import annotations

from typing import Any

from kvoffload import abstractions as ko
from kvoffload.integrations.vllm import convert
from kvoffload.integrations.vllm._compat import vbase


class VLLMOffloadingWorker(vbase.OffloadingWorker):
    def __init__(self, inner: ko.OffloadingWorker, shared_pool: Any = None):
        self.inner = inner
        self.shared_pool = shared_pool  # a SharedHostPool of the TP ranks, closed here

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: ko.LoadStoreSpec) -> bool:
        return self.inner.submit_store(job_id, convert.gpu_spec(src_spec), dst_spec)

    def submit_load(self, job_id: int, src_spec: ko.LoadStoreSpec, dst_spec: Any,
                    expedited: bool = False) -> bool:
        # expedited (0.33): vLLM waits on this load within the step; our
        # workers run jobs in submission order, so nothing queues ahead of it
        # for long. Submission never blocks either way.
        return self.inner.submit_load(job_id, src_spec, convert.gpu_spec(dst_spec))

    def get_finished(self) -> list[Any]:
        return [convert.transfer_result(r) for r in self.inner.get_finished()]

    def wait(self, job_ids: set[int]) -> None:
        self.inner.wait(job_ids)

    def shutdown(self) -> None:
        if self.shared_pool is not None:  # its creator (TP rank 0) removes the file if still there
            self.shared_pool.remove_file()  # (before the slower part: vLLM may kill a rank that lingers)
        self.inner.shutdown()
        if self.shared_pool is not None:
            self.shared_pool.close()
            self.shared_pool = None
