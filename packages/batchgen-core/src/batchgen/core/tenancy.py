"""Tenants as the core sees them: who makes a call, what that caller may see, and its limits.

Every file and batch has an ``owner``, the tenant that made it. A ``Caller`` is a tenant, with
admin rights or not, and the limits set on that tenant. A caller sees only its own tenant's objects
(another tenant's id is "not found", never "forbidden"), unless it is an admin, which sees and
manages everything. The embedded service, with no tenants at all, calls as ``EMBEDDED``: an admin
of the ``default`` tenant, so a pipeline that never heard of tenants works as before.
"""

from __future__ import annotations

from typing import Any

import attrs

from batchgen.core.models import DEFAULT_TENANT

__all__ = [
    "DEFAULT_TENANT",
    "EMBEDDED",
    "KEY_SEPARATOR",
    "RESERVED_TENANT_NAMES",
    "Caller",
    "TenantLimits",
    "TenantUsage",
    "reserved_tenant_problem",
    "scoped_key",
]

#: What joins a tenant's name and its ``Idempotency-Key`` in the stored key.
KEY_SEPARATOR = "\x1f"
#: Names no tenant made with a key may have (compared case-insensitively): ``default`` is the
#: tenant of the embedded service and of a server without keys, which owns what was made then.
RESERVED_TENANT_NAMES = frozenset({DEFAULT_TENANT})


def _positive_weight(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{attribute.name} must be a number above 0, got {value}")


@attrs.frozen
class TenantLimits:
    """What one tenant may hold at once (None: no limit beyond the server's) and its share weight.

    ``max_queued_requests`` counts the requests of the tenant's batches still waiting for a slot
    (and those of batches accepted but not queued yet); ``max_active_batches`` the batches not
    ended yet. ``max_stored_bytes`` counts the bytes of the files the tenant uploaded (not batch
    results) and of the parts of its uploads not completed yet (``chunked_uploads``). ``weight`` is the tenant's share of the slots while several tenants have work: a
    tenant of weight 2 is admitted twice as many requests per round as one of weight 1.
    """

    max_queued_requests: int | None = None
    max_active_batches: int | None = None
    weight: float = attrs.field(default=1.0, validator=_positive_weight)
    max_stored_bytes: int | None = None

    def never_fits(self, tenant: str, requests: int) -> str | None:
        """Why a batch of ``requests`` can never be accepted under these limits (however long the
        tenant waits: it is larger than ``max_queued_requests`` itself, or ``max_active_batches``
        is 0), or None when waiting can let it in."""
        fix = f"'batchgen-server keys set-limits --tenant {tenant} ...'"
        if self.max_queued_requests is not None and requests > self.max_queued_requests:
            return (
                f"This batch ({requests} requests) is over tenant '{tenant}'s limit of "
                f"{self.max_queued_requests} queued requests (max_queued_requests), so it will never fit, "
                f"however long it waits: do not retry it. Split the file into batches of at most "
                f"{self.max_queued_requests} requests, or have an operator raise the limit ({fix})."
            )
        if self.max_active_batches == 0:
            return (
                f"Tenant '{tenant}' may have no active batch (max_active_batches is 0), so this batch will "
                f"never fit, however long it waits: do not retry it. Have an operator raise the limit ({fix})."
            )
        return None


@attrs.frozen
class Caller:
    """Who makes a service call: a tenant, whether it is an admin, and that tenant's limits."""

    tenant: str = DEFAULT_TENANT
    admin: bool = False
    limits: TenantLimits = TenantLimits()

    def sees(self, owner: str) -> bool:
        """Whether this caller may see (and manage) an object ``owner`` made."""
        return self.admin or owner == self.tenant

    @property
    def owner_filter(self) -> str | None:
        """The owner a list is narrowed to: None for an admin (everything), else the tenant."""
        return None if self.admin else self.tenant


#: The caller of the embedded service and of a server without API keys.
EMBEDDED = Caller(DEFAULT_TENANT, admin=True)


def reserved_tenant_problem(name: str) -> str | None:
    """Why ``name`` cannot be the tenant of an API key, or None if it can.

    Refused: the reserved names (any case), and a name holding the separator of stored
    ``Idempotency-Key`` values or any other control character (it could spell another tenant's key).
    """
    if name.casefold() in RESERVED_TENANT_NAMES:
        return f"tenant name {name!r} is reserved (it is the tenant of calls made without a key)"
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in name):
        return f"tenant name {name!r} holds a control character"
    return None


def scoped_key(tenant: str, key: str) -> str:
    """An ``Idempotency-Key`` as stored: keys are per tenant, so two tenants may use the same key.

    Every tenant's keys, the default tenant's too, are stored as ``tenant KEY_SEPARATOR key``;
    the key itself may not hold a control character (``idempotency.check_key``), so no key of
    one tenant can spell another's.
    """
    return f"{tenant}{KEY_SEPARATOR}{key}"


@attrs.frozen
class TenantUsage:
    """What one tenant's batches have used: requests finished and tokens, over all time."""

    tenant: str
    batches: int = 0
    completed_requests: int = 0
    failed_requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def requests(self) -> int:
        return self.completed_requests + self.failed_requests

    def to_dict(self) -> dict[str, Any]:
        return {
            "object": "usage",
            "tenant": self.tenant,
            "batches": self.batches,
            "requests": self.requests,
            "completed_requests": self.completed_requests,
            "failed_requests": self.failed_requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
