"""OpenAIUpstreamBackend: run requests on OpenAI-compatible HTTP servers you already run.

Each request is one ``POST {upstream}/chat/completions``, ``/completions`` or ``/embeddings``
(non-streaming) to one of the ``--upstream`` base URLs: SGLang, vLLM, llama.cpp's
``llama-server``, ``transformers serve``, or a router in front of many of them.

Every upstream's models are learnt from its ``GET /models`` (at start, and whenever it is probed
again): the backend serves each of them (``model_names``), and a request naming one goes only to
upstreams that list it. A request naming none gets ``--upstream-model`` (default: the first model
the first answering upstream lists). ``response_format``, ``logprobs``/``top_logprobs``, ``n`` and
the embeddings ``dimensions`` are passed through; the upstream's choices are written as it
answered them when a line asks for logprobs or several choices. The pure policies (adaptive concurrency, up/down,
where an attempt goes) live in ``upstream_concurrency``; this module does the HTTP.

How one request goes::

    wait for a free slot on an up upstream (a first attempt: its prompt prefix's upstream when
    that one has room; else the one this request tried least, then the least loaded relative to
    its limit)
    POST ─▶ 200 with choices ──────────────▶ GenerationResult (limit may grow)
         ├▶ 400/413/422 ───────────────────▶ RequestRejected: context_length_exceeded, or
         │                                    invalid_request with the upstream's message
         ├▶ 408/429/5xx, timeout, connection ▶ overload: the limit halves; counts toward down
         ├▶ 401/403/404/409, bad body ───────▶ failure: counts toward down
         └▶ cannot connect ─────────────────▶ the upstream is down at once
    after a failure: retry (another upstream when one is up) up to ``max_attempts`` in all,
    then RequestRejected("upstream_error") with every attempt's error.
    whenever every upstream is down ───────▶ BackendUnavailable (the running batches fail)

A down upstream is probed with ``GET {upstream}/models`` until it answers, then gets requests
again starting from the initial limit. ``abort`` cancels the HTTP call (the upstream sees the
connection close). httpx is imported in ``start``, so importing this module needs nothing extra.

Prefix affinity: a chat or completions request's prompt prefix key (``prefix_keys.prefix_key``,
computed here from the messages or prompt sent upstream, with the upstream model name) picks the
upstream its first attempt prefers (``upstream_concurrency.prefix_home``), so the requests that
share a prefix meet one engine's prefix cache; each upstream counts what became of its prefixes'
requests (``UpstreamState.affinity``: kept, or sent elsewhere because it was down or full).
"""

from __future__ import annotations

import contextlib
import logging
import random
import re
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import anyio.abc
import attrs
import msgspec

from batchgen.core.backends.base import (
    BackendUnavailable,
    RequestAborted,
    RequestRejected,
    context_length_exceeded,
)
from batchgen.core.backends.cached_tokens import upstream_cached_tokens
from batchgen.core.backends.capabilities import (
    CHOICES,
    DIMENSIONS,
    GREEDY,
    LOGPROBS,
    RESPONSE_FORMAT,
    UPSTREAM_SAMPLING,
    Capabilities,
)
from batchgen.core.backends.http_client_shards import ClientShards
from batchgen.core.backends.option_types import positive_int
from batchgen.core.backends.spec import BackendOption, BackendSpec
from batchgen.core.backends.text import trim_at_stop
from batchgen.core.backends.upstream_concurrency import (
    AdaptiveLimit,
    UpstreamHealth,
    UpstreamState,
    affinity_outcome,
    all_down,
    choose_upstream,
    free_slots,
)
from batchgen.core.models import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    EMBEDDINGS,
    GenerationRequest,
    GenerationResult,
    Health,
)
from batchgen.core.requests.prefix_keys import prefix_key
from batchgen.core.url_redaction import redact_logger, redact_url

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger("batchgen.backends.openai")
# an upstream URL may carry credentials (user:password@, ?api_key=): the log shows them redacted
redact_logger(logger.name)
redact_logger("httpx")  # it logs every request's full URL

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode

