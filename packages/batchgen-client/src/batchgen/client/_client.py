"""The two faces of the client: `BatchGenHttpClient` (sync) and `AsyncBatchGenClient` (async).

Both only send. Request building and response reading live in `_requests`, the retry decision in
`_retry`, local files in `_files`; what remains here is the send loop (written once per face) and
one short method per API call, with the same names and parameters on both faces.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from contextlib import ExitStack
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import TracebackType
from typing import Self

import httpx

from batchgen.client import _requests as req
from batchgen.client._exceptions import APIStatusError, BatchWaitTimeout
from batchgen.client._files import endpoint_of, partial_download
from batchgen.client._requests import (
    DEFAULT_BASE_URL,
    DEFAULT_TIMEOUT,
    JSONObject,
    RequestSpec,
    StrPath,
)
from batchgen.client._retry import RetryPolicy, is_retryable, next_delay, should_retry

__all__ = ["AsyncBatchGenClient", "BatchGenHttpClient"]

logger = logging.getLogger("batchgen.client")

DEFAULT_RETRY = RetryPolicy()

try:
    _VERSION = version("batchgen-client")
except PackageNotFoundError:  # running from a source tree
    _VERSION = "0+unknown"
USER_AGENT = f"batchgen-client/{_VERSION}"


class _BaseClient:
    """What both faces share and that does no I/O: configuration and the retry decision."""

    def __init__(self, base_url: str, *, retry: RetryPolicy, api_key: str | None) -> None:
        self.base_url = req.normalize_base_url(base_url)
        self.retry = retry
        self._headers = {"User-Agent": USER_AGENT}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def _retry_delay(self, spec: RequestSpec, response: httpx.Response, attempt: int) -> float | None:
        """Seconds to wait before retrying `attempt` (1-based), or None to give up."""
        if not spec.retry or not should_retry(self.retry, response.status_code, attempt):
            return None
        delay = next_delay(self.retry, attempt, response.headers)
        logger.info(
            "%s returned HTTP %d; retry %d of %d in %.1f s",
            spec.describe(),
            response.status_code,
            attempt,
            self.retry.max_retries,
            delay,
        )
        return delay

    def _error(self, spec: RequestSpec, response: httpx.Response, attempts: int) -> APIStatusError:
        exhausted = spec.retry and is_retryable(self.retry, response.status_code)
        return req.error_from_response(spec, response, attempts=attempts, exhausted=exhausted)

    def _log_poll(self, batch: JSONObject) -> None:
        counts = batch.get("request_counts")
        logger.debug("batch %s is %s %s", batch.get("id"), batch.get("status"), counts or "")


class BatchGenHttpClient(_BaseClient):
    """Synchronous client for a BatchGen server. Use it as a context manager, or call `close()`.

    Every method returns the server's JSON object as a dict (`batch["status"]`). Responses with a
    retryable status (429, 503) are retried per `retry`; other error statuses raise
    `APIStatusError`, and exhausted retries raise `RetriesExhausted` (a RuntimeError).
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
            with ExitStack() as stack, req.translate_transport_errors(spec):
                request = req.build_request(self._http, spec, stack)
                response = self._http.send(request, stream=stream)
            if spec.accepts(response.status_code):
                return response
            if stream:
                with req.translate_transport_errors(spec):
                    response.read()
                response.close()
            delay = self._retry_delay(spec, response, attempt)
            if delay is None:
                raise self._error(spec, response, attempt)
            self.retry.sleep(delay)
            attempt += 1

    def _call(self, spec: RequestSpec) -> JSONObject:
        return req.parse_object(spec, self._send(spec))

    # --- files ----------------------------------------------------------------------------------

    def upload_file(self, path: StrPath, purpose: str = "batch") -> JSONObject:
        """Upload a file (streamed from disk; re-read from the start on a retry)."""
        return self._call(req.upload_file(path, purpose))

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
    ) -> JSONObject:
        """Create a batch. One Idempotency-Key (uuid4) is sent on every retry of this call."""
        spec = req.create_batch(
            input_file_id,
            endpoint,
            completion_window,
            metadata,
            max_decoding_length,
            temperature,
            top_p,
            top_k,
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
    ) -> JSONObject:
        """Poll until the batch is completed, failed, expired or cancelled, and return it.

        With `raise_on_failure`, an ending other than completed raises `BatchFailed`. If `timeout`
        seconds pass first, `BatchWaitTimeout` is raised (the batch keeps running).
        """
        req.check_poll_interval(poll_interval)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            batch = self.get_batch(batch_id)
            self._log_poll(batch)
            if req.is_terminal(batch):
                return req.finish_wait(batch, raise_on_failure=raise_on_failure)
            delay = req.poll_delay(poll_interval, deadline, time.monotonic())
            if delay is None:
                raise BatchWaitTimeout(batch_id, timeout or 0.0, batch)
            self.retry.sleep(delay)

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
    ) -> JSONObject:
        """Upload → create → wait → download; returns the final batch.

        `endpoint` None means the `url` of the file's first request. The output (and, if
        `error_file_path` is given, the error file) is downloaded whenever the final batch names
        one — a failed or cancelled batch may carry partial results.
        """
        req.check_poll_interval(poll_interval)
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
        )
        for file_id, path in req.result_downloads(batch, output_file_path, error_file_path):
            self.download_file_to(file_id, path)
        return req.finish_wait(batch, raise_on_failure=raise_on_failure)

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
            with ExitStack() as stack, req.translate_transport_errors(spec):
                request = req.build_request(self._http, spec, stack)
                response = await self._http.send(request, stream=stream)
            if spec.accepts(response.status_code):
                return response
            if stream:
                with req.translate_transport_errors(spec):
                    await response.aread()
                await response.aclose()
            delay = self._retry_delay(spec, response, attempt)
            if delay is None:
                raise self._error(spec, response, attempt)
            await self.retry.async_sleep(delay)
            attempt += 1

    async def _call(self, spec: RequestSpec) -> JSONObject:
        return req.parse_object(spec, await self._send(spec))

    # --- files ----------------------------------------------------------------------------------

    async def upload_file(self, path: StrPath, purpose: str = "batch") -> JSONObject:
        """Upload a file (streamed from disk; re-read from the start on a retry)."""
        return await self._call(req.upload_file(path, purpose))

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
    ) -> JSONObject:
        """Create a batch. One Idempotency-Key (uuid4) is sent on every retry of this call."""
        spec = req.create_batch(
            input_file_id,
            endpoint,
            completion_window,
            metadata,
            max_decoding_length,
            temperature,
            top_p,
            top_k,
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
    ) -> JSONObject:
        """Poll until the batch is completed, failed, expired or cancelled, and return it.

        With `raise_on_failure`, an ending other than completed raises `BatchFailed`. If `timeout`
        seconds pass first, `BatchWaitTimeout` is raised (the batch keeps running).
        """
        req.check_poll_interval(poll_interval)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            batch = await self.get_batch(batch_id)
            self._log_poll(batch)
            if req.is_terminal(batch):
                return req.finish_wait(batch, raise_on_failure=raise_on_failure)
            delay = req.poll_delay(poll_interval, deadline, time.monotonic())
            if delay is None:
                raise BatchWaitTimeout(batch_id, timeout or 0.0, batch)
            await self.retry.async_sleep(delay)

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
    ) -> JSONObject:
        """Upload → create → wait → download; returns the final batch.

        `endpoint` None means the `url` of the file's first request. The output (and, if
        `error_file_path` is given, the error file) is downloaded whenever the final batch names
        one — a failed or cancelled batch may carry partial results.
        """
        req.check_poll_interval(poll_interval)
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
        )
        for file_id, path in req.result_downloads(batch, output_file_path, error_file_path):
            await self.download_file_to(file_id, path)
        return req.finish_wait(batch, raise_on_failure=raise_on_failure)

    # --- server ---------------------------------------------------------------------------------

    async def pool_status(self) -> JSONObject:
        return await self._call(req.pool_status())

    async def health(self) -> JSONObject:
        """`{"status": "healthy"}`, or the 503 body `{"status": "unhealthy", ...}`; not retried."""
        return await self._call(req.health())

    async def list_models(self) -> JSONObject:
        return await self._call(req.list_models())
