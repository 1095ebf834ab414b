"""The SQL both metadata stores run, written once.

``sqlite_metadata`` and ``postgres_metadata`` ask the same questions of the same rows
(``metadata_rows``); where the statement is the same but for the driver's placeholder (``?`` for
sqlite3, ``%s`` for psycopg), it is built here, with its parameters. Each function returns
``(query, params)``.
"""

from __future__ import annotations

from typing import Any

from batchgen.core.errors import InvalidRequest
from batchgen.core.models import DEFAULT_TENANT

#: The tables an ``after`` cursor may name an object of.
_CURSOR_TABLES = frozenset({"files", "batches"})


def owner_clause(owner: str, placeholder: str) -> tuple[str, list[Any]]:
    """Rows of ``owner`` (a row without one is the default tenant's)."""
    return f"COALESCE(owner, {placeholder}) = {placeholder}", [DEFAULT_TENANT, owner]


def cursor_seq_query(
    table: str, object_id: str, owner: str | None, placeholder: str
) -> tuple[str, list[Any]]:
    """The sequence number of the object an ``after`` cursor names, deleted or not (a deleted
    file's number is in ``deleted_files``); with ``owner``, only that owner's objects count."""
    if table not in _CURSOR_TABLES:
        raise ValueError(f"no cursor over {table!r}")
    mine, mine_params = ("", []) if owner is None else owner_clause(owner, placeholder)
    mine = f" AND {mine}" if mine else ""
    query = f"SELECT seq FROM {table} WHERE id = {placeholder}{mine}"
    params: list[Any] = [object_id, *mine_params]
    if table == "files":
        query += f" UNION ALL SELECT seq FROM deleted_files WHERE id = {placeholder}{mine}"
        params += [object_id, *mine_params]
    return query, params


def unknown_cursor(table: str, object_id: str) -> InvalidRequest:
    """The error for an ``after`` cursor naming an object that was never stored."""
    kind = "file" if table == "files" else "batch"
    return InvalidRequest(f"after: no {kind} with id '{object_id}' was ever listed here", param="after")


def retry_family_query(batch_id: str, placeholder: str, *, text_cast: str = "") -> tuple[str, list[Any]]:
    """``batch_id`` and every batch made as a retry of it or of one of its retries, oldest first."""
    query = (
        f"WITH RECURSIVE family(id) AS (SELECT {placeholder}{text_cast} UNION SELECT batches.id FROM batches "
        "JOIN family ON batches.retry_of = family.id) "
        "SELECT batches.id FROM batches JOIN family ON batches.id = family.id ORDER BY batches.seq"
    )
    return query, [batch_id]


def usage_query(owner: str | None, placeholder: str, *, integer_cast: str = "") -> tuple[str, list[Any]]:
    """Per owner: batches, completed and failed requests, prompt and completion tokens, from the
    saved batch counters (``integer_cast`` makes a database's sums integers, as SQLite's are)."""
    sums = ", ".join(
        f"COALESCE(SUM({column}), 0){integer_cast}"
        for column in ("completed", "failed", "prompt_tokens", "completion_tokens")
    )
    query = f"SELECT COALESCE(owner, {placeholder}) AS tenant, COUNT(*), {sums} FROM batches"
    params: list[Any] = [DEFAULT_TENANT]
    if owner is not None:
        clause, clause_params = owner_clause(owner, placeholder)
        query += f" WHERE {clause}"
        params += clause_params
    return query + " GROUP BY tenant ORDER BY tenant", params