#: Statuses that say the upstream is overloaded or broken right now: back off and retry.
_OVERLOAD_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
#: Statuses that say this request is wrong: no other upstream will take it either.
_REJECT_STATUSES = frozenset({400, 413, 422})
_MAX_MESSAGE_CHARS = 500
#: How often a request that only some upstreams serve looks for a free slot on one of them.
_RESTRICTED_RECHECK_S = 0.05

_CONTEXT_HINT = re.compile(
    r"context[ _](?:length|size|window)|maximum context|prompt is too long|input is too long|too many tokens",
    re.IGNORECASE,
)
#: How servers word "the prompt is longer than the context" (prompt and context token counts).
_CONTEXT_NUMBERS = tuple(
    re.compile(pattern, re.IGNORECASE)
    for pattern in (
        # vLLM and OpenAI
        r"maximum context length is (?P<context>\d+) tokens\. However, (?:your request has|your messages "
        r"resulted in) (?P<prompt>\d+) (?:input )?tokens",
        r"maximum context length is (?P<context>\d+) tokens\. However, you requested \d+ tokens "
        r"\((?P<prompt>\d+) in the messages",
        r"maximum context length is (?P<context>\d+) tokens and your request has (?P<prompt>\d+) input tokens",
        # SGLang
        r"input \((?P<prompt>\d+) tokens\) is longer than the model's context length \((?P<context>\d+) tokens\)",
        r"maximum context length of (?P<context>\d+) tokens\. You requested a total of \d+ tokens: "
        r"(?P<prompt>\d+) tokens from the input",
        # llama.cpp
        r"request \((?P<prompt>\d+) tokens\) exceeds the available context size \((?P<context>\d+) tokens\)",
    )
)


@attrs.frozen
class _Failure:
    """Why one attempt failed, and what it says about the upstream."""

    reason: str
    overload: bool  # halve the upstream's limit
    counts_toward_down: bool = True
    down_now: bool = False  # nothing listens there: down without waiting for more failures
    retry_after_s: float | None = None


class _MalformedResponse(Exception):
    pass


def normalize_base_url(url: str) -> str:
    """``http://host:port/v1`` without a trailing slash; a URL with no path gets ``/v1``."""
    text = url.strip().rstrip("/")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"--upstream must be an http(s) URL such as http://10.0.0.5:30000/v1, got {redact_url(url)!r}"
        )
    path = parts.path or "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


#: The upstream path of each endpoint.
_PATHS = {CHAT_COMPLETIONS: "/chat/completions", COMPLETIONS: "/completions", EMBEDDINGS: "/embeddings"}


def build_body(request: GenerationRequest, model: str) -> dict[str, Any]:
    """The OpenAI request body for one generation request."""
    sampling = request.sampling
    body: dict[str, Any] = {"model": model}
    if request.endpoint == EMBEDDINGS:
        body["input"] = [item if isinstance(item, str) else list(item) for item in request.inputs or ()]
        body["encoding_format"] = "float"  # the service encodes base64 itself
        body.update(request.options)
        return body
    if request.endpoint == CHAT_COMPLETIONS:
        body["messages"] = list(request.messages or ())
    else:
        body["prompt"] = request.prompt or ""
    body["max_tokens"] = sampling.max_tokens
    body["temperature"] = sampling.temperature
    body["top_p"] = sampling.top_p
    if sampling.top_k != -1:
        body["top_k"] = sampling.top_k  # an extension SGLang, vLLM and llama.cpp accept
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    body.update(request.options)
    return body


def parse_embeddings(payload: Any) -> GenerationResult:
    """The vectors of an upstream's embeddings answer, in input order; _MalformedResponse if not one."""
    try:
        items = sorted(payload["data"], key=lambda item: int(item["index"]))
        vectors = tuple(tuple(float(value) for value in item["embedding"]) for item in items)
        usage = payload.get("usage") or {}
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise _MalformedResponse(f"the answer is not an embeddings list: {_short(repr(payload))}") from exc
    return GenerationResult("", "stop", prompt_tokens, 0, embeddings=vectors)


