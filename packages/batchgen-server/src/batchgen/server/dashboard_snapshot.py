"""The dashboard's first snapshot: the server's state rendered into the page it serves.

The page must not open on "checking…" and "loading…" while its script makes its first calls, so
``GET /`` carries what those calls would answer: health (always: ``/health`` is open), and, while
the server has no API keys, the pool status (on a replica, every replica's share of the work) and
the first page of batches. It is there twice: as
text in the HTML (health, the pool figures, the batch rows), so the first paint holds it even
before the script runs, and as JSON in a ``<script type="application/json">`` element (data, not
code: the page's Content-Security-Policy still runs no inline script), from which the script draws
the page in full at once and then polls.

Once a key exists the page request carries none (a browser sends no ``Authorization`` header on
navigation), so the page holds nothing of any tenant's: only health, and "enter an API key" where
the figures go. The script asks for the key as before.
"""

from __future__ import annotations

import html
import json
import time
from typing import Any

import attrs

from batchgen.core.service import BatchService

#: Batches on the first page, as the script asks for (``PAGE_SIZE`` in dashboard.js).
PAGE_SIZE = 20
#: What the page shows for a figure it does not know (as dashboard.js does).
NO_VALUE = "\N{EN DASH}"
#: What the page says where a key is needed to show anything.
KEY_NEEDED = "enter an API key to see this"
#: Next to a running batch's status when its pace says it ends after its expires_at (as the script draws it).
AT_RISK_MARK = (
    '<span class="at-risk" title="at its recent pace this batch ends after it expires">at risk</span>'
)


@attrs.frozen
class Snapshot:
    """The state shown in the first paint; ``pool`` and ``batches`` None when a key is needed."""

    health: dict[str, Any]
    healthy: bool
    pool: dict[str, Any] | None
    batches: dict[str, Any] | None
    taken_at: float

    def to_json(self) -> str:
        """The JSON for the page's ``<script type="application/json">``, safe inside it."""
        text = json.dumps(attrs.asdict(self), separators=(",", ":"))
        return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


async def take(service: BatchService, *, tenant_data: bool) -> Snapshot:
    """The server's state now; the pool and batches only with ``tenant_data`` (no keys)."""
    report = service.health_report()
    pool = batches = None
    if tenant_data:
        pool = service.pool_status().to_dict()
        listed, has_more = await service.list_batches(limit=PAGE_SIZE)
        data = [batch.to_dict() for batch in listed]
        batches = {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }
    return Snapshot(report, report.get("status") != "unhealthy", pool, batches, time.time())


# --- the same as text, for the first paint ---------------------------------------------------------


def health_text(snapshot: Snapshot) -> tuple[str, str]:
    """(the health pill's text, its data-state)."""
    status = str(snapshot.health.get("status", "unknown"))
    if status == "healthy":
        return "healthy", "healthy"
    reason = snapshot.health.get("reason")
    return (f"{status}: {reason}" if reason else status), (
        "degraded" if status == "degraded" else "unhealthy"
    )


def _n(value: Any) -> str:
    return f"{int(value):,}"


def intake_text(pool: dict[str, Any] | None) -> str:
    if pool is None:
        return KEY_NEEDED
    return f"{_n(pool['intake_pool_size'])} of {_n(pool['intake_pool_capacity'])} requests queued"


def engine_text(pool: dict[str, Any] | None) -> str:
    """What the engine runs versus what was admitted and waits for it; where some models'
    backends cannot tell, the sum of those that can, naming the others (see dashboard.js)."""
    if pool is None:
        return KEY_NEEDED
    admitted, slots = _n(pool["scheduling_pool_active"]), f"slots: {_n(pool['scheduling_pool_capacity'])}"
    running, waiting = pool.get("engine_running"), pool.get("engine_waiting")
    if running is not None and waiting is not None:
        return (
            f"running on the engine: {_n(running)} · admitted, waiting for the engine: {_n(waiting)} · "
            f"{slots}"
        )
    engines = pool.get("engines") or ()
    telling = [engine for engine in engines if engine.get("running") is not None]
    if not telling:
        return (
            f"admitted: {admitted} · {slots} "
            "(this backend cannot tell how many of them its engine is computing)"
        )
    each = ", ".join(f"{engine['model']}: {_n(engine['running'])}" for engine in telling)
    silent = [str(engine["model"]) for engine in engines if engine.get("running") is None]
    cannot = "their backends cannot" if len(silent) > 1 else "its backend cannot"
    return (
        f"running on the engine: {_n(sum(engine['running'] for engine in telling))} ({each}) · "
        f"admitted: {admitted} · {slots} ({', '.join(silent)}: {cannot} tell how many of its "
        "requests the engine is computing; not counted)"
    )


