"""SGLangBackend: SGLang's in-process offline ``Engine``, the GPU production engine.

``sglang`` is imported when the backend starts, never when this module is imported, so BatchGen
installs and runs without it. What is used of SGLang is this part of its documented interface:
``sglang.Engine(**server_args)``, ``await engine.async_generate(input_ids=... | prompt=...,
sampling_params=..., rid=...)``, ``engine.tokenizer_manager.abort_request(rid)``,
``engine.tokenizer_manager.tokenizer`` and ``.context_len``, and ``engine.shutdown()``.

Requests. Chat messages go through the tokenizer's chat template, completions use the raw
prompt; the backend tokenizes (as SGLang's own OpenAI server does), checks the prompt against the
context, and sends the token ids, so nothing is tokenized twice. OpenAI sampling parameters map
to SGLang's (``max_tokens`` → ``max_new_tokens``, ``seed`` → ``sampling_seed``, ``top_k`` -1 is
left out; ``frequency_penalty`` and ``presence_penalty`` keep their names, as SGLang applies them
the way OpenAI defines them), and ``max_new_tokens`` is capped to what the context leaves, as SGLang refuses a
request whose prompt plus output limit does not fit. A ``<think>…</think>`` block in the answer
becomes ``reasoning_content``. ``meta_info["cached_tokens"]``, the prompt tokens SGLang's radix
cache served, becomes the result's ``cached_tokens`` (bounded by the prompt).

Errors, by what they mean for the request:

- prompt longer than the context → ``RequestRejected("context_length_exceeded")`` with the
  guide's message, checked here before sending; SGLang's own validation errors (``ValueError``,
  aborts with status 400) → ``RequestRejected`` too;
- aborts and refusals with status 429/5xx (queue full, scheduler-side errors) →
  ``TransientBackendError``: the service retries, then writes an error line;
- anything else the engine raises means the engine itself is broken: the backend reports itself
  unhealthy with the reason, ends the requests still running, and raises ``BackendUnavailable``
  for this and every later request, so running batches end ``failed``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any

import anyio
import attrs

from batchgen.core.backends.base import (
    BackendUnavailable,
    RequestAborted,
    RequestRejected,
    TransientBackendError,
    context_length_exceeded,
)
from batchgen.core.backends.cached_tokens import bounded_cached_tokens
from batchgen.core.backends.capabilities import (
    FREQUENCY_PENALTY,
    GREEDY,
    PRESENCE_PENALTY,
    RESPONSE_FORMAT,
    SEEDED,
    Capabilities,
)
from batchgen.core.backends.option_types import key_value, positive_int
from batchgen.core.backends.spec import BackendOption, BackendSpec
from batchgen.core.backends.text import prompt_opens_reasoning, rendered_chat, split_reasoning
from batchgen.core.models import GenerationRequest, GenerationResult, Health, SamplingParameters

logger = logging.getLogger("batchgen.backends.sglang")

#: Options with their own constructor argument (and server flag); not accepted in ``engine_args``.
_NAMED_OPTIONS = ("model_path", "tp_size", "dp_size", "context_length", "mem_fraction_static")

#: HTTP statuses SGLang attaches to refusals that may succeed when tried again.
_TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})

#: OpenAI's penalties, which SGLang's sampling parameters take by the same names and with the same
#: meaning (subtracted from a token's logit: ``frequency_penalty`` times its count in the output so
#: far, ``presence_penalty`` once it has appeared), in OpenAI's range -2 to 2.
_PENALTIES = (FREQUENCY_PENALTY, PRESENCE_PENALTY)

_PROMPT_TOO_LONG = re.compile(
    r"input \((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)", re.IGNORECASE
)


def rejection_for(message: str) -> RequestRejected:
    """The rejection for one of SGLang's per-request validation errors."""
    match = _PROMPT_TOO_LONG.search(message)
    if match is not None:
        return context_length_exceeded(int(match.group(1)), int(match.group(2)))
    lowered = message.lower()
    if "context length" in lowered or "maximum allowed length" in lowered:
        return RequestRejected("context_length_exceeded", message)
    return RequestRejected("invalid_request", message)


