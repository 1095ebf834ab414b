"""Domain types: files, batches, their states and counters, and what a backend is asked and answers.

Everything here is plain data (frozen attrs classes and str enums). The OpenAI-shaped dictionaries
the REST API returns are built by ``to_dict`` methods, so the server and an embedding pipeline see
exactly the same objects.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

import attrs


@attrs.frozen
class ProgressEstimate:
    """A batch's recent pace and what it predicts; None where it is unknown."""

    requests_per_second: float | None = None
    seconds_remaining: float | None = None
    #: The Unix time (whole seconds, rounded up) the batch is expected to be done.
    completion_at: int | None = None

    def to_dict(self) -> dict[str, float | int | None]:
        """The batch object's fields (rounded for reading)."""
        rate, left = self.requests_per_second, self.seconds_remaining
        return {
            "requests_per_second": None if rate is None else round(rate, 3),
            "estimated_seconds_remaining": None if left is None else round(left, 1),
            "estimated_completion_at": self.completion_at,
        }


UNKNOWN = ProgressEstimate()


class BatchStatus(enum.StrEnum):
    """The OpenAI batch lifecycle."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def is_active(self) -> bool:
        return not self.is_terminal


_TERMINAL = frozenset({BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED})

#: The endpoints a batch line may target. ``/v1/responses`` lines run on the chat path; whether a
#: model serves an endpoint is its backend's to say (``backends.capabilities``).
CHAT_COMPLETIONS = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
RESPONSES = "/v1/responses"
SUPPORTED_ENDPOINTS = (CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS, RESPONSES)

#: Purposes accepted on upload (OpenAI's); only ``batch`` files are validated as batch input.
UPLOAD_PURPOSES = ("batch", "assistants", "fine-tune", "vision", "user_data", "evals")
OUTPUT_PURPOSE = "batch_output"
#: The tenant that owns what is made without one (the embedded service, a server with no keys).
DEFAULT_TENANT = "default"


@attrs.frozen
class FileObject:
    """A stored file: an uploaded input, or a batch's output or error file."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    path: str
    line_count: int = 0
    url: str | None = None
    expires_at: int | None = None
    owner: str = DEFAULT_TENANT  # the tenant that made it (not part of the API object)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


@attrs.frozen
class RequestCounts:
    total: int = 0
    completed: int = 0
    failed: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"total": self.total, "completed": self.completed, "failed": self.failed}


@attrs.frozen
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: Of the above, what the result cache answered (``result_cache``): its requests and the
    #: tokens of their replayed bodies, which were not computed again.
    cached_requests: int = 0
    cached_prompt_tokens: int = 0
    cached_completion_tokens: int = 0
    #: Prompt tokens of the computed answers that the engines' own prefix caches served, as the
    #: backends report them (``GenerationResult.cached_tokens``; none from the result cache's).
    prefix_cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's batch usage; ``input_tokens_details.cached_tokens`` is every prompt token not
        computed again (the engines' prefix caches and the result cache's replays), the sum of the
        output lines' ``cached_tokens``; the extras say what each cache did."""
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.prefix_cached_tokens + self.cached_prompt_tokens},
            "output_tokens": self.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.total_tokens,
            "cached_requests": self.cached_requests,
            "saved_tokens": self.cached_prompt_tokens + self.cached_completion_tokens,
            "prefix_cached_tokens": self.prefix_cached_tokens,
        }


@attrs.frozen
class BatchParameters:
    """Batch-level sampling defaults (the guide's second priority level)."""

    max_decoding_length: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class BatchErrorInfo:
    """Why a whole batch failed (the guide's ``error`` field)."""

    code: str
    message: str


