"""From a decoded batch line to the ``GenerationRequest`` its model's backend runs.

Chat and completion lines carry their messages or prompt; a ``/v1/responses`` line runs on the
chat path, its ``instructions`` and ``input`` made into messages (``responses_api``); an
embeddings line carries its inputs. Sampling parameters are resolved body > batch > server
(``parameters``), and the line's optional feature fields go to the backend only when its
capabilities declare them (``backends.capabilities``); upload validation has refused the others.

Before that, ``route_line`` reads a line's body and finds its model, making again the checks upload
validation made (a file accepted by an older version, or models changed by a restart with other
flags, can fail them now): a line that fails one is answered with an error line, ``LineRefused``.
"""

from __future__ import annotations

import attrs

from batchgen.core.backends.capabilities import passed_options, unsupported_problem
from batchgen.core.backends.served_models import ModelSet, Route
from batchgen.core.errors import InvalidRequest
from batchgen.core.models import (
    CHAT_COMPLETIONS,
    EMBEDDINGS,
    RESPONSES,
    BatchParameters,
    GenerationRequest,
    SamplingParameters,
)
from batchgen.core.requests.embeddings_api import read_inputs
from batchgen.core.requests.parameters import ServerDefaults, resolve_sampling
from batchgen.core.requests.responses_api import chat_messages
from batchgen.core.requests.schema import (
    Body,
    ChatBody,
    CompletionBody,
    EmbeddingsBody,
    Envelope,
    message_dicts,
    read_body,
)


@attrs.frozen
class LineRefused:
    """Why a line gets an error line without running: the line's error ``code`` and ``message``."""

    code: str
    message: str


def route_line(envelope: Envelope, models: ModelSet) -> tuple[Body, Route] | LineRefused:
    """The line's body and the route to the model it names, or why it does not run."""
    try:
        body = read_body(envelope)
    except InvalidRequest as exc:
        return LineRefused("invalid_request", exc.message)
    try:
        route = models.route(body.model)
    except InvalidRequest as exc:
        return LineRefused("model_not_found", exc.message)
    model = route.model
    problem = unsupported_problem(
        model.public_name, getattr(model.backend, "name", "?"), model.capabilities, envelope.url, body
    )
    if problem is not None:
        return LineRefused("invalid_request", problem)
    if model.failure is not None:
        return LineRefused("model_unavailable", f"model {model.public_name!r}: {model.failure}")
    return body, route


def generation_request(
    request_id: str,
    envelope: Envelope,
    body: Body,
    route: Route,
    parameters: BatchParameters,
    defaults: ServerDefaults,
    *,
    sampling: SamplingParameters | None = None,
) -> GenerationRequest:
    """The request the routed model's backend runs for one line. ``sampling``: the line's
    parameters when the caller has resolved them already (once per batch, for bodies that set
    none; ``parameters.sets_sampling``)."""
    options = passed_options(route.model.capabilities, envelope.url, body)
    if isinstance(body, EmbeddingsBody):
        return GenerationRequest(
            request_id=request_id,
            endpoint=EMBEDDINGS,
            sampling=SamplingParameters(max_tokens=1),
            model=route.backend_model,
            inputs=read_inputs(body.input),
            options=options,
        )
    if sampling is None:
        sampling = resolve_sampling(body, parameters, defaults)
    if isinstance(body, ChatBody):
        messages = message_dicts(envelope)
    elif isinstance(body, CompletionBody):
        return GenerationRequest(
            request_id=request_id,
            endpoint=envelope.url,
            sampling=sampling,
            prompt=str(body.prompt),
            model=route.backend_model,
            options=options,
        )
    else:
        assert envelope.url == RESPONSES
        messages = chat_messages(body.instructions, body.input)
    return GenerationRequest(
        request_id=request_id,
        endpoint=CHAT_COMPLETIONS,
        sampling=sampling,
        messages=messages,
        model=route.backend_model,
        options=options,
    )