def parse_result(endpoint: str, payload: Any, keep_choices: bool = False) -> GenerationResult:
    """A GenerationResult from an upstream's 200 answer; _MalformedResponse if it is not one.

    ``keep_choices``: the line asked for logprobs or several choices; keep the choices as sent.
    ``cached_tokens`` is the upstream's ``usage.prompt_tokens_details.cached_tokens`` (vLLM with
    ``--enable-prompt-tokens-details``, SGLang, OpenAI), None when absent or malformed."""
    if endpoint == EMBEDDINGS:
        return parse_embeddings(payload)
    try:
        choice = payload["choices"][0]
        if endpoint == CHAT_COMPLETIONS:
            message = choice["message"]
            text = message.get("content") or ""
            reasoning = message.get("reasoning_content") or message.get("reasoning") or None
        else:
            text = choice.get("text") or ""
            reasoning = None
        finish = choice.get("finish_reason")
        usage = payload.get("usage") or {}
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        completion_tokens = int(usage.get("completion_tokens") or 0)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
        raise _MalformedResponse(f"the answer is not a completion: {_short(repr(payload))}") from exc
    if finish == "abort":
        raise _MalformedResponse("the upstream aborted the request")
    choices = None
    if keep_choices and isinstance(payload.get("choices"), list):
        choices = tuple(item for item in payload["choices"] if isinstance(item, dict))
    return GenerationResult(
        text=str(text),
        finish_reason="length" if finish == "length" else "stop",
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        reasoning_content=None if reasoning is None else str(reasoning),
        choices=choices,
        cached_tokens=upstream_cached_tokens(usage, prompt_tokens),
    )


def without_stop_sequence(result: GenerationResult, stop: Sequence[str]) -> GenerationResult:
    """A ``stop`` result cut before the first stop string in its text; some servers keep it.

    OpenAI's text never contains a stop sequence; ``transformers serve`` leaves the one that ended
    the text at its end. A ``length`` result is left as the upstream wrote it.
    """
    if result.finish_reason != "stop":
        return result
    text, cut = trim_at_stop(result.text, stop)
    return attrs.evolve(result, text=text) if cut else result


def error_message(payload: Any, text: str) -> str:
    """The human message of an upstream's error answer (OpenAI, FastAPI or plain-text shaped)."""
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and error.get("message"):
            return _short(str(error["message"]))
        for key in ("error", "detail", "message"):
            if isinstance(payload.get(key), str) and payload[key]:
                return _short(payload[key])
        if payload.get("detail") is not None:
            return _short(str(payload["detail"]))
    return _short(text.strip()) or "(no message)"


def context_rejection(payload: Any, message: str) -> RequestRejected | None:
    """``context_length_exceeded`` if an upstream's 4xx answer says the prompt is too long."""
    error = payload.get("error") if isinstance(payload, dict) else None
    error = error if isinstance(error, dict) else {}
    marked = (
        error.get("code") == "context_length_exceeded" or error.get("type") == "exceed_context_size_error"
    )
    if not marked and not _CONTEXT_HINT.search(message):
        return None
    prompt, context = error.get("n_prompt_tokens"), error.get("n_ctx")
    if not (isinstance(prompt, int) and isinstance(context, int)):
        for pattern in _CONTEXT_NUMBERS:
            match = pattern.search(message)
            if match:
                prompt, context = int(match["prompt"]), int(match["context"])
                break
    if isinstance(prompt, int) and isinstance(context, int) and prompt > context:
        return context_length_exceeded(prompt, context)
    # The numbers are unknown, or the prompt fits but prompt + max_tokens does not: say it as the
    # upstream did.
    return RequestRejected("context_length_exceeded", message)


def _short(text: str) -> str:
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[: _MAX_MESSAGE_CHARS - 1] + "…"


def _describe(exc: BaseException) -> str:
    detail = str(exc).strip()
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def _retry_after(response: httpx.Response) -> float | None:
    """Seconds from ``retry-after-ms`` or a numeric ``retry-after`` header, if any."""
    try:
        if "retry-after-ms" in response.headers:
            return float(response.headers["retry-after-ms"]) / 1000
        if "retry-after" in response.headers:
            return float(response.headers["retry-after"])
    except ValueError:
        pass
    return None