@attrs.frozen
class Batch:
    """One batch's persisted state. Live counters are merged in by the service."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    #: When its completion window ends: the exact moment it was created plus the window, rounded
    #: up to a whole second (``clock.deadline``), so it never ends before the whole window passed.
    expires_at: int
    model: str
    parameters: BatchParameters = BatchParameters()
    metadata: dict[str, str] | None = None
    output_expires_after_s: int | None = None  # OpenAI's output_expires_after, for its result files
    output_file_id: str | None = None
    error_file_id: str | None = None
    request_counts: RequestCounts = RequestCounts()
    usage: Usage = Usage()
    error: BatchErrorInfo | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    #: The recent pace of a running batch (never stored: it is measured live).
    progress: ProgressEstimate = UNKNOWN
    #: Whether that pace says the batch will not finish by ``expires_at`` (live, never stored;
    #: ``deadline_watch``), and when the batch was first found so (stored: its one event).
    at_risk: bool = False
    at_risk_at: int | None = None
    owner: str = DEFAULT_TENANT  # the tenant that made it (not part of the API object)
    #: The batch this one retries (``batches.retry``), and the retries made of this one, oldest
    #: first (never stored in the row: read from the retries' ``retry_of``).
    retry_of: str | None = None
    retries: tuple[str, ...] = ()
    #: "completion" (lines as requests finish) or "input" (rewritten in input order at the end).
    output_order: str = "completion"

    def to_dict(self) -> dict[str, Any]:
        errors = None
        if self.error is not None:
            errors = {
                "object": "list",
                "data": [
                    {"code": self.error.code, "message": self.error.message, "param": None, "line": None}
                ],
            }
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": errors,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status.value,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "in_progress_at": self.in_progress_at,
            "expires_at": self.expires_at,
            "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expired_at": self.expired_at,
            "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": self.request_counts.to_dict(),
            "metadata": self.metadata,
            "model": self.model,
            "usage": self.usage.to_dict(),
            "error": None if self.error is None else attrs.asdict(self.error),
            **self.parameters.to_dict(),
            "output_order": self.output_order,
            **self.progress.to_dict(),
            "retry_of": self.retry_of,
            "retries": list(self.retries),
            "at_risk": self.at_risk,
        }


@attrs.frozen
class SamplingParameters:
    """Resolved sampling parameters for one request (body > batch > server default)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@attrs.frozen
class GenerationRequest:
    """One request as a backend sees it: chat messages, a raw prompt or embedding inputs, and its
    parameters.

    ``endpoint`` is ``/v1/chat/completions`` (also for ``/v1/responses`` lines, which run on the
    chat path), ``/v1/completions`` or ``/v1/embeddings``. ``model`` is the served model name the
    line asked for (None: the backend's own model); a backend serving several models (the openai
    backend's upstreams) routes by it. ``inputs`` are an embeddings line's texts or token arrays.
    ``options`` are the line's fields a backend passes on as they are (``response_format``,
    ``logprobs``, ``top_logprobs``, ``n``; the embeddings ``dimensions``), only those its
    capabilities declare (``backends.capabilities``).
    """

    request_id: str
    endpoint: str
    sampling: SamplingParameters
    messages: tuple[dict[str, Any], ...] | None = None
    prompt: str | None = None
    model: str | None = None
    inputs: tuple[str | tuple[int, ...], ...] | None = None
    options: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class GenerationResult:
    """What every backend returns for a finished request, shaped alike across engines."""

    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    reasoning_content: str | None = None
    #: An embeddings request's vectors, one per input, in input order.
    embeddings: tuple[tuple[float, ...], ...] | None = None
    #: The OpenAI ``choices`` as an upstream answered them (``n`` > 1, ``logprobs``), written to the
    #: output line as they are; None: one choice made of ``text``.
    choices: tuple[dict[str, Any], ...] | None = None
    #: Of ``prompt_tokens``, those the engine's own prefix cache served (vLLM's and SGLang's
    #: ``cached_tokens``, an upstream's ``usage.prompt_tokens_details.cached_tokens``); None: the
    #: engine does not say. A backend passes on only an int within 0..``prompt_tokens``.
    cached_tokens: int | None = None

    @property
    def reported_cached_tokens(self) -> int:
        """``cached_tokens`` as an output line and the counters take it: 0 when the engine does not
        say (or says something outside 0..``prompt_tokens``)."""
        cached = self.cached_tokens
        if cached is None or not 0 <= cached <= self.prompt_tokens:
            return 0
        return cached


