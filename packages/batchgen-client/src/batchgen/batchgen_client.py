"""The user guide's import path: `from batchgen.batchgen_client import BatchGenHttpClient`.

A re-export of `batchgen.client`'s two clients; everything else lives in `batchgen.client`.
"""

from batchgen.client import AsyncBatchGenClient, BatchGenHttpClient

__all__ = ["AsyncBatchGenClient", "BatchGenHttpClient"]