def structured_output_params(response_format: dict[str, Any] | None) -> dict[str, Any]:
    """SGLang's ``json_schema`` sampling parameter (a JSON string) for an OpenAI ``response_format``:
    the schema of ``json_schema``, or any JSON object for ``json_object``; nothing for ``text``."""
    if not response_format:
        return {}
    kind = response_format.get("type")
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema") or {}
        return {"json_schema": json.dumps(schema)}
    if kind == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    return {}


def sampling_params(
    sampling: SamplingParameters, max_new_tokens: int, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """SGLang's ``sampling_params`` for a request's resolved OpenAI parameters (and its
    ``response_format`` and penalties, from ``options``)."""
    options = options or {}
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
    }
    if sampling.top_k > 0:  # -1 is OpenAI's "off", which SGLang spells by leaving it out
        params["top_k"] = sampling.top_k
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    for penalty in _PENALTIES:  # the same names and meaning in SGLang; 0 (the default) is left out
        if options.get(penalty):
            params[penalty] = float(options[penalty])
    params.update(structured_output_params(options.get("response_format")))
    return params


@attrs.define(eq=False)
class _InFlight:
    scope: anyio.CancelScope
    done: anyio.Event


@attrs.define
class _Prompt:
    """What is sent for one request: token ids (or text, with no tokenizer) and their count."""

    input_ids: list[int] | None
    text: str | None
    tokens: int | None
    opens_reasoning: bool = False