@attrs.frozen
class PoolStatus:
    intake_pool_size: int
    intake_pool_capacity: int
    scheduling_pool_active: int
    scheduling_pool_free: int
    scheduling_pool_capacity: int
    active_batches: int
    pool_mode: bool = True
    #: Running totals since the service started (``telemetry``): a dashboard's rates.
    requests_completed_total: int = 0
    requests_failed_total: int = 0
    prompt_tokens_total: int = 0
    completion_tokens_total: int = 0
    #: Of the admitted requests (``scheduling_pool_active``), those the engines say they are
    #: computing now, and the rest, waiting inside the backend for the engine; None when a
    #: backend cannot tell (``backends.engine_activity``).
    engine_running: int | None = None
    engine_waiting: int | None = None
    #: Each served model's engine on its own: ``{"model", "running", "generated_tokens"}``, a
    #: figure None where that model's backend cannot tell, so one model that cannot tell does not
    #: hide what the others report.
    engines: tuple[dict[str, Any], ...] = ()
    #: Tokens generated since the start: counted as the engine makes them where every backend
    #: reports that (``generated_tokens_counted`` "as_generated"), else as requests finish
    #: ("when_finished", the same as ``completion_tokens_total``).
    generated_tokens_total: int = 0
    generated_tokens_counted: str = "when_finished"
    #: Requests finished and tokens generated per second, exponentially weighted with a time
    #: constant of ``rate_time_constant_s`` seconds (``telemetry.Throughput``).
    requests_per_second: float = 0.0
    tokens_per_second: float = 0.0
    rate_time_constant_s: float = 30.0
    #: With several replicas: every live replica's report of its share of the work (its id,
    #: shards held, lines committed, leases lost, health, how many seconds ago it reported);
    #: None, and left out of ``to_dict``, for a single process.
    replicas: tuple[dict[str, Any], ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        figures = attrs.asdict(self)  # copies of the replicas' reports too
        if self.replicas is None:
            del figures["replicas"]
        return figures


@attrs.frozen
class Health:
    healthy: bool
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.healthy:
            return {"status": "healthy"}
        return {"status": "unhealthy", "reason": self.reason}


# --- the Uploads API's records (``files.chunked_uploads``, ``files.shared_uploads``) ---------
PENDING, COMPLETING, COMPLETED, CANCELLED, EXPIRED = (
    "pending",
    "completing",
    "completed",
    "cancelled",
    "expired",
)
#: The statuses whose parts count towards the tenant's stored bytes.
HOLDING_PARTS = (PENDING, COMPLETING)
ENDED = (COMPLETED, CANCELLED, EXPIRED)


def _strings(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


def _numbers(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


@attrs.frozen
class Upload:
    """An upload's record. ``order``, ``sizes``, ``file_id``, ``line_count`` and ``url`` are set
    once it is ``completing`` (validated, being assembled). ``expires_after_s``: the lifetime of
    the file it makes (OpenAI's ``expires_after``; None: the server's file lifetime)."""

    id: str
    bytes: int
    created_at: int
    expires_at: int
    filename: str
    purpose: str
    mime_type: str
    owner: str
    status: str = PENDING
    ended_at: int | None = None
    order: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    sizes: tuple[int, ...] = attrs.field(default=(), converter=_numbers)
    skip_bom: bool = False
    file_id: str | None = None
    line_count: int = 0
    url: str | None = None
    expires_after_s: int | None = None

    def to_dict(self, file: FileObject | None = None) -> dict[str, Any]:
        """The Upload object of OpenAI's API (``completing`` is still ``pending`` there)."""
        return {
            "id": self.id,
            "object": "upload",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": PENDING if self.status == COMPLETING else self.status,
            "file": None if file is None else file.to_dict(),
        }


@attrs.frozen
class UploadPart:
    id: str
    created_at: int
    upload_id: str
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "upload.part",
            "created_at": self.created_at,
            "upload_id": self.upload_id,
        }
