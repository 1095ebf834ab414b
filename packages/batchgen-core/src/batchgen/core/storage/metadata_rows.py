"""How files, batches and webhook messages are laid out as rows: the columns, and the mapping both ways.

Shared by every metadata store (``sqlite_metadata``, ``postgres_metadata``), so a field added to
``Batch`` or ``FileObject`` is added once here and reaches every database with the same meaning.
Column types are Python types; each store maps them to its own SQL types.
"""

from __future__ import annotations

import json
from typing import Any

from batchgen.core.models import (
    DEFAULT_TENANT,
    Batch,
    BatchErrorInfo,
    BatchParameters,
    BatchStatus,
    FileObject,
    RequestCounts,
    Usage,
)

FILE_COLUMNS = {
    "seq": int,
    "id": str,
    "bytes": int,
    "created_at": int,
    "filename": str,
    "purpose": str,
    "path": str,
    "line_count": int,
    "url": str,
    "expires_at": int,
    "owner": str,
}

BATCH_COLUMNS = {
    "seq": int,
    "id": str,
    "endpoint": str,
    "input_file_id": str,
    "completion_window": str,
    "status": str,
    "created_at": int,
    "expires_at": int,
    "model": str,
    "max_decoding_length": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "metadata": str,
    "output_expires_after_s": int,
    "output_file_id": str,
    "error_file_id": str,
    "total": int,
    "completed": int,
    "failed": int,
    "prompt_tokens": int,
    "completion_tokens": int,
    "cached_requests": int,
    "cached_prompt_tokens": int,
    "cached_completion_tokens": int,
    "prefix_cached_tokens": int,
    "error_code": str,
    "error_message": str,
    "in_progress_at": int,
    "finalizing_at": int,
    "completed_at": int,
    "failed_at": int,
    "expired_at": int,
    "cancelling_at": int,
    "cancelled_at": int,
    "owner": str,
    "retry_of": str,
    "at_risk_at": int,
    "output_order": str,
}

OUTBOX_COLUMNS = {
    "event_id": str,
    "target": str,
    "body": bytes,
    "created_at": int,
    "attempts": int,
    "next_attempt_at": float,
    "last_error": str,
}

#: The statuses of a batch that is not finished (what a restart resumes).
ACTIVE_STATUSES = tuple(status.value for status in BatchStatus if status.is_active)


def batch_to_row(batch: Batch) -> dict[str, Any]:
    return {
        "id": batch.id,
        "endpoint": batch.endpoint,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status.value,
        "created_at": batch.created_at,
        "expires_at": batch.expires_at,
        "model": batch.model,
        "max_decoding_length": batch.parameters.max_decoding_length,
        "temperature": batch.parameters.temperature,
        "top_p": batch.parameters.top_p,
        "top_k": batch.parameters.top_k,
        "metadata": None if batch.metadata is None else json.dumps(batch.metadata),
        "output_expires_after_s": batch.output_expires_after_s,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "total": batch.request_counts.total,
        "completed": batch.request_counts.completed,
        "failed": batch.request_counts.failed,
        "prompt_tokens": batch.usage.prompt_tokens,
        "completion_tokens": batch.usage.completion_tokens,
        "cached_requests": batch.usage.cached_requests,
        "cached_prompt_tokens": batch.usage.cached_prompt_tokens,
        "cached_completion_tokens": batch.usage.cached_completion_tokens,
        "prefix_cached_tokens": batch.usage.prefix_cached_tokens,
        "error_code": None if batch.error is None else batch.error.code,
        "error_message": None if batch.error is None else batch.error.message,
        "in_progress_at": batch.in_progress_at,
        "finalizing_at": batch.finalizing_at,
        "completed_at": batch.completed_at,
        "failed_at": batch.failed_at,
        "expired_at": batch.expired_at,
        "cancelling_at": batch.cancelling_at,
        "cancelled_at": batch.cancelled_at,
        "owner": batch.owner,
        "retry_of": batch.retry_of,
        "at_risk_at": batch.at_risk_at,
        "output_order": batch.output_order,
    }


def batch_from_row(row: dict[str, Any]) -> Batch:
    error = None
    if row["error_code"] is not None:
        error = BatchErrorInfo(row["error_code"], row["error_message"] or "")
    return Batch(
        id=row["id"],
        endpoint=row["endpoint"],
        input_file_id=row["input_file_id"],
        completion_window=row["completion_window"],
        status=BatchStatus(row["status"]),
        created_at=row["created_at"],
        expires_at=row["expires_at"],
        model=row["model"],
        parameters=BatchParameters(
            max_decoding_length=row["max_decoding_length"],
            temperature=row["temperature"],
            top_p=row["top_p"],
            top_k=row["top_k"],
        ),
        metadata=None if row["metadata"] is None else json.loads(row["metadata"]),
        output_expires_after_s=row.get("output_expires_after_s"),
        output_file_id=row["output_file_id"],
        error_file_id=row["error_file_id"],
        request_counts=RequestCounts(row["total"], row["completed"], row["failed"]),
        usage=Usage(
            row["prompt_tokens"],
            row["completion_tokens"],
            row.get("cached_requests") or 0,
            row.get("cached_prompt_tokens") or 0,
            row.get("cached_completion_tokens") or 0,
            row.get("prefix_cached_tokens") or 0,
        ),
        error=error,
        in_progress_at=row["in_progress_at"],
        finalizing_at=row["finalizing_at"],
        completed_at=row["completed_at"],
        failed_at=row["failed_at"],
        expired_at=row["expired_at"],
        cancelling_at=row["cancelling_at"],
        cancelled_at=row["cancelled_at"],
        owner=row.get("owner") or DEFAULT_TENANT,
        retry_of=row.get("retry_of"),
        at_risk_at=row.get("at_risk_at"),
        output_order=row.get("output_order") or "completion",
    )


def file_from_row(row: dict[str, Any]) -> FileObject:
    return FileObject(
        id=row["id"],
        bytes=row["bytes"],
        created_at=row["created_at"],
        filename=row["filename"],
        purpose=row["purpose"],
        path=row["path"],
        line_count=row["line_count"] or 0,
        url=row["url"],
        expires_at=row["expires_at"],
        owner=row.get("owner") or DEFAULT_TENANT,
    )


def file_to_row(file: FileObject) -> dict[str, Any]:
    """A file's columns (all but ``seq``, which the store gives)."""
    return {
        "id": file.id,
        "bytes": file.bytes,
        "created_at": file.created_at,
        "filename": file.filename,
        "purpose": file.purpose,
        "path": file.path,
        "line_count": file.line_count,
        "url": file.url,
        "expires_at": file.expires_at,
        "owner": file.owner,
    }
