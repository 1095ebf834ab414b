"""Slots shared fairly between models: no model's big batch holds every slot while another waits.

Each batch runs on one model. While several models have queued work, each may take a new slot
only while it holds fewer than its share of the scheduling pool, ``ceil(capacity / models with
queued work)``; a model alone may use every slot (no slot stays free while work waits). A model over its share (it took the slots before another model's batch
arrived) gets no new slot until it is back under it, so the slots it frees go to the models below
theirs. With one served model the scheduler does not consult this at all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable


class ModelShares:
    """Per-model slot counts and the fair-share test the scheduler admits by."""

    def __init__(self, capacity: int, model_of: Callable[[str], str]) -> None:
        """``model_of(batch_id)`` is the model a batch runs on."""
        self.capacity = capacity
        self._model_of = model_of
        self._running: Counter[str] = Counter()
        self._batch_models: dict[str, str] = {}
        self._batch_running: Counter[str] = Counter()

    def running(self, model: str) -> int:
        return self._running.get(model, 0)

    def model_of(self, batch_id: str) -> str:
        model = self._batch_models.get(batch_id)
        return model if model is not None else self._model_of(batch_id)

    def share(self, models_with_work: int) -> int:
        """The most slots one model may hold while ``models_with_work`` models have work."""
        return max(1, -(-self.capacity // max(1, models_with_work)))

    def admission_test(self, queued_batches: Iterable[str]) -> Callable[[str], bool]:
        """A test of whether a batch's next request may take a slot now, given the batches with
        queued requests (computed once per admission round)."""
        with_work = {self.model_of(batch_id) for batch_id in queued_batches}
        share = self.share(len(with_work))
        return lambda batch_id: self.running(self.model_of(batch_id)) < share

    def acquire(self, batch_id: str) -> None:
        model = self.model_of(batch_id)
        self._batch_models[batch_id] = model
        self._batch_running[batch_id] += 1
        self._running[model] += 1

    def release(self, batch_id: str) -> None:
        model = self._batch_models[batch_id]
        self._running[model] -= 1
        if not self._running[model]:
            del self._running[model]
        self._batch_running[batch_id] -= 1
        if not self._batch_running[batch_id]:
            del self._batch_running[batch_id]
            del self._batch_models[batch_id]
