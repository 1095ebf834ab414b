"""What OpenAI's Uploads API accepts, and what it answers: its limits and checks.

Both ways of keeping uploads apply these, so a single process (``chunked_uploads``) and replicas
sharing a database (``shared_uploads``) take the same calls and refuse the same ones with the same
errors: the limits (``MAX_PART_BYTES``, the default ``MAX_PARTS``, the open uploads a tenant may
have, ...), the checks of a new upload, of a
part's room, of the order and sizes ``complete`` names and of its md5, a tenant's
``max_stored_bytes`` (``UploadQuotaExceeded``), and the validation of a batch file streamed as
chunks (``validate_chunks``: one pass keeping hashes, an exact pass when it found something). The
records they keep, ``Upload`` and ``UploadPart``, are in ``models``, where the PostgreSQL store of
replicas' uploads reads them too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence

from batchgen.core.errors import IntakeFull, InvalidRequest, PayloadTooLarge
from batchgen.core.files.batch_file import BatchFileSummary, LineRouter
from batchgen.core.files.streamed_validation import StreamedValidation, validate_exactly
from batchgen.core.models import PENDING, UPLOAD_PURPOSES, Upload

#: The largest part (OpenAI's limit: 64 MB; the SDK's parts are 64 MiB).
MAX_PART_BYTES = 64 * 1024 * 1024
#: The most parts one upload may have, by default (``--max-upload-parts``; OpenAI's limit).
MAX_PARTS = 10_000
#: The most uploads one tenant may have open (pending or completing) at once, by default
#: (``--max-open-uploads``), and the ``Retry-After`` seconds sent when it has that many.
DEFAULT_MAX_OPEN_UPLOADS = 100
OPEN_UPLOADS_RETRY_AFTER_S = 30
#: The default most bytes one upload may declare (OpenAI's: 8 GB), and how long it stays open.
DEFAULT_MAX_UPLOAD_BYTES = 8 * 1024**3
DEFAULT_UPLOAD_EXPIRY_S = 3600
#: Ended uploads' records are kept this long after they ended, so late calls get a clear answer.
ENDED_RECORD_KEEP_S = 7 * 86400
#: The longest filename and mime_type accepted.
MAX_NAME_CHARS = 1024
#: What an upload id (or a part id) looks like; anything else names no upload.
UPLOAD_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class UploadQuotaExceeded(PayloadTooLarge):
    """The tenant's ``max_stored_bytes`` would be passed (413)."""

    code = "quota_exceeded"


class OpenUploadsExceeded(IntakeFull):
    """The tenant has as many open uploads as the server allows (429)."""

    code = "too_many_open_uploads"


def too_many_open_uploads(tenant: str, open_now: int, limit: int) -> OpenUploadsExceeded:
    return OpenUploadsExceeded(
        f"Tenant '{tenant}' has {open_now} open uploads; this server allows {limit} per tenant "
        "(--max-open-uploads). Complete or cancel one, or wait for one to expire, and retry.",
        retry_after_s=OPEN_UPLOADS_RETRY_AFTER_S,
    )


def quota_exceeded(tenant: str, used: int, adding: int, limit: int) -> UploadQuotaExceeded:
    """The error for ``adding`` bytes more to a tenant holding ``used`` of its ``limit``."""
    return UploadQuotaExceeded(
        f"Tenant '{tenant}' holds {used} bytes in files and pending upload parts; "
        f"{adding} more would pass its limit of {limit} bytes (max_stored_bytes). Delete files "
        "or cancel uploads, or have an operator raise the limit."
    )


def check_new_upload(
    *, filename: str, purpose: str, size: int, mime_type: str, max_upload_bytes: int
) -> None:
    """Refuse a create call whose purpose, names or size this server does not take."""
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidRequest(
            f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}, got {purpose!r}", param="purpose"
        )
    for name, value in (("filename", filename), ("mime_type", mime_type)):
        if not value or len(value) > MAX_NAME_CHARS:
            raise InvalidRequest(f"{name} must be 1 to {MAX_NAME_CHARS} characters", param=name)
    if not 1 <= size <= max_upload_bytes:
        raise InvalidRequest(
            f"bytes must be between 1 and {max_upload_bytes} (this server's --max-upload-total-bytes), "
            f"got {size}",
            param="bytes",
        )


