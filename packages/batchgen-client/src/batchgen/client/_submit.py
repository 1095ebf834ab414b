"""`submit_batch` as steps both clients take in the same order, sending what each step returns:

submission = submit_batch(input_file_path, ...)    # a Submission
uploaded = call(submission.upload())               # or, past the threshold, the file of
                                                   # chunked(submission.chunked) (`_chunked`)
created = call(submission.create(uploaded))
batch = wait(submission.wait(created))
for download in submission.downloads(batch):
    download_to(download)
return submission.finish(batch)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.client import _requests as req
from batchgen.client._chunked import DEFAULT_CHUNKED_THRESHOLD, ChunkedUpload, upload_file_chunked
from batchgen.client._exceptions import BatchGenClientError
from batchgen.client._files import Download, download_file_to, endpoint_of
from batchgen.client._options import DEFAULT_COMPLETION_WINDOW, BatchOptions
from batchgen.client._requests import JSONObject, RequestSpec, StrPath
from batchgen.client._retries import RetryRounds
from batchgen.client._wait import ProgressCallback, Wait, check_poll_interval, finish_wait

__all__ = ["Submission", "object_id", "submit_batch"]


def submit_batch(
    input_file_path: StrPath,
    output_file_path: StrPath | None = None,
    endpoint: str | None = None,
    *,
    poll_interval: float | None = None,
    timeout: float | None = None,
    completion_window: str = DEFAULT_COMPLETION_WINDOW,
    metadata: Mapping[str, str] | None = None,
    max_decoding_length: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    output_order: str | None = None,
    error_file_path: StrPath | None = None,
    raise_on_failure: bool = False,
    progress: bool | None = None,
    on_progress: ProgressCallback | None = None,
    retry_failed: int = 0,
    chunked_upload_threshold: int | None = DEFAULT_CHUNKED_THRESHOLD,
) -> Submission:
    """Upload → create → wait → download; returns the final batch.

    `endpoint` None means the `url` of the file's first request. The output (and, if
    `error_file_path` is given, the error file) is downloaded whenever the final batch names
    one — a failed or cancelled batch may carry partial results. `poll_interval`, `progress`
    and `on_progress` are `wait_for_batch`'s. A file larger than `chunked_upload_threshold` bytes
    (256 MiB by default; None: never) is uploaded through the Uploads API in 64 MiB parts
    (`upload_file_chunked`), so it may be larger than the server's limit for one upload.

    `retry_failed=N` retries what did not succeed (`retry_batch`), up to N times, each time once
    the batch before has ended, until nothing retryable is left: a failure whose error code is one
    of `PERMANENT_ERROR_CODES` (`context_length_exceeded`, `invalid_request`, ...) is never the
    reason for a retry. The output path then receives the merged results
    (`download_merged_results_to`: one line per request, its best result), and the batch returned
    is the first one, its `retries` listing the retries made (`raise_on_failure` judges the last
    of them). It cannot be combined with `error_file_path`.
    """
    check_poll_interval(poll_interval)
    if isinstance(retry_failed, bool) or not isinstance(retry_failed, int) or retry_failed < 0:
        raise ValueError(f"retry_failed must be a whole number >= 0, got {retry_failed!r}")
    if retry_failed and error_file_path is not None:
        raise ValueError(
            "retry_failed writes the merged results (failures included) to the output path; "
            "error_file_path cannot be combined with it"
        )
    size = Path(input_file_path).stat().st_size
    chunked = None
    if chunked_upload_threshold is not None and size > chunked_upload_threshold:
        chunked = upload_file_chunked(input_file_path, "batch")
    return Submission(
        input_file_path=Path(input_file_path),
        endpoint=endpoint if endpoint is not None else endpoint_of(input_file_path),
        options=BatchOptions(
            completion_window, metadata, max_decoding_length, temperature, top_p, top_k, output_order
        ),
        poll_interval=poll_interval,
        timeout=timeout,
        progress=progress,
        on_progress=on_progress,
        output_file_path=output_file_path,
        error_file_path=error_file_path,
        raise_on_failure=raise_on_failure,
        retry_failed=retry_failed,
        chunked=chunked,
    )


@dataclass(frozen=True, slots=True)
class Submission:
    """One `submit_batch`: what to upload, create and wait for, and where its results go."""

    input_file_path: Path
    endpoint: str
    options: BatchOptions
    poll_interval: float | None
    timeout: float | None
    progress: bool | None
    on_progress: ProgressCallback | None
    output_file_path: StrPath | None
    error_file_path: StrPath | None
    raise_on_failure: bool
    retry_failed: int = 0
    chunked: ChunkedUpload | None = None
    """The upload through the Uploads API, for a file past the threshold (else `upload`)."""

    def upload(self) -> RequestSpec:
        return req.upload_file(self.input_file_path, "batch")

    def create(self, uploaded: JSONObject) -> RequestSpec:
        return req.create(object_id(uploaded, "file"), self.endpoint, self.options)

    def wait(self, created: JSONObject) -> Wait:
        """The wait for the created batch; it never raises on failure (see `finish`)."""
        return Wait(
            object_id(created, "batch"),
            self.poll_interval,
            self.timeout,
            progress=self.progress,
            on_progress=self.on_progress,
        )

    def rounds(self, batch: Mapping[str, Any]) -> RetryRounds | None:
        """The retries to make of the batch that ended (None without `retry_failed`)."""
        if not self.retry_failed:
            return None
        return RetryRounds(
            object_id(batch, "batch"),
            self.retry_failed,
            self.poll_interval,
            self.timeout,
            self.progress,
            self.on_progress,
            total=_total(batch),
        )

    def downloads(self, batch: Mapping[str, Any]) -> list[Download]:
        """A download for each result file that was asked for and that the final batch names
        (with `retry_failed`: the merged results of the batch and its retries)."""
        if self.retry_failed:
            path = self.output_file_path
            return [] if path is None else [RetryRounds.merged_download(object_id(batch, "batch"), path)]
        wanted = [("output_file_id", self.output_file_path), ("error_file_id", self.error_file_path)]
        downloads: list[Download] = []
        for key, path in wanted:
            file_id = batch.get(key)
            if path is not None and isinstance(file_id, str) and file_id:
                downloads.append(download_file_to(file_id, path))
        return downloads

    def finish(self, batch: JSONObject, last: JSONObject | None = None) -> JSONObject:
        """The batch `submit_batch` returns, once its results are downloaded; `raise_on_failure`
        judges `last`, the last retry made, when there is one."""
        finish_wait(last if last is not None else batch, raise_on_failure=self.raise_on_failure)
        return batch


def _total(batch: Mapping[str, Any]) -> int | None:
    """The batch's `request_counts.total`, if it is a count."""
    counts = batch.get("request_counts")
    total = counts.get("total") if isinstance(counts, Mapping) else None
    return total if isinstance(total, int) and not isinstance(total, bool) else None


def object_id(obj: Mapping[str, Any], kind: str) -> str:
    """The `id` of a file or batch object the server returned."""
    value = obj.get("id")
    if not isinstance(value, str) or not value:
        raise BatchGenClientError(f"the server returned a {kind} object without an id: {obj!r}")
    return value
