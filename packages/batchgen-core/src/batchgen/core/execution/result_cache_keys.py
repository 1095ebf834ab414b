"""Which requests the result cache may answer, and the key each one is stored under.

A request may be answered from the cache only when running it again would give the same answer:
an embeddings request; a greedy one (``temperature`` 0) with one choice; or one with an explicit
``seed`` and one choice, on a backend that honours seeds. What a backend can repeat it declares
in its capabilities (``Capabilities.deterministic``: ``GREEDY``, ``SEEDED``); a backend that
declares neither is never cached.

The key is a SHA-256 over the tenant, the model (its public name, its backend and the name the
backend is handed), the endpoint, the canonical request body and the resolved sampling
parameters (a line that sets none takes the batch's or the server's, and those change its
answer). The canonical body is the body's JSON with keys sorted at every level and no
whitespace, so key order and spacing do not matter; ``custom_id`` sits outside the body and is
never part of the key. The tenant comes first, so two tenants never share an entry.
"""

from __future__ import annotations

import hashlib

import msgspec

from batchgen.core.backends.capabilities import GREEDY, SEEDED, Capabilities
from batchgen.core.models import EMBEDDINGS, GenerationRequest

_decode = msgspec.json.decode
_encode_sorted = msgspec.json.Encoder(order="sorted").encode


def is_deterministic(request: GenerationRequest, capabilities: Capabilities) -> bool:
    """Whether the backend would answer ``request`` the same way again (see the module docstring)."""
    declared = capabilities.deterministic
    if request.endpoint == EMBEDDINGS:
        return GREEDY in declared
    if request.options.get("n", 1) not in (None, 1):
        return False
    sampling = request.sampling
    if sampling.greedy:
        return GREEDY in declared
    return sampling.seed is not None and SEEDED in declared


def canonical_body(raw: bytes) -> bytes:
    """The body's JSON with its keys sorted at every level and no insignificant whitespace."""
    return _encode_sorted(_decode(raw))


def cache_key(
    tenant: str,
    model: tuple[str, str, str],
    endpoint: str,
    raw_body: bytes,
    request: GenerationRequest,
) -> str:
    """The hex key of one request: ``model`` is (public name, backend name, name handed to the
    backend), ``raw_body`` the line's body as it was uploaded."""
    sampling = request.sampling
    resolved = repr(
        (
            sampling.max_tokens,
            sampling.temperature,
            sampling.top_p,
            sampling.top_k,
            sampling.seed,
            sampling.stop,
        )
    )
    head = "\x00".join((tenant, *model, endpoint, resolved, ""))
    return hashlib.sha256(head.encode("utf-8", "surrogatepass") + canonical_body(raw_body)).hexdigest()
