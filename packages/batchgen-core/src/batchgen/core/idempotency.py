"""The idempotency ledger: an ``Idempotency-Key`` and the object the first call with it made.

A call carrying a key is fingerprinted (a hash of its arguments). A repeat with the same key and
fingerprint gets the first call's object back; the same key with other arguments is a Conflict.
A key must be 1 to ``MAX_KEY_LENGTH`` characters (an empty key would be shared by every caller)
with no control character (the stored key joins tenant and key with one, ``tenancy.scoped_key``).
When the object a key made is gone (a file deleted since), the key is forgotten, so the repeat
makes a new object instead of answering 404 for ever.

Versions before every tenant's keys were scoped stored the default tenant's keys as given; a
default-tenant key not found scoped is looked up that old way too (such a key holds no control
character, so it cannot be another tenant's scoped key), and answers as before.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from batchgen.core.errors import Conflict, InvalidRequest
from batchgen.core.models import DEFAULT_TENANT
from batchgen.core.storage import IdempotencyRecord, MetadataStore
from batchgen.core.storage.metadata_calls import MetadataCalls
from batchgen.core.tenancy import scoped_key

MAX_KEY_LENGTH = 255


def fingerprint(*parts: Any) -> str:
    """A stable hash of a call's arguments (dict order does not matter)."""
    return hashlib.sha256(msgspec.json.encode(parts, order="sorted")).hexdigest()


def check_key(key: str) -> None:
    """InvalidRequest unless ``key`` is a usable Idempotency-Key (1 to MAX_KEY_LENGTH characters,
    none of them a control character)."""
    if not key:
        raise InvalidRequest("Idempotency-Key must not be empty", param="Idempotency-Key")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidRequest(
            f"Idempotency-Key is {len(key)} characters; the limit is {MAX_KEY_LENGTH}",
            param="Idempotency-Key",
        )
    if any(ord(char) < 0x20 or 0x7F <= ord(char) < 0xA0 for char in key):
        raise InvalidRequest("Idempotency-Key must not hold control characters", param="Idempotency-Key")


class IdempotencyLedger:
    """Keys recorded in the metadata store, each scoped to the kind of object it made."""

    def __init__(self, metadata: MetadataStore, calls: MetadataCalls) -> None:
        self._metadata = metadata
        self._calls = calls

    async def replay(
        self, key: str, scope: str, call_fingerprint: str, tenant: str = DEFAULT_TENANT
    ) -> str | None:
        """The id of the object an earlier call with this key made, if it still exists, or None.

        Keys are per tenant: another tenant's key of the same name is a different key.
        InvalidRequest for an empty or too long key; Conflict when the key was used for a
        different call.
        """
        check_key(key)
        stored_key = scoped_key(tenant, key)
        recorded = await self._calls(self._metadata.get_idempotency_key, stored_key)
        if recorded is None and tenant == DEFAULT_TENANT:  # stored by an older version
            stored_key = key
            recorded = await self._calls(self._metadata.get_idempotency_key, stored_key)
        if recorded is None:
            return None
        recorded_scope, recorded_fingerprint, object_id = recorded
        if recorded_scope != scope or recorded_fingerprint != call_fingerprint:
            raise Conflict(
                f"Idempotency-Key '{key}' was already used with a different request; "
                "use a new key for a new request."
            )
        if not await self._exists(scope, object_id):
            await self._calls(self._metadata.delete_idempotency_key, stored_key)
            return None
        return object_id

    async def _exists(self, scope: str, object_id: str) -> bool:
        if scope == "file":
            return await self._calls(self._metadata.get_file, object_id) is not None
        if scope == "batch":
            return await self._calls(self._metadata.get_batch, object_id) is not None
        return True

    @staticmethod
    def entry(
        key: str | None, scope: str, call_fingerprint: str, created_at: int, tenant: str = DEFAULT_TENANT
    ) -> IdempotencyRecord | None:
        """What to record with the new object (in the same step as it, see ``MetadataStore``)."""
        if key is None:
            return None
        return IdempotencyRecord(scoped_key(tenant, key), scope, call_fingerprint, created_at)
