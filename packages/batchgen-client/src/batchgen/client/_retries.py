"""Retrying what did not succeed, for both clients: the retry call, the merged results, and the
rounds of `submit_batch(..., retry_failed=N)`.

    rounds = submission.rounds(batch)          # after the first batch ended
    while (merged := rounds.merged(latest)) is not None:
        spec = rounds.retry(tally of merged)   # (`_line_errors.LineTally`) None: nothing retryable
        if spec is None: break
        try: created = call(spec)
        except APIStatusError as exc: rounds.stop_on(exc) (re-raises unless nothing is left)
        latest = wait(rounds.wait(created))
    batch = call(rounds.original())            # the first batch again, its `retries` listed

A round retries only what a retry may fix: lines whose error code is not one of
`PERMANENT_ERROR_CODES`, and lines that never ran. The server's retry takes every failed line or
none, so when a retryable failure is left, the lines that failed for good run again beside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchgen.client._exceptions import APIStatusError, BatchGenClientError
from batchgen.client._files import Download
from batchgen.client._line_errors import LineTally
from batchgen.client._requests import JSONObject, RequestSpec, StrPath, _idempotency, _segment
from batchgen.client._wait import ProgressCallback, Wait

__all__ = [
    "OUTCOMES",
    "RetryRounds",
    "download_merged_results",
    "download_merged_results_to",
    "retry_batch",
]

OUTCOMES = ("failed", "not_run")
"""What a retry may take again: lines whose best result is an error, and lines that never ran."""
NOTHING_TO_RETRY = "nothing_to_retry"


def retry_batch(
    batch_id: str,
    outcomes: Sequence[str] | None = None,
    *,
    completion_window: str | None = None,
    metadata: Mapping[str, str] | None = None,
    max_decoding_length: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    output_order: str | None = None,
    idempotency_key: str | None = None,
) -> RequestSpec:
    """A new batch over the lines of an ended batch that did not succeed so far
    (POST /v1/batches/{batch_id}/retry); returns the new batch, whose `retry_of` names this one.

    `outcomes` (default: both) picks `"failed"` lines, `"not_run"` lines (dropped by a cancel or
    an expiry), or both, judged over the batch and its earlier retries. The batch-level options
    left None are the original batch's. Every attempt sends one `Idempotency-Key`
    (`idempotency_key`, or a fresh uuid4 per call), so a retried call makes one retry batch.
    """
    body: dict[str, Any] = {}
    if outcomes is not None:
        body["outcomes"] = list(outcomes)
    given = {
        "completion_window": completion_window,
        "metadata": None if metadata is None else dict(metadata),
        "max_decoding_length": max_decoding_length,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "output_order": output_order,
    }
    body.update({name: value for name, value in given.items() if value is not None})
    path = f"/v1/batches/{_segment(batch_id)}/retry"
    return RequestSpec("POST", path, json=body, headers=_idempotency(idempotency_key))


def _merged_results(batch_id: str) -> RequestSpec:
    return RequestSpec("GET", f"/v1/batches/{_segment(batch_id)}/merged_results")


def download_merged_results(batch_id: str) -> RequestSpec:
    """The best result so far of every request of a batch and its retries, in input order, in
    memory (GET /v1/batches/{batch_id}/merged_results). For large batches prefer
    `download_merged_results_to`."""
    return _merged_results(batch_id)


def download_merged_results_to(batch_id: str, path: StrPath) -> Download:
    """Stream the merged results of a batch and its retries to `path` (via `<path>.part`)."""
    return Download(_merged_results(batch_id), Path(path))


@dataclass(slots=True)
class RetryRounds:
    """Up to `limit` retries of `original_id`, each over what is still without a success."""

    original_id: str
    limit: int
    poll_interval: float | None
    timeout: float | None
    progress: bool | None
    on_progress: ProgressCallback | None
    total: int | None = None
    """The requests of the original batch (its `request_counts.total`), if it said."""
    made: list[str] = field(default_factory=list)

    def merged(self, latest: Mapping[str, Any]) -> RequestSpec | None:
        """The merged results to read before the next retry (`retry` judges them), or None: the
        limit is reached, or the latest batch completed with no failed line (nothing is left)."""
        if len(self.made) >= self.limit:
            return None
        counts = latest.get("request_counts") or {}
        if latest.get("status") == "completed" and not counts.get("failed"):
            return None
        return _merged_results(self.original_id)

    def retry(self, tally: LineTally) -> RequestSpec | None:
        """The next retry, given the tally of the merged results so far: of the failed lines if
        any may succeed when run again, and of the lines that never ran if there are any; None
        when neither is left (every failure is one no retry can fix)."""
        outcomes = []
        if tally.retryable:
            outcomes.append("failed")
        if self.total is None or tally.lines < self.total:
            outcomes.append("not_run")
        if not outcomes:
            return None
        return retry_batch(self.original_id, outcomes)

    @staticmethod
    def stop_on(error: APIStatusError) -> None:
        """Re-raise `error` unless it says nothing is left to retry (then the rounds are over)."""
        if error.code != NOTHING_TO_RETRY:
            raise error

    def wait(self, created: JSONObject) -> Wait:
        batch_id = created.get("id")
        if not isinstance(batch_id, str) or not batch_id:
            raise BatchGenClientError(f"the server returned a batch object without an id: {created!r}")
        self.made.append(batch_id)
        return Wait(
            batch_id, self.poll_interval, self.timeout, progress=self.progress, on_progress=self.on_progress
        )

    def original(self) -> RequestSpec:
        """The original batch again, its `retries` listing every retry made."""
        return RequestSpec("GET", f"/v1/batches/{_segment(self.original_id)}")

    @staticmethod
    def merged_download(batch_id: str, path: StrPath) -> Download:
        return download_merged_results_to(batch_id, path)
