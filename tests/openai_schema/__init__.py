"""OpenAI's published shapes of what BatchGen writes, to validate against (``openai_shape_errors``).

``openai_components.json`` holds the component schemas of OpenAI's OpenAPI description that
describe the objects BatchGen answers and writes (README.md says where they come from and what
was changed). Nothing here knows BatchGen: a test names the component an object must be.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

_DOCUMENT = Path(__file__).with_name("openai_components.json")
#: The component each endpoint's response body is, in OpenAI's schema.
BODY_COMPONENTS = {
    "/v1/chat/completions": "CreateChatCompletionResponse",
    "/v1/completions": "CreateCompletionResponse",
    "/v1/embeddings": "CreateEmbeddingResponse",
    "/v1/responses": "Response",
}


@cache
def _validator(component: str) -> Draft202012Validator:
    document = json.loads(_DOCUMENT.read_text())
    if component not in document["components"]["schemas"]:
        raise KeyError(f"no component {component!r} in {_DOCUMENT.name}")
    return Draft202012Validator({**document, "$ref": f"#/components/schemas/{component}"})


def openai_shape_errors(component: str, instance: Any) -> list[str]:
    """Where ``instance`` breaks OpenAI's schema of ``component`` (empty: it validates)."""
    errors = sorted(_validator(component).iter_errors(instance), key=lambda error: list(error.path))
    return [f"{'/'.join(map(str, error.path)) or '$'}: {error.message[:300]}" for error in errors]


def result_line_errors(line: dict[str, Any], endpoint: str) -> list[str]:
    """Where a batch output or error file line breaks OpenAI's schema: the line itself, and its
    response body as that endpoint's answer."""
    problems = openai_shape_errors("BatchRequestOutput", line)
    response = line.get("response")
    if isinstance(response, dict) and response.get("status_code") == 200:
        problems += [
            f"response.body.{problem}"
            for problem in openai_shape_errors(BODY_COMPONENTS[endpoint], response["body"])
        ]
    return problems
