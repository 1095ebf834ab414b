"""From a decoded batch line to the ``GenerationRequest`` its model's backend runs.

Chat and completion lines carry their messages or prompt; a ``/v1/responses`` line runs on the
chat path, its ``instructions`` and ``input`` made into messages (``responses_api``); an
embeddings line carries its inputs. Sampling parameters are resolved body > batch > server
(``parameters``), and the line's optional feature fields go to the backend only when its
capabilities declare them (``backends.capabilities``); upload validation has refused the others.
"""

from __future__ import annotations

from batchgen.core.backends.capabilities import passed_options
from batchgen.core.backends.served_models import Route
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
)


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
