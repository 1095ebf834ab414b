"""The models a service serves, each with its own backend, and which one a request line names.

A ``ServedModel`` is a name, the backend that runs it and more names it answers to. A
``ModelSet`` holds them in order: the first is the default, which a line's ``"model": "default"``
or no ``model`` at all means. A backend may serve more models than its one name (the openai
backend serves every model its upstreams list, ``model_names``); a line naming one of those goes
to that backend with the name, which the backend routes by.

Starting: the default (first) model's backend must start, or the service does not start (as
with one backend). Another model whose backend cannot start is reported unavailable with the
reason, its batches are refused and its lines get error lines, and the other models go on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs

from batchgen.core.backends.base import Backend
from batchgen.core.backends.capabilities import (
    Capabilities,
    capabilities_of,
    unsupported_problem,
    unsupported_problems,
)
from batchgen.core.errors import InvalidRequest
from batchgen.core.models import Health

logger = logging.getLogger("batchgen.service")

#: What a request's ``model`` field may say to mean the default (first) model.
DEFAULT_MODEL_ALIAS = "default"


def names_tuple(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(names)


@attrs.define(eq=False)
class ServedModel:
    """One served model: its name (None: the backend's own ``model_name``), its backend, aliases."""

    backend: Backend
    name: str | None = None
    aliases: tuple[str, ...] = attrs.field(default=(), converter=names_tuple)
    #: Why the backend could not start (only with several models; the others go on).
    failure: str | None = None

    @property
    def public_name(self) -> str:
        return self.name or self.backend.model_name

    @property
    def capabilities(self) -> Capabilities:
        return capabilities_of(self.backend)

    @property
    def backend_models(self) -> tuple[str, ...]:
        """The further model names the backend itself serves (an openai backend's upstream models)."""
        names = getattr(self.backend, "model_names", ())
        return tuple(name for name in names if isinstance(name, str))

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a line may use for this model, its public name first."""
        names = (self.public_name, *self.aliases, *self.backend_models)
        return tuple(name for name in dict.fromkeys(names) if name)

    def health(self) -> Health:
        if self.failure is not None:
            return Health(False, self.failure)
        return self.backend.health()

    def describe(self, created: int) -> dict[str, Any]:
        """The model's ``GET /v1/models`` entry."""
        health = self.health()
        return {
            "id": self.public_name,
            "object": "model",
            "created": created,
            "owned_by": "batchgen",
            "root": self.backend.model_name or self.public_name,
            "backend": getattr(self.backend, "name", type(self.backend).__name__),
            "endpoints": list(self.capabilities.served_endpoints),
            "features": sorted(self.capabilities.features),
            "status": "ready" if health.healthy else "unavailable",
            **({} if health.healthy else {"reason": health.reason}),
        }


@attrs.frozen
class Route:
    """Where one line goes: the served model, and the name to hand its backend (None: its own)."""

    model: ServedModel
    backend_model: str | None


class ModelSet:
    """The served models in order; the first is the default."""

    def __init__(self, models: Sequence[ServedModel]) -> None:
        if not models:
            raise ValueError("a service serves at least one model")
        self.models = list(models)

    @classmethod
    def of(cls, backend: Backend | ModelSet | Sequence[ServedModel], aliases: Sequence[str] = ()) -> ModelSet:
        """A ModelSet from one backend (with ``aliases``), a list of ServedModel, or a ModelSet."""
        if isinstance(backend, ModelSet):
            return backend
        if isinstance(backend, Sequence):
            return cls(list(backend))
        return cls([ServedModel(backend, aliases=tuple(aliases))])

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self.models)

    def __len__(self) -> int:
        return len(self.models)

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    def accepted_names(self) -> tuple[str, ...]:
        """Every name a line's ``model`` may use, "default" included."""
        names = [name for model in self.models for name in model.names]
        return tuple(dict.fromkeys((*names, DEFAULT_MODEL_ALIAS)))

    def route(self, model_field: str | None) -> Route:
        """The model a line's ``model`` field names; InvalidRequest if none."""
        if model_field is None or model_field == DEFAULT_MODEL_ALIAS:
            return Route(self.default, None)
        for model in self.models:
            if model_field in (model.public_name, *model.aliases):
                return Route(model, None)
        for model in self.models:
            if model_field in model.backend_models:
                return Route(model, model_field)
        served = ", ".join(map(repr, self.accepted_names()))
        raise InvalidRequest(
            f"'body.model' {model_field!r} is not served here; use one of {served}",
            param="body.model",
        )

    def check_line(self, url: str, body: Any) -> ServedModel:
        """The model a line runs on; InvalidRequest if it is not served or cannot run the line."""
        route = self.route(body.model)
        model = route.model
        problem = unsupported_problem(
            model.public_name, getattr(model.backend, "name", "?"), model.capabilities, url, body
        )
        if problem is not None:
            raise InvalidRequest(problem, param="body.model")
        return model

    def line_problems(self, url: str, body: Any) -> tuple[ServedModel | None, list[InvalidRequest]]:
        """The model a line runs on (None when it names none served) and every reason it cannot run
        there, each naming its field; ``check_line`` raises exactly when the list is not empty."""
        try:
            model = self.route(body.model).model
        except InvalidRequest as exc:
            return None, [exc]
        problems = unsupported_problems(
            model.public_name, getattr(model.backend, "name", "?"), model.capabilities, url, body
        )
        return model, [InvalidRequest(message, param=param) for param, message in problems]

    async def start(self) -> None:
        """Start every backend (see the module docstring for what a failure does)."""
        await self.default.backend.start()
        for model in self.models[1:]:
            try:
                await model.backend.start()
            except Exception as exc:
                label = model.name or getattr(model.backend, "name", "backend")
                model.failure = f"the {getattr(model.backend, 'name', '')} backend could not start: {exc}"
                logger.error("model %r is unavailable: %s", label, model.failure)

    async def abort(self, request_id: str) -> None:
        """Abort a request on whichever backend runs it (an unknown id is harmless to a backend)."""
        for model in self.models:
            await model.backend.abort(request_id)

    async def stop(self) -> None:
        for model in reversed(self.models):
            try:
                await model.backend.stop()
            except Exception:
                logger.exception("stopping the backend of model %r failed", model.public_name)

    def health(self) -> Health:
        """Healthy when every model is; unhealthy (with each reason) when none is."""
        states = [(model, model.health()) for model in self.models]
        if all(state.healthy for _, state in states):
            return Health(True)
        reasons = "; ".join(
            f"{model.public_name}: {state.reason}" for model, state in states if not state.healthy
        )
        if len(states) == 1:
            return states[0][1]
        return Health(any(state.healthy for _, state in states), reasons)
