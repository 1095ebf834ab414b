"""The two faces of the client: `BatchGenHttpClient` (sync) and `AsyncBatchGenClient` (async).

Both only send and sleep. Request building and response reading live in `_requests`, the retry
decision in `_retry`, the polling decisions in `_wait` and `_follow`, the progress line in
`_progress`, local files in `_files`. What remains here is `_BaseClient` (configuration, and what
to do after a failed attempt), then per face the send loop and one short method per API call,
with the same names and parameters on both faces.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import ExitStack
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx

from batchgen.client import _requests as req
from batchgen.client._files import endpoint_of, partial_download
from batchgen.client._follow import ResultFollower, ResultTail
from batchgen.client._requests import (
    DEFAULT_BASE_URL,
    DEFAULT_TIMEOUT,
    JSONObject,
    RequestSpec,
    StrPath,
)
from batchgen.client._retry import (
    RetryPolicy,
    error_delay,
    is_retryable,
    next_delay,
    should_retry,
    should_retry_error,
)
from batchgen.client._wait import Wait, check_poll_interval, finish_wait, is_terminal

__all__ = ["AsyncBatchGenClient", "BatchGenHttpClient"]

logger = logging.getLogger("batchgen.client")

DEFAULT_RETRY = RetryPolicy()

try:
    _VERSION = version("batchgen-client")
except PackageNotFoundError:  # running from a source tree
    _VERSION = "0+unknown"
USER_AGENT = f"batchgen-client/{_VERSION}"

ProgressCallback = Callable[[JSONObject], object]
"""`on_progress`: called with the batch object after each poll (the async client awaits a
coroutine function's result)."""


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

    def _call(self, spec: RequestSpec) -> JSONObject:
        return req.parse_object(spec, self._send(spec))

    # --- files ----------------------------------------------------------------------------------

    def upload_file(
        self, path: StrPath, purpose: str = "batch", *, idempotency_key: str | None = None
    ) -> JSONObject:
        """Upload a file, streamed from disk and re-read from the start on a retry. Every attempt
        sends one `Idempotency-Key` (as `create_batch` does), so a retry never stores it twice."""
        return self._call(req.upload_file(path, purpose, idempotency_key=idempotency_key))

    def list_files(
        self,
        after: str | None = None,
        limit: int | None = None,
        order: str | None = None,
        purpose: str | None = None,
    ) -> JSONObject:
        return self._call(req.list_files(after, limit, order, purpose))

    def get_file(self, file_id: str) -> JSONObject:
        return self._call(req.get_file(file_id))

    def delete_file(self, file_id: str) -> JSONObject:
        return self._call(req.delete_file(file_id))

    def download_file_content(self, file_id: str) -> bytes:
        """A file's whole content, in memory. For large outputs prefer `download_file_to`."""
        return self._send(req.file_content(file_id)).content

    def download_file_to(self, file_id: str, path: StrPath) -> Path:
        """Stream a file's content to `path` (via `<path>.part`, renamed once complete)."""
        spec = req.file_content(file_id)
        response = self._send(spec, stream=True)
        try:
            with partial_download(path) as out, req.translate_transport_errors(spec):
                for chunk in response.iter_bytes():
                    out.write(chunk)
        finally:
            response.close()
        return Path(path)

    # --- batches --------------------------------------------------------------------------------

    def create_batch(
        self,
        input_file_id: str,
        endpoint: str = req.DEFAULT_ENDPOINT,
        completion_window: str = "24h",
        metadata: Mapping[str, str] | None = None,
        max_decoding_length: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> JSONObject:
        """Create a batch. Every attempt sends one `Idempotency-Key`: `idempotency_key`, or a
        fresh uuid4 per call, so a create retried after a lost response is not run twice."""
        spec = req.create_batch(
            input_file_id,
            endpoint,
            completion_window,
            metadata,
            max_decoding_length,
            temperature,
            top_p,
            top_k,
            idempotency_key=idempotency_key,
        )
        return self._call(spec)

    def get_batch(self, batch_id: str) -> JSONObject:
        return self._call(req.get_batch(batch_id))

    def list_batches(self, after: str | None = None, limit: int | None = None) -> JSONObject:
        return self._call(req.list_batches(after, limit))

    def cancel_batch(self, batch_id: str) -> JSONObject:
        return self._call(req.cancel_batch(batch_id))

    def wait_for_batch(
        self,
        batch_id: str,
        poll_interval: float = 10.0,
        timeout: float | None = None,
        *,
        raise_on_failure: bool = False,
        progress: bool | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> JSONObject:
        """Poll until the batch is completed, failed, expired or cancelled, and return it.

        With `raise_on_failure`, an ending other than completed raises `BatchFailed`. If `timeout`
        seconds pass first, `BatchWaitTimeout` is raised (the batch keeps running). `progress`
        draws a progress line on stderr (None: only if stderr is a terminal); `on_progress` is
        called with the batch after every poll.
        """
        with Wait(batch_id, poll_interval, timeout, progress=progress) as wait:
            while True:
                batch = self.get_batch(batch_id)
                if on_progress is not None:
                    on_progress(batch)
                delay = wait.next_delay(batch)
                if delay is None:
                    return finish_wait(batch, raise_on_failure=raise_on_failure)
                self.retry.sleep(delay)

    def follow_results(
        self, batch_id: str, *, poll_interval: float = 2.0, errors: bool = False
    ) -> Iterator[str]:
        """Yield the batch's output lines (JSON text) as the server writes them, until it has ended.

        Each poll fetches only the part of the output file not read yet. With `errors`, lines of
        the error file are yielded too. Ends once the batch is terminal and every line was yielded.
        """
        check_poll_interval(poll_interval)
        follower = ResultFollower(errors=errors)
        while True:
            batch = self.get_batch(batch_id)
            for tail in follower.tails(batch):
                yield from self._read_new_lines(tail)
            if is_terminal(batch):
                yield from follower.finish()
                return
            self.retry.sleep(poll_interval)

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

    def submit_batch(
        self,
        input_file_path: StrPath,
        output_file_path: StrPath | None = None,
        endpoint: str | None = None,
        *,
        poll_interval: float = 10.0,
        timeout: float | None = None,
        completion_window: str = "24h",
        metadata: Mapping[str, str] | None = None,
        max_decoding_length: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        error_file_path: StrPath | None = None,
        raise_on_failure: bool = False,
        progress: bool | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> JSONObject:
        """Upload → create → wait → download; returns the final batch.

        `endpoint` None means the `url` of the file's first request. The output (and, if
        `error_file_path` is given, the error file) is downloaded whenever the final batch names
        one — a failed or cancelled batch may carry partial results. `progress` and `on_progress`
        are `wait_for_batch`'s.
        """
        check_poll_interval(poll_interval)
        if endpoint is None:
            endpoint = endpoint_of(input_file_path)
        uploaded = self.upload_file(input_file_path, purpose="batch")
        created = self.create_batch(
            req.object_id(uploaded, "file"),
            endpoint,
            completion_window,
            metadata,
            max_decoding_length,
            temperature,
            top_p,
            top_k,
        )
        batch = self.wait_for_batch(
            req.object_id(created, "batch"),
            poll_interval=poll_interval,
            timeout=timeout,
            progress=progress,
            on_progress=on_progress,
        )
        for file_id, path in req.result_downloads(batch, output_file_path, error_file_path):
            self.download_file_to(file_id, path)
        return finish_wait(batch, raise_on_failure=raise_on_failure)

    # --- server ---------------------------------------------------------------------------------

    def pool_status(self) -> JSONObject:
        return self._call(req.pool_status())

    def health(self) -> JSONObject:
        """`{"status": "healthy"}`, or the 503 body `{"status": "unhealthy", ...}`; not retried."""
        return self._call(req.health())

    def list_models(self) -> JSONObject:
        return self._call(req.list_models())


class AsyncBatchGenClient(_BaseClient):
    """Asynchronous client: the same methods as `BatchGenHttpClient`, awaitable.

    Use it as an async context manager, or call `aclose()`. Waits use `retry.async_sleep`.
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

    async def _call(self, spec: RequestSpec) -> JSONObject:
        return req.parse_object(spec, await self._send(spec))

    # --- files ----------------------------------------------------------------------------------

    async def upload_file(
        self, path: StrPath, purpose: str = "batch", *, idempotency_key: str | None = None
    ) -> JSONObject:
        """Upload a file, streamed from disk and re-read from the start on a retry. Every attempt
        sends one `Idempotency-Key` (as `create_batch` does), so a retry never stores it twice."""
        return await self._call(req.upload_file(path, purpose, idempotency_key=idempotency_key))

    async def list_files(
        self,
        after: str | None = None,
        limit: int | None = None,
        order: str | None = None,
        purpose: str | None = None,
    ) -> JSONObject:
        return await self._call(req.list_files(after, limit, order, purpose))

    async def get_file(self, file_id: str) -> JSONObject:
        return await self._call(req.get_file(file_id))

    async def delete_file(self, file_id: str) -> JSONObject:
        return await self._call(req.delete_file(file_id))

    async def download_file_content(self, file_id: str) -> bytes:
        """A file's whole content, in memory. For large outputs prefer `download_file_to`."""
        return (await self._send(req.file_content(file_id))).content

    async def download_file_to(self, file_id: str, path: StrPath) -> Path:
        """Stream a file's content to `path` (via `<path>.part`, renamed once complete)."""
        spec = req.file_content(file_id)
        response = await self._send(spec, stream=True)
        try:
            with partial_download(path) as out, req.translate_transport_errors(spec):
                async for chunk in response.aiter_bytes():
                    out.write(chunk)
        finally:
            await response.aclose()
        return Path(path)

    # --- batches --------------------------------------------------------------------------------

    async def create_batch(
        self,
        input_file_id: str,
        endpoint: str = req.DEFAULT_ENDPOINT,
        completion_window: str = "24h",
        metadata: Mapping[str, str] | None = None,
        max_decoding_length: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> JSONObject:
        """Create a batch. Every attempt sends one `Idempotency-Key`: `idempotency_key`, or a
        fresh uuid4 per call, so a create retried after a lost response is not run twice."""
        spec = req.create_batch(
            input_file_id,
            endpoint,
            completion_window,
            metadata,
            max_decoding_length,
            temperature,
            top_p,
            top_k,
            idempotency_key=idempotency_key,
        )
        return await self._call(spec)

    async def get_batch(self, batch_id: str) -> JSONObject:
        return await self._call(req.get_batch(batch_id))

    async def list_batches(self, after: str | None = None, limit: int | None = None) -> JSONObject:
        return await self._call(req.list_batches(after, limit))

    async def cancel_batch(self, batch_id: str) -> JSONObject:
        return await self._call(req.cancel_batch(batch_id))

    async def wait_for_batch(
        self,
        batch_id: str,
        poll_interval: float = 10.0,
        timeout: float | None = None,
        *,
        raise_on_failure: bool = False,
        progress: bool | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> JSONObject:
        """Poll until the batch is completed, failed, expired or cancelled, and return it.

        With `raise_on_failure`, an ending other than completed raises `BatchFailed`. If `timeout`
        seconds pass first, `BatchWaitTimeout` is raised (the batch keeps running). `progress`
        draws a progress line on stderr (None: only if stderr is a terminal); `on_progress` is
        called with the batch after every poll, and awaited if it returns an awaitable.
        """
        with Wait(batch_id, poll_interval, timeout, progress=progress) as wait:
            while True:
                batch = await self.get_batch(batch_id)
                if on_progress is not None:
                    result = on_progress(batch)
                    if inspect.isawaitable(result):
                        await result
                delay = wait.next_delay(batch)
                if delay is None:
                    return finish_wait(batch, raise_on_failure=raise_on_failure)
                await self.retry.async_sleep(delay)

    async def follow_results(
        self, batch_id: str, *, poll_interval: float = 2.0, errors: bool = False
    ) -> AsyncIterator[str]:
        """Yield the batch's output lines (JSON text) as the server writes them, until it has ended.

        Each poll fetches only the part of the output file not read yet. With `errors`, lines of
        the error file are yielded too. Ends once the batch is terminal and every line was yielded.
        """
        check_poll_interval(poll_interval)
        follower = ResultFollower(errors=errors)
        while True:
            batch = await self.get_batch(batch_id)
            for tail in follower.tails(batch):
                async for line in self._read_new_lines(tail):
                    yield line
            if is_terminal(batch):
                for line in follower.finish():
                    yield line
                return
            await self.retry.async_sleep(poll_interval)

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

    async def submit_batch(
        self,
        input_file_path: StrPath,
        output_file_path: StrPath | None = None,
        endpoint: str | None = None,
        *,
        poll_interval: float = 10.0,
        timeout: float | None = None,
        completion_window: str = "24h",
        metadata: Mapping[str, str] | None = None,
        max_decoding_length: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        error_file_path: StrPath | None = None,
        raise_on_failure: bool = False,
        progress: bool | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> JSONObject:
        """Upload → create → wait → download; returns the final batch.

        `endpoint` None means the `url` of the file's first request. The output (and, if
        `error_file_path` is given, the error file) is downloaded whenever the final batch names
        one — a failed or cancelled batch may carry partial results. `progress` and `on_progress`
        are `wait_for_batch`'s.
        """
        check_poll_interval(poll_interval)
        if endpoint is None:
            endpoint = endpoint_of(input_file_path)
        uploaded = await self.upload_file(input_file_path, purpose="batch")
        created = await self.create_batch(
            req.object_id(uploaded, "file"),
            endpoint,
            completion_window,
            metadata,
            max_decoding_length,
            temperature,
            top_p,
            top_k,
        )
        batch = await self.wait_for_batch(
            req.object_id(created, "batch"),
            poll_interval=poll_interval,
            timeout=timeout,
            progress=progress,
            on_progress=on_progress,
        )
        for file_id, path in req.result_downloads(batch, output_file_path, error_file_path):
            await self.download_file_to(file_id, path)
        return finish_wait(batch, raise_on_failure=raise_on_failure)

    # --- server ---------------------------------------------------------------------------------

    async def pool_status(self) -> JSONObject:
        return await self._call(req.pool_status())

    async def health(self) -> JSONObject:
        """`{"status": "healthy"}`, or the 503 body `{"status": "unhealthy", ...}`; not retried."""
        return await self._call(req.health())

    async def list_models(self) -> JSONObject:
        return await self._call(req.list_models())
