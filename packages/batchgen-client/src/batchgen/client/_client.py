"""The two faces of the client: `BatchGenHttpClient` (sync) and `AsyncBatchGenClient` (async).

Both only send and sleep. Each public method is defined once for both faces by a builder (its
parameters, docstring and request building: `_requests`, `_wait`, `_follow`, `_submit`, `_files`)
and joined to the face's runner by `_methods`. The retry decision lives in `_retry`, the progress
line in `_progress`. What remains here is `_BaseClient` (configuration, and what to do after a
failed attempt), then per face its send loop and its runners, then the table of its methods.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx

from batchgen.client import _chunked as chunks
from batchgen.client import _files as files
from batchgen.client import _follow as follows
from batchgen.client import _requests as req
from batchgen.client import _retries as retries
from batchgen.client import _submit as submits
from batchgen.client import _wait as waits
from batchgen.client._chunked import ChunkedUpload, completed_file, part_id
from batchgen.client._exceptions import APIStatusError
from batchgen.client._files import Download, partial_download
from batchgen.client._follow import Following, ResultTail
from batchgen.client._line_errors import LineTally
from batchgen.client._methods import async_method, method
from batchgen.client._requests import DEFAULT_BASE_URL, DEFAULT_TIMEOUT, JSONObject, RequestSpec
from batchgen.client._retries import RetryRounds
from batchgen.client._retry import (
    RetryPolicy,
    error_delay,
    is_retryable,
    next_delay,
    should_retry,
    should_retry_error,
)
from batchgen.client._submit import Submission
from batchgen.client._wait import Wait, is_terminal

__all__ = ["AsyncBatchGenClient", "BatchGenHttpClient"]

logger = logging.getLogger("batchgen.client")

DEFAULT_RETRY = RetryPolicy()

try:
    _VERSION = version("batchgen-client")
except PackageNotFoundError:  # running from a source tree
    _VERSION = "0+unknown"
USER_AGENT = f"batchgen-client/{_VERSION}"


class _BaseClient:
    """What both faces share and that does no I/O: configuration, and after a failed attempt,
    how long to wait before the next one or which exception to raise."""

    def __init__(self, base_url: str, *, retry: RetryPolicy, api_key: str | None) -> None:
        self.base_url = req.normalize_base_url(base_url)
        self.retry = retry
        self._headers = {"User-Agent": USER_AGENT}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def _delay_after_status(self, spec: RequestSpec, response: httpx.Response, attempt: int) -> float:
        """Seconds to wait before retrying an error response (its body read); or raise its error."""
        status = response.status_code
        if not spec.retry or not should_retry(self.retry, status, attempt):
            exhausted = spec.retry and is_retryable(self.retry, status)
            raise req.error_from_response(spec, response, attempts=attempt, exhausted=exhausted)
        delay = next_delay(self.retry, attempt, response.headers)
        self._log_retry(spec, f"returned HTTP {status}", attempt, delay)
        return delay

    def _delay_after_error(self, spec: RequestSpec, error: httpx.TransportError, attempt: int) -> float:
        """Seconds to wait before retrying a request that got no response; or raise the error."""
        if not spec.retry or not should_retry_error(self.retry, error, attempt):
            raise req.transport_error(spec, error, attempts=attempt) from error
        delay = error_delay(self.retry, attempt)
        self._log_retry(spec, f"failed ({error!r})", attempt, delay)
        return delay

    def _log_retry(self, spec: RequestSpec, outcome: str, attempt: int, delay: float) -> None:
        logger.info(
            "%s %s; retry %d of %d in %.1f s",
            spec.describe(),
            outcome,
            attempt,
            self.retry.max_retries,
            delay,
        )

    @staticmethod
    def _log_response(spec: RequestSpec, response: httpx.Response) -> None:
        logger.debug("%s -> HTTP %d", spec.describe(), response.status_code)


class BatchGenHttpClient(_BaseClient):
    """Synchronous client for a BatchGen server. Use it as a context manager, or call `close()`.

    Every method returns the server's JSON object as a dict (`batch["status"]`). A retryable
    status (429, 503), a connection error or a timeout is retried per `retry`; other error
    statuses raise `APIStatusError`; when retries run out, `RetriesExhausted` (a status) or
    `APIConnectionError` (no answer) is raised, both RuntimeErrors.
    `transport` is handed to httpx (tests pass an `httpx.MockTransport`).
    """

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        retry: RetryPolicy = DEFAULT_RETRY,
        transport: httpx.BaseTransport | None = None,
        api_key: str | None = None,
    ) -> None:
        super().__init__(base_url, retry=retry, api_key=api_key)
        self._http = httpx.Client(
            base_url=self.base_url,
            timeout=timeout,
            transport=transport,
            headers=self._headers,
        )

    # --- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    @property
    def is_closed(self) -> bool:
        return self._http.is_closed

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # --- the send loop --------------------------------------------------------------------------

    def _send(self, spec: RequestSpec, *, stream: bool = False) -> httpx.Response:
        attempt = 1
        while True:
            try:
                with ExitStack() as stack:
                    request = req.build_request(self._http, spec, stack)
                    response = self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                delay = self._delay_after_error(spec, exc, attempt)
            else:
                self._log_response(spec, response)
                if spec.accepts(response.status_code):
                    return response
                if stream:
                    with req.translate_transport_errors(spec):
                        response.read()
                    response.close()
                delay = self._delay_after_status(spec, response, attempt)
            self.retry.sleep(delay)
            attempt += 1

    # --- the runners: what each kind of method sends -------------------------------------------

    def _call(self, spec: RequestSpec) -> JSONObject:
        return req.parse_object(spec, self._send(spec))

    def _content(self, spec: RequestSpec) -> bytes:
        return self._send(spec).content

    def _download(self, download: Download) -> Path:
        response = self._send(download.spec, stream=True)
        try:
            with partial_download(download.path) as out, req.translate_transport_errors(download.spec):
                for chunk in response.iter_bytes():
                    out.write(chunk)
        finally:
            response.close()
        return download.path

    def _wait(self, wait: Wait) -> JSONObject:
        with wait:
            while True:
                batch = self._call(wait.poll())
                if wait.on_progress is not None:
                    wait.on_progress(batch)
                delay = wait.next_delay(batch)
                if delay is None:
                    return wait.finish(batch)
                self.retry.sleep(delay)

    def _follow(self, following: Following) -> Iterator[str]:
        while True:
            batch = self._call(following.poll())
            for tail in following.tails(batch):
                yield from self._read_new_lines(tail)
            if is_terminal(batch):
                yield from following.finish()
                return
            self.retry.sleep(following.poll_interval)

    def _read_new_lines(self, tail: ResultTail) -> Iterator[str]:
        spec = tail.request()
        response = self._send(spec, stream=True)
        try:
            tail.start(response.status_code)
            with req.translate_transport_errors(spec):
                for chunk in response.iter_bytes():
                    yield from tail.feed(chunk)
        finally:
            response.close()

    def _chunked(self, chunked: ChunkedUpload) -> JSONObject:
        upload = self._call(chunked.create())
        part_ids = [part_id(self._call(chunked.part(upload, index))) for index in range(chunked.part_count)]
        return self._call(chunked.complete(upload, part_ids))

    def _submit(self, submission: Submission) -> JSONObject:
        if submission.chunked is not None:
            uploaded = completed_file(self._chunked(submission.chunked))
        else:
            uploaded = self._call(submission.upload())
        created = self._call(submission.create(uploaded))
        batch = self._wait(submission.wait(created))
        rounds, last = submission.rounds(batch), None
        if rounds is not None:
            batch, last = self._retry_rounds(rounds, batch)
        for download in submission.downloads(batch):
            self._download(download)
        return submission.finish(batch, last)

    def _retry_rounds(self, rounds: RetryRounds, latest: JSONObject) -> tuple[JSONObject, JSONObject | None]:
        """Retry until nothing is left or the rounds run out: (the first batch again, the last retry)."""
        last = None
        while (merged := rounds.merged(latest)) is not None:
            spec = rounds.retry(self._tally(merged))
            if spec is None:  # every failure left is one no retry can fix
                break
            try:
                created = self._call(spec)
            except APIStatusError as exc:
                rounds.stop_on(exc)
                break
            latest = last = self._wait(rounds.wait(created))
        return self._call(rounds.original()), last

    def _tally(self, spec: RequestSpec) -> LineTally:
        """The tally of the result lines `spec` answers with, read as they arrive."""
        tally = LineTally()
        response = self._send(spec, stream=True)
        try:
            with req.translate_transport_errors(spec):
                for chunk in response.iter_bytes():
                    tally.feed(chunk)
        finally:
            response.close()
        return tally.finish()

    # --- the methods: one builder each, shared with AsyncBatchGenClient ------------------------

    upload_file = method(req.upload_file, _call)
    upload_file_chunked = method(chunks.upload_file_chunked, _chunked)
    list_files = method(req.list_files, _call)
    get_file = method(req.get_file, _call)
    delete_file = method(req.delete_file, _call)
    download_file_content = method(req.download_file_content, _content)
    download_file_to = method(files.download_file_to, _download)
    create_batch = method(req.create_batch, _call)
    get_batch = method(req.get_batch, _call)
    list_batches = method(req.list_batches, _call)
    cancel_batch = method(req.cancel_batch, _call)
    retry_batch = method(retries.retry_batch, _call)
    download_merged_results = method(retries.download_merged_results, _content)
    download_merged_results_to = method(retries.download_merged_results_to, _download)
    wait_for_batch = method(waits.wait_for_batch, _wait)
    follow_results = method(follows.follow_results, _follow)
    submit_batch = method(submits.submit_batch, _submit)
    pool_status = method(req.pool_status, _call)
    health = method(req.health, _call)
    list_models = method(req.list_models, _call)


class AsyncBatchGenClient(_BaseClient):
    """Asynchronous client: the same methods as `BatchGenHttpClient`, awaitable.

    Use it as an async context manager, or call `aclose()`. Waits use `retry.async_sleep`.
    `follow_results` returns an async iterator.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        retry: RetryPolicy = DEFAULT_RETRY,
        transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None,
    ) -> None:
        super().__init__(base_url, retry=retry, api_key=api_key)
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=timeout,
            transport=transport,
            headers=self._headers,
        )

    # --- lifecycle ------------------------------------------------------------------------------

    async def aclose(self) -> None:
        await self._http.aclose()

    @property
    def is_closed(self) -> bool:
        return self._http.is_closed

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    # --- the send loop --------------------------------------------------------------------------

    async def _send(self, spec: RequestSpec, *, stream: bool = False) -> httpx.Response:
        attempt = 1
        while True:
            try:
                with ExitStack() as stack:
                    request = req.build_request(self._http, spec, stack)
                    response = await self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                delay = self._delay_after_error(spec, exc, attempt)
            else:
                self._log_response(spec, response)
                if spec.accepts(response.status_code):
                    return response
                if stream:
                    with req.translate_transport_errors(spec):
                        await response.aread()
                    await response.aclose()
                delay = self._delay_after_status(spec, response, attempt)
            await self.retry.async_sleep(delay)
            attempt += 1

    # --- the runners: what each kind of method sends -------------------------------------------

    async def _call(self, spec: RequestSpec) -> JSONObject:
        return req.parse_object(spec, await self._send(spec))

    async def _content(self, spec: RequestSpec) -> bytes:
        return (await self._send(spec)).content

    async def _download(self, download: Download) -> Path:
        response = await self._send(download.spec, stream=True)
        try:
            with partial_download(download.path) as out, req.translate_transport_errors(download.spec):
                async for chunk in response.aiter_bytes():
                    out.write(chunk)
        finally:
            await response.aclose()
        return download.path

    async def _wait(self, wait: Wait) -> JSONObject:
        with wait:
            while True:
                batch = await self._call(wait.poll())
                if wait.on_progress is not None:
                    result = wait.on_progress(batch)
                    if inspect.isawaitable(result):
                        await result
                delay = wait.next_delay(batch)
                if delay is None:
                    return wait.finish(batch)
                await self.retry.async_sleep(delay)

    async def _follow(self, following: Following) -> AsyncIterator[str]:
        while True:
            batch = await self._call(following.poll())
            for tail in following.tails(batch):
                async for line in self._read_new_lines(tail):
                    yield line
            if is_terminal(batch):
                for line in following.finish():
                    yield line
                return
            await self.retry.async_sleep(following.poll_interval)

    async def _read_new_lines(self, tail: ResultTail) -> AsyncIterator[str]:
        spec = tail.request()
        response = await self._send(spec, stream=True)
        try:
            tail.start(response.status_code)
            with req.translate_transport_errors(spec):
                async for chunk in response.aiter_bytes():
                    for line in tail.feed(chunk):
                        yield line
        finally:
            await response.aclose()

    async def _chunked(self, chunked: ChunkedUpload) -> JSONObject:
        upload = await self._call(chunked.create())
        part_ids = []
        for index in range(chunked.part_count):
            part_ids.append(part_id(await self._call(chunked.part(upload, index))))
        return await self._call(chunked.complete(upload, part_ids))

    async def _submit(self, submission: Submission) -> JSONObject:
        if submission.chunked is not None:
            uploaded = completed_file(await self._chunked(submission.chunked))
        else:
            uploaded = await self._call(submission.upload())
        created = await self._call(submission.create(uploaded))
        batch = await self._wait(submission.wait(created))
        rounds, last = submission.rounds(batch), None
        if rounds is not None:
            batch, last = await self._retry_rounds(rounds, batch)
        for download in submission.downloads(batch):
            await self._download(download)
        return submission.finish(batch, last)

    async def _retry_rounds(
        self, rounds: RetryRounds, latest: JSONObject
    ) -> tuple[JSONObject, JSONObject | None]:
        """Retry until nothing is left or the rounds run out: (the first batch again, the last retry)."""
        last = None
        while (merged := rounds.merged(latest)) is not None:
            spec = rounds.retry(await self._tally(merged))
            if spec is None:  # every failure left is one no retry can fix
                break
            try:
                created = await self._call(spec)
            except APIStatusError as exc:
                rounds.stop_on(exc)
                break
            latest = last = await self._wait(rounds.wait(created))
        return await self._call(rounds.original()), last

    async def _tally(self, spec: RequestSpec) -> LineTally:
        """The tally of the result lines `spec` answers with, read as they arrive."""
        tally = LineTally()
        response = await self._send(spec, stream=True)
        try:
            with req.translate_transport_errors(spec):
                async for chunk in response.aiter_bytes():
                    tally.feed(chunk)
        finally:
            await response.aclose()
        return tally.finish()

    # --- the methods: one builder each, shared with BatchGenHttpClient -------------------------

    upload_file = async_method(req.upload_file, _call)
    upload_file_chunked = async_method(chunks.upload_file_chunked, _chunked)
    list_files = async_method(req.list_files, _call)
    get_file = async_method(req.get_file, _call)
    delete_file = async_method(req.delete_file, _call)
    download_file_content = async_method(req.download_file_content, _content)
    download_file_to = async_method(files.download_file_to, _download)
    create_batch = async_method(req.create_batch, _call)
    get_batch = async_method(req.get_batch, _call)
    list_batches = async_method(req.list_batches, _call)
    cancel_batch = async_method(req.cancel_batch, _call)
    retry_batch = async_method(retries.retry_batch, _call)
    download_merged_results = async_method(retries.download_merged_results, _content)
    download_merged_results_to = async_method(retries.download_merged_results_to, _download)
    wait_for_batch = async_method(waits.wait_for_batch, _wait)
    follow_results = method(follows.follow_results, _follow)
    submit_batch = async_method(submits.submit_batch, _submit)
    pool_status = async_method(req.pool_status, _call)
    health = async_method(req.health, _call)
    list_models = async_method(req.list_models, _call)
