"""A tenant's ``max_stored_bytes`` admitted in one step in a single process, whoever stores the bytes.

A tenant holds the bytes of its files (batch results not counted), of the parts of its uploads
not completed yet, and of the files being stored for it right now. ``StoredBytesQuota`` keeps the
last two as running totals and reads the first from the metadata store, and admits new bytes
under a lock per tenant, so two calls at once can never both pass on the same room:

- **A plain upload, or a retry's new input file**, ``reserve``\\s its size before the slow work
  (validation): the reservation counts from then on, and is given back when the work fails, or
  turns into the file's row in one step (``Reservation.record``: the row is written under the
  tenant's lock, and the reservation ends with it, so no check counts the bytes twice or not at all).
- **A part of the Uploads API** is checked and counted in one step (``admit``, the part recorded
  under the tenant's lock); ``drop_pending`` gives the bytes back when its upload ends (cancelled
  or expired), or, under the tenant's ``lock``, once its completed file's row counts them instead.

Replicas sharing a database spend the bytes in one transaction instead (``storage.stored_bytes``).
The limit checked is the caller's own, or the owner's when an admin stores bytes for a tenant
(``limit_of``).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio

from batchgen.core.files.upload_rules import quota_exceeded
from batchgen.core.tenancy import Caller, TenantLimits

_T = TypeVar("_T")


class Reservation:
    """Bytes held for a file being stored for ``tenant``; ``record`` writes its row, ``release``
    gives them back (both end it; ending it twice is harmless)."""

    def __init__(self, quota: StoredBytesQuota | None, tenant: str, size: int) -> None:
        self._quota = quota
        self.tenant = tenant
        self.size = size

    async def record(self, write: Callable[[], Awaitable[_T]]) -> _T:
        """``write()`` the file's row; the reservation ends with it, in one step for every check of
        the tenant. A failed write leaves the reservation held (``release`` it)."""
        quota = self._quota
        if quota is None:
            return await write()
        async with quota.lock(self.tenant):
            written = await write()
            self.release()
            return written

    def release(self) -> None:
        quota, self._quota = self._quota, None
        if quota is not None:
            quota.unreserve(self.tenant, self.size)


class StoredBytesQuota:
    """The bytes each tenant holds, admitted against its ``max_stored_bytes``; ``stored_bytes(tenant)``
    reads the bytes of its files, ``tenant_limits(tenant)`` the limits set on a tenant."""

    def __init__(
        self,
        stored_bytes: Callable[[str], Awaitable[int]],
        tenant_limits: Callable[[str], TenantLimits],
    ) -> None:
        self._stored_bytes = stored_bytes
        self._tenant_limits = tenant_limits
        self._locks: dict[str, anyio.Lock] = {}
        self._pending: Counter[str] = Counter()  # bytes of parts of uploads not completed
        self._reserved: Counter[str] = Counter()  # bytes of files being stored

    def lock(self, tenant: str) -> anyio.Lock:
        return self._locks.setdefault(tenant, anyio.Lock())

    def limit_of(self, caller: Caller, owner: str) -> int | None:
        """The ``max_stored_bytes`` of ``owner``: the caller's own limit, else (an admin storing for
        a tenant) the tenant's."""
        if caller.tenant == owner:
            return caller.limits.max_stored_bytes
        return self._tenant_limits(owner).max_stored_bytes

    def pending_bytes(self, tenant: str) -> int:
        """Bytes of the tenant's parts of uploads not completed (a running total)."""
        return self._pending[tenant]

    async def used(self, tenant: str) -> int:
        """What ``tenant`` holds now: its files, its pending parts and the files being stored."""
        files = await self._stored_bytes(tenant)
        return files + self._pending[tenant] + self._reserved[tenant]

    async def check(self, tenant: str, limit: int | None, adding: int) -> None:
        """UploadQuotaExceeded when ``adding`` bytes would take ``tenant`` past ``limit`` now (a check
        only: nothing is held)."""
        if limit is None:
            return
        used = await self.used(tenant)
        if used + adding > limit:
            raise quota_exceeded(tenant, used, adding, limit)

    async def reserve(self, tenant: str, limit: int | None, adding: int) -> Reservation:
        """Hold ``adding`` bytes for a file of ``tenant``, or UploadQuotaExceeded (nothing held)."""
        if limit is None:
            return Reservation(None, tenant, adding)
        async with self.lock(tenant):
            await self.check(tenant, limit, adding)
            self._reserved[tenant] += adding
        return Reservation(self, tenant, adding)

    def unreserve(self, tenant: str, size: int) -> None:
        self._reserved[tenant] -= size
        if not self._reserved[tenant]:
            del self._reserved[tenant]

    @contextlib.asynccontextmanager
    async def admit(self, tenant: str, limit: int | None, adding: int) -> AsyncIterator[None]:
        """Check that ``adding`` bytes of a part fit, and hold the tenant's lock while the body
        records the part (and counts it, ``add_pending``); UploadQuotaExceeded otherwise."""
        if limit is None:
            yield
            return
        async with self.lock(tenant):
            await self.check(tenant, limit, adding)
            yield

    def add_pending(self, tenant: str, size: int) -> None:
        self._pending[tenant] += size

    def drop_pending(self, tenant: str, size: int) -> None:
        self._pending[tenant] -= size
        if not self._pending[tenant]:
            del self._pending[tenant]
