"""The idempotency ledger: an ``Idempotency-Key`` and the object the first call with it made.

A call carrying a key is fingerprinted (a hash of its arguments). A repeat with the same key and
fingerprint gets the first call's object back; the same key with other arguments is a Conflict.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from batchgen.core.errors import Conflict
from batchgen.core.storage import IdempotencyRecord, MetadataStore


def fingerprint(*parts: Any) -> str:
    """A stable hash of a call's arguments (dict order does not matter)."""
    return hashlib.sha256(msgspec.json.encode(parts, order="sorted")).hexdigest()


class IdempotencyLedger:
    """Keys recorded in the metadata store, each scoped to the kind of object it made."""

    def __init__(self, metadata: MetadataStore) -> None:
        self._metadata = metadata

    def replay(self, key: str, scope: str, call_fingerprint: str) -> str | None:
        """The id an earlier call with this key made, or None; Conflict on a different call."""
        recorded = self._metadata.get_idempotency_key(key)
        if recorded is None:
            return None
        recorded_scope, recorded_fingerprint, object_id = recorded
        if recorded_scope != scope or recorded_fingerprint != call_fingerprint:
            raise Conflict(
                f"Idempotency-Key '{key}' was already used with a different request; "
                "use a new key for a new request."
            )
        return object_id

    @staticmethod
    def entry(
        key: str | None, scope: str, call_fingerprint: str, created_at: int
    ) -> IdempotencyRecord | None:
        """What to record with the new object (in the same step as it, see ``MetadataStore``)."""
        return None if key is None else IdempotencyRecord(key, scope, call_fingerprint, created_at)
