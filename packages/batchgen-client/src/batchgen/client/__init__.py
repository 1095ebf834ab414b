"""batchgen.client — sync and async HTTP clients for the BatchGen Batch API.

    from batchgen.client import BatchGenHttpClient

    with BatchGenHttpClient("http://localhost:10900") as client:
        batch = client.submit_batch("input.jsonl", output_file_path="output.jsonl")

Retries (429, 503, connection errors, timeouts), Idempotency-Keys, streamed files, progress and
`follow_results` are described in docs/client.md. The `batchgen` command is `batchgen.client.cli`.
The implementation modules are private; this namespace is the public API.
"""

from batchgen.client._cache_savings import CacheSavings, cache_savings
from batchgen.client._client import AsyncBatchGenClient, BatchGenHttpClient
from batchgen.client._exceptions import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    BatchFailed,
    BatchGenClientError,
    BatchWaitTimeout,
    RetriesExhausted,
)
from batchgen.client._requests import DEFAULT_BASE_URL, TERMINAL_STATUSES
from batchgen.client._retry import RetryPolicy

__all__ = [
    "DEFAULT_BASE_URL",
    "TERMINAL_STATUSES",
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncBatchGenClient",
    "BatchFailed",
    "BatchGenClientError",
    "BatchGenHttpClient",
    "BatchWaitTimeout",
    "CacheSavings",
    "RetriesExhausted",
    "RetryPolicy",
    "cache_savings",
]
