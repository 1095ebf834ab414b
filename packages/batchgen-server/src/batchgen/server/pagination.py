"""The OpenAI list envelope: ``{"object": "list", "data", "first_id", "last_id", "has_more"}``."""

from __future__ import annotations

from typing import Any


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