def require_pending(upload: Upload, action: str) -> None:
    """Refuse ``action`` on an upload that is not pending (its code names the status)."""
    if upload.status != PENDING:
        raise InvalidRequest(
            f"Upload '{upload.id}' is {upload.status}; {action} only a pending upload",
            param="upload_id",
            code=f"upload_{upload.status}",
        )


def too_many_parts(limit: int) -> InvalidRequest:
    return InvalidRequest(
        f"An upload may have at most {limit} parts (this server's --max-upload-parts); send larger "
        "parts (up to 64 MiB each)",
        param="data",
    )


def check_part_room(upload: Upload, have: int, size: int) -> None:
    """Refuse a part of ``size`` bytes (none, or more than the upload has room for, with the
    ``have`` bytes of its parts so far: its declared size and one part more, for a part a retry
    sent twice)."""
    if size == 0:
        raise InvalidRequest("a part must hold at least one byte", param="data")
    room = upload.bytes + min(upload.bytes, MAX_PART_BYTES)
    if have + size > room:
        raise InvalidRequest(
            f"This part ({size} bytes) would make the upload's parts {have + size} bytes, more "
            f"than the {upload.bytes} bytes the upload was created with and one part more "
            f"(at most {room} bytes may be sent)",
            param="data",
        )


def check_order(
    upload: Upload, part_ids: Sequence[str], have: Mapping[str, int], max_parts: int
) -> tuple[int, ...]:
    """The sizes of the parts ``part_ids`` names, in that order, of the parts the upload ``have``
    (id -> bytes); refused unless they are distinct parts it has (at most ``max_parts``) that add
    up to its size."""
    if not part_ids:
        raise InvalidRequest("part_ids must name at least one part", param="part_ids")
    if len(part_ids) > max_parts:
        raise InvalidRequest(f"part_ids may name at most {max_parts} parts", param="part_ids")
    if len(set(part_ids)) != len(part_ids):
        raise InvalidRequest("part_ids names a part more than once", param="part_ids")
    missing = [part_id for part_id in part_ids if part_id not in have]
    if missing:
        raise InvalidRequest(
            f"part_ids names {len(missing)} part(s) this upload does not have, such as {missing[0][:80]!r}",
            param="part_ids",
        )
    sizes = tuple(have[part_id] for part_id in part_ids)
    if sum(sizes) != upload.bytes:
        raise InvalidRequest(
            f"The parts named hold {sum(sizes)} bytes, but the upload was created with bytes={upload.bytes}",
            param="part_ids",
        )
    return sizes


def check_completing_order(upload: Upload, part_ids: Sequence[str]) -> None:
    """Refuse to complete an upload being completed with another order of parts."""
    if list(part_ids) != list(upload.order):
        raise InvalidRequest(
            f"Upload '{upload.id}' is being completed with another order of parts", param="part_ids"
        )


def check_md5(found: str, md5: str) -> None:
    """Refuse parts whose md5 (``found``, in the order named) is not the one the client gave."""
    if found != md5.strip().lower():
        raise InvalidRequest(
            f"md5 mismatch: the parts, in the order named, have md5 {found}, not {md5[:64]!r}; "
            "nothing was stored and the upload is still pending",
            param="md5",
            code="md5_mismatch",
        )


def validate_chunks(
    chunks: Callable[[], Iterator[bytes]],
    served_models: Collection[str] | LineRouter | None,
    first_pass: BatchFileSummary | set[int] | None = None,
) -> BatchFileSummary:
    """Validate the batch file ``chunks()`` yields (called again for a second pass) with bounded
    memory; ``first_pass``: what a first pass over the same bytes found already (a speculation
    run as the parts arrived), else it is run here. Raises InvalidBatchFile naming the lines."""
    found = first_pass
    if found is None:
        validation = StreamedValidation(served_models)
        for chunk in chunks():
            validation.feed(chunk)
        found = validation.finish()
    if isinstance(found, BatchFileSummary):
        return found
    return validate_exactly(chunks(), served_models, found)
