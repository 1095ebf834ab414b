"""Output files through the API: one record per request, whatever the custom_ids hold.

Clients read output files with ``text.splitlines()`` (the openai SDK idiom); a custom_id holding
one of the characters that splits there must not split its record.
"""

from __future__ import annotations

import json

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.examples import examples
from tests.helpers import TERMINAL, chat_line, submit, wait_for_status

_BREAKERS = st.sampled_from("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")
_CUSTOM_ID = st.text(st.one_of(_BREAKERS, st.characters(exclude_categories=["Cs"])), min_size=1, max_size=12)


@settings(max_examples=examples(12), deadline=None)
@given(custom_ids=st.lists(_CUSTOM_ID, min_size=1, max_size=4, unique=True))
def test_splitlines_of_an_output_file_gives_one_record_per_request(
    api: httpx.Client, custom_ids: list[str]
) -> None:
    batch = submit(api, [chat_line(custom_id, f"say {custom_id}") for custom_id in custom_ids])
    batch = wait_for_status(api, batch["id"], TERMINAL)
    assert batch["status"] == "completed", batch
    text = api.get(f"/v1/files/{batch['output_file_id']}/content").text
    records = [json.loads(line) for line in text.splitlines()]
    assert sorted(record["custom_id"] for record in records) == sorted(custom_ids)