class SGLangBackend:
    name = "sglang"
    #: Chat and completions; ``response_format`` becomes SGLang's ``json_schema`` parameter, and
    #: the penalties are SGLang's own sampling parameters.
    capabilities = Capabilities(
        features=frozenset({RESPONSE_FORMAT, *_PENALTIES}), deterministic=frozenset({GREEDY, SEEDED})
    )

    def __init__(
        self,
        *,
        model_path: str,
        tp_size: int = 1,
        dp_size: int = 1,
        mem_fraction_static: float | None = None,
        context_length: int | None = None,
        engine_args: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
        model_name: str | None = None,
        abort_grace_s: float = 1.0,
    ) -> None:
        engine_args = dict(engine_args or {})
        repeated = sorted(set(engine_args) & set(_NAMED_OPTIONS))
        if repeated:
            flags = ", ".join(f"--{name.replace('_', '-')}" for name in repeated)
            raise ValueError(f"set {', '.join(repeated)} with {flags}, not as an SGLang engine argument")
        self.model_path = model_path
        self.tp_size = tp_size
        self.dp_size = dp_size
        self.mem_fraction_static = mem_fraction_static
        self.context_length = context_length
        self.engine_args = engine_args
        served = engine_args.get("served_model_name")
        self.model_name = model_name or (str(served) if served else model_path)
        self.abort_grace_s = abort_grace_s
        self._engine: Any = None
        self._tokenizer: Any = None
        self._context: int | None = context_length
        self._running: dict[str, _InFlight] = {}
        self._aborted: set[str] = set()
        self._dead_reason: str | None = None
        self._start_error: str | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        """The keyword arguments ``sglang.Engine`` is built with (None values left out)."""
        named = {
            "model_path": self.model_path,
            "tp_size": self.tp_size,
            "dp_size": self.dp_size,
            "context_length": self.context_length,
            "mem_fraction_static": self.mem_fraction_static,
        }
        return {**{k: v for k, v in named.items() if v is not None}, **self.engine_args}

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Build the engine (loads the model: minutes). Raises BackendUnavailable if it cannot."""
        if self._engine is not None:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise self._failed_start(
                "SGLang's engine runs on asyncio; run BatchService under asyncio"
            ) from None
        try:
            import sglang
        except ImportError as exc:
            raise self._failed_start(
                "the sglang package is not installed. Install SGLang on a machine with a CUDA GPU "
                "(see docs/backends-sglang.md)"
            ) from exc
        # Built on the event loop's own thread: SGLang binds the running loop and installs signal
        # handlers, which only the main thread may do. Nothing else is served while it loads.
        try:
            engine = sglang.Engine(**self.engine_kwargs())
        except Exception as exc:
            raise self._failed_start(f"{type(exc).__name__}: {exc}") from exc
        try:
            manager = engine.tokenizer_manager
            self._tokenizer = getattr(manager, "tokenizer", None)
            model_context = getattr(manager, "context_len", None)
            self._context = self.context_length or (int(model_context) if model_context else None)
        except Exception as exc:
            _shutdown_quietly(engine)
            raise self._failed_start(
                f"the engine started but is unusable: {type(exc).__name__}: {exc}"
            ) from exc
        self._engine = engine
        self._dead_reason = self._start_error = None
        logger.info(
            "SGLang %s serving %s (context %s)",
            getattr(sglang, "__version__", "?"),
            self.model_path,
            self._context or "unknown",
        )

    def _failed_start(self, why: str) -> BackendUnavailable:
        self._start_error = f"the SGLang engine for {self.model_path!r} could not start: {why}"
        return BackendUnavailable(self._start_error)

    async def stop(self) -> None:
        for flight in list(self._running.values()):
            flight.scope.cancel()
        engine, self._engine = self._engine, None
        if engine is not None:
            _shutdown_quietly(engine)

    def health(self) -> Health:
        if self._dead_reason is not None:
            return Health(False, self._dead_reason)
        if self._engine is None:
            return Health(False, self._start_error or "the SGLang engine is not running")
        return Health(True)

    # --- requests -----------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        engine = self._live_engine()
        prompt = self._prompt(request)
        max_new_tokens = request.sampling.max_tokens
        if prompt.tokens is not None and self._context is not None:
            # SGLang refuses a prompt that leaves no room for one output token, and a prompt
            # plus output limit that reaches the context; cap the limit instead of failing.
            room = self._context - prompt.tokens - 1
            if room < 1:
                raise context_length_exceeded(prompt.tokens, self._context)
            max_new_tokens = min(max_new_tokens, room)
        inputs = {"input_ids": prompt.input_ids} if prompt.input_ids is not None else {"prompt": prompt.text}
        rid = request.request_id
        flight = _InFlight(anyio.CancelScope(), anyio.Event())
        self._running[rid] = flight
        output: Any = None
        error: Exception | None = None
        try:
            with flight.scope:
                output = await engine.async_generate(
                    **inputs,
                    sampling_params=sampling_params(request.sampling, max_new_tokens, request.options),
                    rid=rid,
                )
        except Exception as exc:
            error = exc
        finally:
            self._running.pop(rid, None)
            flight.done.set()
        aborted = rid in self._aborted
        self._aborted.discard(rid)
        if error is None and output is not None and not _aborted_by_engine(output):
            return self._result(output, prompt)  # finished before the abort reached the engine
        if aborted:
            raise RequestAborted(rid)
        if error is not None:
            raise self._failure(error) from error
        if output is None:  # cancelled without an abort: the engine died or the backend stopped
            raise BackendUnavailable(self._dead_reason or "the SGLang backend was stopped")
        return self._result(output, prompt)

    async def abort(self, request_id: str) -> None:
        """Abort in the engine by rid; if it has not ended within ``abort_grace_s``, stop waiting."""
        flight = self._running.get(request_id)
        if flight is None:
            return
        self._aborted.add(request_id)
        if self._engine is not None and self._dead_reason is None:
            try:
                pending = self._engine.tokenizer_manager.abort_request(request_id)
                if inspect.isawaitable(pending):
                    await pending
            except Exception:
                logger.warning("SGLang could not abort %s", request_id, exc_info=True)
        with anyio.move_on_after(self.abort_grace_s):
            await flight.done.wait()
        flight.scope.cancel()

    def _live_engine(self) -> Any:
        if self._dead_reason is not None:
            raise BackendUnavailable(self._dead_reason)
        if self._engine is None:
            raise BackendUnavailable(self._start_error or "the SGLang engine is not running")
        return self._engine

    def _prompt(self, request: GenerationRequest) -> _Prompt:
        tokenizer = self._tokenizer
        if request.messages is not None:
            if tokenizer is None:
                raise RequestRejected(
                    "invalid_request",
                    "Chat requests need the model's tokenizer, which the engine did not load.",
                )
            text = rendered_chat(tokenizer, request.messages, backend="sglang")
            # The template wrote the special tokens itself, as SGLang's chat endpoint assumes.
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            return _Prompt(ids, text, len(ids), opens_reasoning=prompt_opens_reasoning(text))
        prompt = request.prompt
        if isinstance(prompt, list) and all(isinstance(token, int) for token in prompt):
            return _Prompt(list(prompt), None, len(prompt))
        if not isinstance(prompt, str):
            raise RequestRejected("invalid_request", "A completion request needs a string 'prompt'.")
        if tokenizer is None:
            return _Prompt(None, prompt, None)
        ids = list(tokenizer.encode(prompt))
        return _Prompt(ids, prompt, len(ids))

    def _failure(self, error: Exception) -> Exception:
        """What an exception from ``async_generate`` means for the request, or for the engine."""
        if isinstance(error, ValueError):  # SGLang's per-request validation
            return rejection_for(str(error))
        status = getattr(error, "status_code", None)
        if isinstance(status, int):
            detail = str(getattr(error, "detail", None) or error)
            if status == 400:
                return rejection_for(detail)
            if status in _TRANSIENT_STATUSES:
                return TransientBackendError(f"SGLang refused the request ({status}): {detail}")
        if isinstance(error, TimeoutError):
            return TransientBackendError(f"SGLang timed out: {error}")
        if isinstance(error, TypeError):  # every request would fail the same way
            return self._die(
                f"the installed SGLang does not accept BatchGen's requests (TypeError: {error}); "
                "see docs/backends-sglang.md for the SGLang versions it is written against"
            )
        return self._die(f"the SGLang engine died: {type(error).__name__}: {error}")

    def _die(self, reason: str) -> BackendUnavailable:
        if self._dead_reason is None:
            self._dead_reason = reason
            logger.error("%s; failing the requests still running", reason)
            for flight in list(self._running.values()):
                flight.scope.cancel()
        return BackendUnavailable(self._dead_reason)

    def _result(self, output: Any, prompt: _Prompt) -> GenerationResult:
        meta = output.get("meta_info") or {}
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind == "abort":
            info = finish if isinstance(finish, dict) else {}
            message = str(info.get("message") or "the engine aborted the request")
            if info.get("status_code") == 400:
                raise rejection_for(message)
            raise TransientBackendError(f"SGLang aborted the request: {message}")
        if kind not in ("stop", "length"):
            raise TransientBackendError(f"SGLang returned an unknown finish reason {finish!r}")
        text, reasoning = split_reasoning(
            str(output.get("text") or ""), opened_by_prompt=prompt.opens_reasoning
        )
        reported = meta.get("prompt_tokens")
        prompt_tokens = int(reported if reported is not None else prompt.tokens or 0)
        return GenerationResult(
            text=text,
            finish_reason=kind,
            prompt_tokens=prompt_tokens,
            completion_tokens=int(meta.get("completion_tokens") or 0),
            reasoning_content=reasoning,
            cached_tokens=bounded_cached_tokens(meta.get("cached_tokens"), prompt_tokens),
        )


def _aborted_by_engine(output: Any) -> bool:
    finish = (output.get("meta_info") or {}).get("finish_reason")
    return isinstance(finish, dict) and finish.get("type") == "abort"


def _shutdown_quietly(engine: Any) -> None:
    try:
        engine.shutdown()
    except Exception:
        logger.warning("shutting the SGLang engine down failed", exc_info=True)


SPEC = BackendSpec(
    name="sglang",
    factory=SGLangBackend,
    summary="drives SGLang's offline engine in this process (GPU machines)",
    options=(
        BackendOption(
            "model_path",
            "--model-path",
            aliases=("--model",),
            help="the model path (or id) handed to sglang.Engine",
            required=True,
        ),
        BackendOption("tp_size", "--tp-size", positive_int, 1, "tensor parallel size"),
        BackendOption("dp_size", "--dp-size", positive_int, 1, "data parallel size"),
        BackendOption(
            "mem_fraction_static",
            "--mem-fraction-static",
            float,
            help="fraction of GPU memory for weights and KV cache",
            default_help="SGLang's own",
        ),
        BackendOption(
            "engine_args",
            "--sglang-arg",
            key_value,
            help="any other sglang.Engine argument, e.g. --sglang-arg chunked_prefill_size=8192; "
            "values that read as JSON are decoded",
            repeatable=True,
            metavar="KEY=VALUE",
        ),
    ),
    context_length_keyword="context_length",
)