def active_text(pool: dict[str, Any] | None) -> str:
    return NO_VALUE if pool is None else _n(pool["active_batches"])


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return NO_VALUE
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole}s"
    minutes = whole // 60
    if minutes < 60:
        return f"{minutes}m{whole % 60:02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def _clock(unix: int | None) -> str:
    return NO_VALUE if not unix else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix))


def _finished_at(batch: dict[str, Any]) -> int | None:
    for field in ("completed_at", "failed_at", "cancelled_at", "expired_at"):
        if batch.get(field):
            return int(batch[field])
    return None


def _cells(cells: list[tuple[str, str]]) -> str:
    """A table row's cells, each labelled for the narrow layout (where rows become cards)."""
    return "".join(f'<td data-label="{label}">{content}</td>' for label, content in cells)


def batch_rows(snapshot: Snapshot) -> str:
    """The batch table's rows, as the script draws them (it redraws them at once, in local time)."""
    if snapshot.batches is None:
        return f'<tr><td colspan="7" class="muted">{KEY_NEEDED}</td></tr>'
    if not snapshot.batches["data"]:
        return '<tr><td colspan="7" class="muted">no batches yet</td></tr>'
    rows = []
    for batch in snapshot.batches["data"]:
        counts = batch.get("request_counts") or {}
        total, done, failed = counts.get("total", 0), counts.get("completed", 0), counts.get("failed", 0)
        progress = f"{_n(done + failed)}/{_n(total)}" + (f" ({_n(failed)} failed)" if failed else "")
        cached = (batch.get("usage") or {}).get("cached_requests") or 0
        if cached:  # answered by the result cache
            progress += f" ({_n(cached)} from cache)"
        rate = batch.get("requests_per_second")
        cells = [
            ("Batch", f"<code>{html.escape(batch['id'])}</code>"),
            (
                "Status",
                f'<span class="status {html.escape(batch["status"])}">{html.escape(batch["status"])}</span>'
                + (AT_RISK_MARK if batch.get("at_risk") is True else ""),
            ),
            (
                "Progress",
                f'<div class="progress"><div class="bar" data-completed="{done}" data-failed="{failed}" '
                f'data-total="{total}" data-cached="{cached}"><span class="done"></span><span class="failed"></span></div>'
                f"<small>{progress}</small></div>",
            ),
            ("Rate", NO_VALUE if rate is None else f"{rate:.2f}/s"),
            ("ETA", _duration(batch.get("estimated_seconds_remaining"))),
            ("Created", _clock(batch.get("created_at"))),
            ("Finished", _clock(_finished_at(batch))),
        ]
        tds = _cells(cells)
        at_risk = ' data-at-risk="true"' if batch.get("at_risk") is True else ""
        rows.append(
            f'<tr data-batch-id="{html.escape(batch["id"])}" data-status="{html.escape(batch["status"])}"'
            f"{at_risk}>{tds}</tr>"
        )
    return "".join(rows)


def replica_rows(pool: dict[str, Any] | None) -> str:
    """The replicas table's rows (every replica's share of the work, as the script draws them);
    empty for a single process, whose page hides the table."""
    rows = []
    for report in (pool or {}).get("replicas") or ():
        reporting = report.get("reporting") is not False  # False: it missed two reports
        healthy = reporting and bool(report.get("healthy"))
        if not reporting:
            health = f"not reporting (last report {float(report.get('seen_s_ago', 0)):.0f}s ago)"
        elif healthy:
            health = "healthy"
        else:
            health = "unhealthy: " + "; ".join(map(str, report.get("problems") or ()))
        cells = [
            ("Replica", f"<code>{html.escape(str(report.get('id', '')))}</code>"),
            (
                "Health",
                f'<span class="status {"completed" if healthy else "failed"}">{html.escape(health)}</span>',
            ),
            ("Shards held", _n(report.get("shards_held", 0))),
            ("Lines committed", _n(report.get("lines_committed", 0))),
            ("Leases lost", _n(report.get("leases_lost", 0))),
            ("Commits refused", _n(report.get("commits_refused", 0))),
            ("Reported", f"{float(report.get('seen_s_ago', 0)):.0f}s ago"),
        ]
        tds = _cells(cells)
        silent = "" if reporting else ' data-reporting="false"'
        rows.append(f'<tr data-replica-id="{html.escape(str(report.get("id", "")))}"{silent}>{tds}</tr>')
    return "".join(rows)