class OpenAIUpstreamBackend:
    """Spreads requests over OpenAI-compatible upstream servers with adaptive concurrency each.

    ``upstreams``           base URLs (``http://host:port/v1``); a URL with no path gets ``/v1``
    ``api_key``             bearer token sent to every upstream, or None
    ``model``               model name sent upstream; None: the first model of the first upstream's
                            ``GET /models`` (also what output lines and ``/v1/models`` report)
    ``max_concurrency``     most requests in flight to one upstream; the limit adapts below it
    ``initial_concurrency`` the limit an upstream starts with (and restarts with after being down)
    ``context_length``      when set, a result whose upstream-reported prompt tokens exceed it
                            becomes ``context_length_exceeded`` (the upstream's own limit applies too)
    ``max_attempts``        attempts per request (the first and its retries) before an error line
    ``failures_to_mark_down`` consecutive failed attempts after which an upstream is down
    ``transport``           an httpx transport to use instead of the network (tests)
    """

    name = "openai"
    capabilities = Capabilities(
        endpoints=frozenset({CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS}),
        features=frozenset({RESPONSE_FORMAT, LOGPROBS, CHOICES, DIMENSIONS}) | UPSTREAM_SAMPLING,
        # an upstream's seed is best effort (OpenAI's words), so only greedy answers are replayed
        deterministic=frozenset({GREEDY}),
    )

    def __init__(
        self,
        *,
        upstreams: Sequence[str],
        api_key: str | None = None,
        model: str | None = None,
        max_concurrency: int = 64,
        initial_concurrency: int = 4,
        context_length: int | None = None,
        max_attempts: int = 4,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        probe_timeout_s: float = 5.0,
        failures_to_mark_down: int = 3,
        probe_interval_s: float = 1.0,
        max_probe_interval_s: float = 30.0,
        retry_backoff_s: float = 0.25,
        max_retry_delay_s: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if isinstance(upstreams, str):
            upstreams = [upstreams]
        urls = [normalize_base_url(url) for url in upstreams]
        if not urls:
            raise ValueError("--backend openai needs at least one --upstream URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"an --upstream URL is given twice: {', '.join(map(redact_url, urls))}")
        if max_concurrency < 1 or initial_concurrency < 1 or max_attempts < 1:
            raise ValueError("max_concurrency, initial_concurrency and max_attempts must be at least 1")
        self.api_key = api_key
        self.model_name = model or ""
        self.context_length = context_length
        self.max_attempts = max_attempts
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.retry_backoff_s = retry_backoff_s
        self.max_retry_delay_s = max_retry_delay_s
        self.upstreams = [
            UpstreamState(
                url=url,
                limit=AdaptiveLimit(maximum=max_concurrency, initial=initial_concurrency),
                health=UpstreamHealth(
                    failures_to_mark_down=failures_to_mark_down,
                    probe_interval_s=probe_interval_s,
                    max_probe_interval_s=max_probe_interval_s,
                ),
            )
            for url in urls
        ]
        #: The models each upstream listed when it last answered ``GET /models`` (None: not yet).
        self.upstream_models: list[tuple[str, ...] | None] = [None] * len(self.upstreams)
        self._transport = transport
        #: The HTTP clients (None until started): requests in flight spread over small pools.
        self._clients: ClientShards | None = None
        self._httpx: Any = None
        self._scopes: dict[str, anyio.CancelScope] = {}
        self._waiters: deque[anyio.Event] = deque()
        self._probes: contextlib.AsyncExitStack | None = None
        self._probe_tasks: anyio.abc.TaskGroup | None = None

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the HTTP client, probe every upstream once, and start re-probing down ones."""
        if self._clients is not None:
            return
        try:
            import httpx
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "the openai backend needs httpx: pip install 'batchgen-core[openai]' (or httpx)"
            ) from exc
        self._httpx = httpx
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        timeout = httpx.Timeout(self.request_timeout_s, connect=self.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._clients = ClientShards(
            lambda: httpx.AsyncClient(
                transport=self._transport, headers=headers, timeout=timeout, limits=limits
            )
        )
        async with anyio.create_task_group() as tasks:
            for index in range(len(self.upstreams)):
                tasks.start_soon(self._probe, index, True)
        if all_down(self.upstreams):
            logger.warning("no upstream answers yet; requests fail until one does: %s", self._down_reason())
        self._probes = contextlib.AsyncExitStack()
        self._probe_tasks = await self._probes.enter_async_context(anyio.create_task_group())
        self._probe_tasks.start_soon(self._probe_down_upstreams)

    async def stop(self) -> None:
        for scope in list(self._scopes.values()):
            scope.cancel()
        if self._probes is not None and self._probe_tasks is not None:
            self._probe_tasks.cancel_scope.cancel()
            await self._probes.aclose()
        self._probes = self._probe_tasks = None
        if self._clients is not None:
            await self._clients.aclose()
            self._clients = None

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every model some upstream serves, in the order they were listed."""
        names = [name for models in self.upstream_models for name in models or ()]
        return tuple(dict.fromkeys(names))

    def _serving(self, model: str) -> frozenset[int] | None:
        """The upstreams a request for ``model`` may go to (None: any, when none lists models or
        the model is the one named with --upstream-model)."""
        eligible = frozenset(
            index for index, models in enumerate(self.upstream_models) if models is None or model in models
        )
        return None if len(eligible) == len(self.upstreams) or not eligible else eligible

    def health(self) -> Health:
        if self._clients is None:
            return Health(False, "the openai backend is not started")
        if all_down(self.upstreams):
            return Health(False, self._down_reason())
        return Health(True)

    # --- requests -------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        with anyio.CancelScope() as scope:
            self._scopes[request.request_id] = scope
            try:
                return await self._generate(request)
            finally:
                del self._scopes[request.request_id]
        raise RequestAborted(request.request_id)

    async def abort(self, request_id: str) -> None:
        scope = self._scopes.get(request_id)
        if scope is not None:
            scope.cancel()

    async def _generate(self, request: GenerationRequest) -> GenerationResult:
        if self._clients is None:
            raise BackendUnavailable("the openai backend is not started")
        path = _PATHS[request.endpoint]
        model = request.model or self.model_name
        body = _encode(build_body(request, model))
        eligible = self._serving(model)
        prefix = prefix_key(model, messages=request.messages, prompt=request.prompt)
        keep_choices = any(key in request.options for key in ("n", "logprobs", "top_logprobs"))
        tried: dict[int, int] = {}
        failures: list[str] = []
        for attempt in range(1, self.max_attempts + 1):
            index = await self._acquire(tried, eligible, prefix)
            if prefix is not None and not tried:
                home, outcome_of_affinity = affinity_outcome(self.upstreams, prefix, index, eligible)
                self.upstreams[home].affinity[outcome_of_affinity] += 1
            tried[index] = tried.get(index, 0) + 1
            outcome = await self._attempt(index, path, body, request.endpoint, keep_choices)
            if isinstance(outcome, GenerationResult):
                if outcome.choices is None:
                    outcome = without_stop_sequence(outcome, request.sampling.stop)
                if self.context_length is not None and outcome.prompt_tokens > self.context_length:
                    raise context_length_exceeded(outcome.prompt_tokens, self.context_length)
                return outcome
            failures.append(f"{redact_url(self.upstreams[index].url)}: {outcome.reason}")
            if all_down(self.upstreams):
                raise BackendUnavailable(self._down_reason())
            if attempt < self.max_attempts:
                logger.info("retrying %s after: %s", request.request_id, failures[-1])
                await anyio.sleep(self._retry_delay(attempt, outcome.retry_after_s))
        raise RequestRejected(
            "upstream_error",
            f"The upstream servers failed this request {self.max_attempts} times: {'; '.join(failures)}",
        )

    def _retry_delay(self, attempt: int, retry_after_s: float | None) -> float:
        if retry_after_s is not None:
            return min(self.max_retry_delay_s, retry_after_s)
        backoff = self.retry_backoff_s * 2 ** (attempt - 1)
        return min(self.max_retry_delay_s, backoff) * random.uniform(0.5, 1.0)

    async def _acquire(
        self, tried: dict[int, int], eligible: frozenset[int] | None = None, prefix: int | None = None
    ) -> int:
        """Take a slot on the upstream ``choose_upstream`` picks (for ``prefix``, a prompt prefix
        key, its prefix's upstream when it has room), waiting while all are full.

        Waiting is first come, first served: a newcomer queues behind earlier waiters even when a
        slot is free (a woken waiter is about to take it), and a woken waiter that finds no slot
        after all goes back to the head of the queue. A request that only some upstreams serve
        (``eligible``) also looks again every ``_RESTRICTED_RECHECK_S``, since a slot freed on
        another upstream wakes it for nothing.
        """
        woken = False
        while True:
            if all_down(self.upstreams):
                raise BackendUnavailable(self._down_reason())
            if woken or not self._waiters or eligible is not None:
                index = choose_upstream(self.upstreams, tried, eligible, prefix)
                if index is not None:
                    self.upstreams[index].in_flight += 1
                    return index
            event = anyio.Event()
            if woken and eligible is None:
                self._waiters.appendleft(event)
            else:
                self._waiters.append(event)
            try:
                if eligible is None:
                    await event.wait()
                else:
                    with anyio.move_on_after(_RESTRICTED_RECHECK_S):
                        await event.wait()
                    if not event.is_set():
                        self._waiters.remove(event)
            except BaseException:
                if event.is_set():
                    self._wake()  # hand the wake-up this waiter got to the next one
                else:
                    self._waiters.remove(event)
                raise
            woken = True

    def _wake(self) -> None:
        """Wake as many waiting attempts as there are free slots, or all when every upstream is down."""
        count = len(self._waiters) if all_down(self.upstreams) else free_slots(self.upstreams)
        for _ in range(min(count, len(self._waiters))):
            self._waiters.popleft().set()

    async def _attempt(
        self, index: int, path: str, body: bytes, endpoint: str, keep_choices: bool = False
    ) -> GenerationResult | _Failure:
        """One POST to one upstream, whose slot was taken by ``_acquire``; updates its policies."""
        upstream = self.upstreams[index]
        ticket = upstream.limit.ticket(upstream.in_flight)
        try:
            outcome = await self._post(upstream.url + path, body, endpoint, keep_choices)
        finally:
            upstream.in_flight -= 1
            self._wake()
        if isinstance(outcome, _Failure):
            upstream.failures += 1
            if outcome.overload and upstream.limit.on_overload(ticket):
                logger.info(
                    "%s: concurrency limit now %d (%s)", upstream.url, upstream.limit.limit, outcome.reason
                )
            now = anyio.current_time()
            if outcome.down_now and not upstream.health.down:
                upstream.health.mark_down(outcome.reason, now)
                went_down = True
            else:
                went_down = outcome.counts_toward_down and upstream.health.on_failure(outcome.reason, now)
            if went_down:
                logger.warning("upstream %s is down: %s", upstream.url, outcome.reason)
                self._wake()
            return outcome
        upstream.health.on_success()
        if isinstance(outcome, RequestRejected):
            raise outcome
        before = upstream.limit.limit
        upstream.limit.on_success(ticket)
        if upstream.limit.limit != before:
            self._wake()
        return outcome

    async def _post(
        self, url: str, body: bytes, endpoint: str, keep_choices: bool = False
    ) -> GenerationResult | RequestRejected | _Failure:
        assert self._clients is not None
        httpx = self._httpx
        try:
            with self._clients.client() as client:
                response = await client.post(url, content=body, headers={"Content-Type": "application/json"})
        except httpx.TimeoutException as exc:
            return _Failure(f"timed out ({_describe(exc)})", overload=True)
        except httpx.ConnectError as exc:
            return _Failure(f"cannot connect ({_describe(exc)})", overload=True, down_now=True)
        except httpx.TransportError as exc:
            return _Failure(f"connection failed ({_describe(exc)})", overload=True)
        try:
            payload = _decode(response.content)
        except msgspec.DecodeError:
            payload = None
        status = response.status_code
        if status == 200:
            try:
                return parse_result(endpoint, payload, keep_choices)
            except _MalformedResponse as exc:
                return _Failure(str(exc), overload=False)
        message = error_message(payload, response.text)
        if status in _REJECT_STATUSES:
            rejection = context_rejection(payload, message)
            if rejection is not None:
                return rejection
            return RequestRejected(
                "invalid_request",
                f"The upstream {redact_url(url)} rejected the request (HTTP {status}): {message}",
            )
        return _Failure(
            f"HTTP {status}: {message}",
            overload=status in _OVERLOAD_STATUSES,
            counts_toward_down=status != 429,  # busy, not broken
            retry_after_s=_retry_after(response),
        )

    # --- probing --------------------------------------------------------------------------
    async def _probe_down_upstreams(self) -> None:
        while True:
            await anyio.sleep(0.2)
            now = anyio.current_time()
            due = [index for index, upstream in enumerate(self.upstreams) if upstream.health.probe_due(now)]
            if due:
                async with anyio.create_task_group() as tasks:
                    for index in due:
                        tasks.start_soon(self._probe, index, False)

    async def _probe(self, index: int, first: bool) -> None:
        """``GET /models`` on one upstream: up if it answers (learning the model name if needed)."""
        assert self._clients is not None
        upstream = self.upstreams[index]
        error: str | None = None
        try:
            response = await self._clients.first().get(f"{upstream.url}/models", timeout=self.probe_timeout_s)
            payload = _decode(response.content) if response.status_code == 200 else None
            if response.status_code != 200:
                error = (
                    f"GET /models answered HTTP {response.status_code}: {error_message(None, response.text)}"
                )
        except self._httpx.HTTPError as exc:
            error = f"GET /models failed ({_describe(exc)})"
        except msgspec.DecodeError:
            error = "GET /models did not answer JSON"
        ids: list[str] = []
        if error is None:
            models = payload.get("data") if isinstance(payload, dict) else None
            ids = [m["id"] for m in models or () if isinstance(m, dict) and isinstance(m.get("id"), str)]
            if ids:
                self.upstream_models[index] = tuple(ids)
        if error is None and not self.model_name:
            if ids:
                self.model_name = ids[0]
                logger.info("serving model %r, as %s lists it first", self.model_name, upstream.url)
            else:
                error = "GET /models lists no model; name one with --upstream-model"
        now = anyio.current_time()
        if error is not None:
            if first or not upstream.health.down:
                upstream.health.mark_down(error, now)
                logger.warning("upstream %s is down: %s", upstream.url, error)
            else:
                upstream.health.on_probe_failure(error, now)
            self._wake()
            return
        if upstream.health.down:
            logger.info("upstream %s is up again", upstream.url)
            upstream.limit.reset()
        upstream.health.on_probe_success()
        self._wake()

    def _down_reason(self) -> str:
        errors = ", ".join(f"{redact_url(u.url)} ({u.health.last_error})" for u in self.upstreams)
        return f"every upstream server is down: {errors}; each is probed until it answers again"


SPEC = BackendSpec(
    name="openai",
    factory=OpenAIUpstreamBackend,
    summary="spreads requests over OpenAI-compatible --upstream servers",
    options=(
        BackendOption(
            "upstreams",
            "--upstream",
            help="base URL of an OpenAI-compatible server, e.g. http://10.0.0.5:30000/v1",
            repeatable=True,
            metavar="URL",
            required=True,
        ),
        BackendOption("api_key", "--upstream-api-key", help="bearer token sent to the upstreams"),
        BackendOption(
            "model",
            "--upstream-model",
            help="model name sent upstream",
            default_help="the first model the first answering upstream lists",
        ),
        BackendOption(
            "max_concurrency",
            "--upstream-max-concurrency",
            positive_int,
            64,
            "most requests in flight to one upstream; concurrency adapts below this",
        ),
        BackendOption(
            "initial_concurrency",
            "--upstream-initial-concurrency",
            positive_int,
            4,
            "requests in flight to an upstream at first (and again after it was down); the limit "
            "doubles from here while every slot is busy and answers come back. Set it near the "
            "upstream's batch size (vLLM's --max-num-seqs, SGLang's --max-running-requests) to "
            "skip the ramp",
        ),
    ),
    context_length_keyword="context_length",
)
