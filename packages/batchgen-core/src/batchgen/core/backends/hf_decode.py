"""The transformers decode loop: continuous batching over one KV cache, one token per step.

``DecodeEngine`` owns a loaded model and tokenizer and the rows being generated. Each ``step``:

1. admits waiting requests into free places of the running batch (up to ``max_batch_size``):
   their prompts are prefilled together, left-padded, and their key/value cache is merged into
   the running batch's cache (both left-padded to the same length, with an attention mask);
2. decodes one token for every running row, each row with its own sampling settings (greedy,
   or temperature / top-k / top-p with its own random generator when it has a ``seed``), its
   ``logit_bias`` first added to its logits and its OpenAI penalties subtracted (``frequency_penalty``
   times each token's count in the row's output so far, ``presence_penalty`` once a token has
   appeared in it), which are then masked by its structured-output grammar when it has one
   (``hf_grammar``), and
   its token's log-probabilities recorded when the line asked for them;
3. ends the rows that are done (end of sequence, their own output limit, a stop string, an abort)
   and drops them from the batch at once, so their places are free for the next step.

A finished row's place is refilled at the next step rather than when the whole batch is done, and
no row pays for another's length: this is why the service beats a plain padded ``generate``.

A structured-output request's rows first wait apart, in ``_compiling``, until their grammar is
compiled (off this loop, by ``hf_grammar``); they join the waiting rows then, or end with the
line's error. An abort reaches them there like anywhere else. Work done per line on this loop is
bounded: a prompt that cannot fit is refused before it is rendered or tokenized, and stop strings
are looked for in the tail of the answer that can hold them.

A request with ``n`` choices is ``n`` rows (choice ``i`` seeded with ``seed + i``); its outcome
comes when the last of them ends, shaped by ``hf_choices``.

Nothing here knows about processes or the event loop: ``hf_worker`` runs an engine in its own
process and feeds it. Usage is exact: prompt tokens are the request's own (no padding),
completion tokens are the tokens generated, including the end-of-sequence token when the model
emitted one.
"""

from __future__ import annotations

import inspect
import logging
from collections import deque
from pathlib import Path
from typing import Any

import attrs

from batchgen.core.backends.base import RequestRejected, context_length_exceeded
from batchgen.core.backends.hf_choices import (
    MAX_CHOICES,
    Choice,
    TokenLogprob,
    combined_result,
    logprobs_asked,
)
from batchgen.core.backends.hf_grammar_bounds import GrammarBounds
from batchgen.core.backends.text import prompt_opens_reasoning, split_reasoning, text_messages, trim_at_stop
from batchgen.core.models import COMPLETIONS, GenerationRequest, GenerationResult

logger = logging.getLogger("batchgen.backends.transformers")

#: How a request ended without a result: "rejected" (never retry; with a code), "aborted",
#: or "transient" (this attempt failed).
REJECTED, ABORTED, TRANSIENT = "rejected", "aborted", "transient"
#: Most padded prompt tokens prefilled in one step (one long prompt alone may exceed it).
PREFILL_TOKENS = 16384
#: How long an idle step waits for a grammar being compiled before it returns (the worker then
#: reads its messages: an abort reaches a row waiting for its grammar within this time).
GRAMMAR_POLL_S = 0.01


@attrs.frozen
class Failure:
    kind: str
    message: str
    code: str = ""


@attrs.frozen
class Outcome:
    """A request's end: its result, or why it has none."""

    request_id: str
    result: GenerationResult | None = None
    failure: Failure | None = None


@attrs.frozen
class EngineInfo:
    model_name: str
    context_length: int
    device: str
    dtype: str


@attrs.define(eq=False)
class _Row:
    """One choice of a request: waiting for a place, or in the running batch."""

    request: GenerationRequest
    prompt: list[int]
    limit: int
    opens_reasoning: bool
    generator: Any = None  # a torch.Generator for a seeded sampling row
    choice: int = 0
    top_logprobs: int | None = None  # None: no logprobs asked for
    matcher: Any = None  # the structured-output grammar's matcher (``hf_grammar``), if any
    grammar: Any = None  # a Future of the compiled grammar, while the row waits for it
    bias: tuple[list[int], list[float]] | None = None  # ``logit_bias``: token ids and their biases
    penalties: tuple[float, float] | None = None  # ``frequency_penalty``, ``presence_penalty``
    generated: list[int] = attrs.Factory(list)
    logprobs: list[TokenLogprob] = attrs.Factory(list)

    @property
    def request_id(self) -> str:
        return self.request.request_id


@attrs.define(eq=False)
class _Group:
    """A request's rows (one per choice, ``n``) until the last of them ends."""

    request: GenerationRequest
    remaining: int
    choices: dict[int, Choice] = attrs.Factory(dict)
    failure: Failure | None = None


class DecodeEngine:
    """A model, its tokenizer, and the batch being generated (see the module docstring)."""

    def __init__(
        self,
        *,
        model: str | None,
        cache_dir: Path,
        device: str | None,
        dtype: str,
        max_batch_size: int,
        context_length: int | None,
        grammar_bounds: GrammarBounds | None = None,
    ) -> None:
        self._model_arg = model
        self._cache_dir = cache_dir
        self._device_arg = device
        self._dtype_arg = dtype
        self.max_batch_size = max_batch_size
        self._context_arg = context_length
        self._waiting: deque[_Row] = deque()
        self._compiling: list[_Row] = []  # rows waiting for their grammar (compiled off this loop)
        self._grammar_bounds = grammar_bounds or GrammarBounds()
        self._running: list[_Row] = []
        self._aborted: set[str] = set()
        self._finished: list[Outcome] = []
        self._groups: dict[str, _Group] = {}
        self._grammars: Any = None  # hf_grammar.Grammars, made at the first structured-output line
        # The running batch: its cache, attention mask, next input token and position per row.
        self._cache: Any = None
        self._mask: Any = None
        self._next_ids: Any = None
        self._positions: Any = None
        self._can_merge = True
        #: Tokens generated since the engine was made, every row's, counted as each step makes them.
        self.tokens_generated = 0

    # --- loading --------------------------------------------------------------------------
    def load(self) -> EngineInfo:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from batchgen.core.backends.hf_dtype import resolve_dtype
        from batchgen.core.backends.hf_model_files import resolve_model_folder

        folder, model_name = resolve_model_folder(self._model_arg, self._cache_dir)
        device = self._device_arg or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = resolve_dtype(self._dtype_arg, device)
        self._tokenizer = AutoTokenizer.from_pretrained(folder)
        model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
        self._model = model.to(device).eval()
        self._device = device
        # transformers 5.24 renamed the forward's ``past_key_values`` to ``cache``; take either.
        parameters = inspect.signature(self._model.forward).parameters
        self._cache_keyword = "cache" if "cache" in parameters else "past_key_values"
        model_context = int(getattr(self._model.config, "max_position_embeddings", 0) or 0)
        limits = [limit for limit in (self._context_arg, model_context) if limit]
        self.context_length = min(limits) if limits else 2048
        self._vocab_size = int(self._model.get_output_embeddings().weight.shape[0])
        eos = self._model.generation_config.eos_token_id
        self._eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self._pad_id = self._tokenizer.pad_token_id
        bos = self._tokenizer.bos_token_id
        self._start_id = bos if bos is not None else next(iter(sorted(self._eos_ids)), 0)
        # The longest token's text: a prompt of more characters than context x this can never fit.
        vocabulary = self._tokenizer.get_vocab()
        self._max_token_chars = max((len(token) for token in vocabulary), default=1) or 1
        if self._pad_id is None:
            self._pad_id = next(iter(self._eos_ids), 0)
        logger.info(
            "serving %s on %s in %s (context %d, batches of up to %d)",
            model_name,
            device,
            dtype,
            self.context_length,
            self.max_batch_size,
        )
        return EngineInfo(model_name, self.context_length, device, dtype)

    # --- requests -------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether a step would do anything (a row waiting for its grammar counts)."""
        return bool(self._waiting or self._running or self._finished or self._compiling)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def running_requests(self) -> int:
        """Requests with a row in the running batch (a request with ``n`` choices has ``n`` rows)."""
        return len({row.request_id for row in self._running})

    def add(self, request: GenerationRequest) -> None:
        """Queue a request; one that can never run ends at the next ``step`` with its reason."""
        try:
            ids, opens_reasoning = self._prompt_ids(request)
        except RequestRejected as exc:
            self._finished.append(
                Outcome(request.request_id, failure=Failure(REJECTED, exc.message, exc.code))
            )
            return
        except Exception as exc:  # the chat template refused the messages: it would every time
            message = f"the model's chat template could not render the request: {type(exc).__name__}: {exc}"
            self._finished.append(
                Outcome(request.request_id, failure=Failure(REJECTED, message, "invalid_request"))
            )
            return
        if len(ids) >= self.context_length:
            rejection = context_length_exceeded(len(ids), self.context_length)
            failure = Failure(REJECTED, rejection.message, rejection.code)
            self._finished.append(Outcome(request.request_id, failure=failure))
            return
        limit = min(request.sampling.max_tokens, self.context_length - len(ids))
        choices = int(request.options.get("n") or 1)
        if not 1 <= choices <= MAX_CHOICES:
            message = f"'body.n' must be from 1 to {MAX_CHOICES} for the transformers backend, got {choices}"
            self._finished.append(
                Outcome(request.request_id, failure=Failure(REJECTED, message, "invalid_request"))
            )
            return
        try:
            grammar = self._grammar(request)
        except RequestRejected as exc:
            self._finished.append(
                Outcome(request.request_id, failure=Failure(REJECTED, exc.message, exc.code))
            )
            return
        except Exception as exc:  # e.g. xgrammar missing: this line fails, the worker goes on
            message = f"structured output is not available here: {type(exc).__name__}: {exc}"
            self._finished.append(
                Outcome(request.request_id, failure=Failure(REJECTED, message, "invalid_request"))
            )
            return
        try:
            bias = _logit_bias(request.options.get("logit_bias"), self._vocab_size)
        except RequestRejected as exc:
            self._finished.append(
                Outcome(request.request_id, failure=Failure(REJECTED, exc.message, exc.code))
            )
            return
        top_logprobs = logprobs_asked(request.endpoint, request.options)
        penalties = _penalties(request.options)
        self._groups[request.request_id] = _Group(request, choices)
        for choice in range(choices):
            generator = None
            if not request.sampling.greedy and request.sampling.seed is not None:
                import torch

                # Each choice its own stream: the same seed gives the same n answers, not n copies.
                generator = torch.Generator(device=self._device).manual_seed(request.sampling.seed + choice)
            row = _Row(
                request,
                ids,
                limit,
                opens_reasoning,
                generator,
                choice,
                top_logprobs,
                grammar=grammar,
                bias=bias,
                penalties=penalties,
            )
            (self._waiting if grammar is None else self._compiling).append(row)

    def _grammar(self, request: GenerationRequest) -> Any:
        """A structured-output request's compiled grammar, as a future (None: unconstrained);
        ``RequestRejected`` at once for a schema past a bound. Nothing compiles here."""
        response_format = request.options.get("response_format")
        if response_format is None:
            return None
        if self._grammars is None:
            from batchgen.core.backends.hf_grammar import Grammars

            self._grammars = Grammars(
                self._tokenizer, self._vocab_size, sorted(self._eos_ids), self._grammar_bounds
            )
        return self._grammars.request(response_format)

    @property
    def grammars(self) -> Any:
        """The structured-output compiler (``hf_grammar.Grammars``), once a line needed it."""
        return self._grammars

    def close(self) -> None:
        """Stop the grammar compiler (its thread and probe process), if one was started."""
        if self._grammars is not None:
            self._grammars.close()

    def abort(self, request_id: str) -> None:
        """End the request at the next step (harmless for an unknown or finished one)."""
        if request_id in self._groups:
            self._aborted.add(request_id)

    def fail_all(self, message: str) -> list[Outcome]:
        """End every request with a transient failure (the engine broke); the batch is dropped."""
        outcomes = self._finished + [
            Outcome(request_id, failure=Failure(TRANSIENT, message)) for request_id in self._groups
        ]
        self._finished, self._running, self._aborted = [], [], set()
        self._compiling = []
        self._groups = {}
        self._waiting.clear()
        self._cache = self._mask = self._next_ids = self._positions = None
        return outcomes

    def _prompt_ids(self, request: GenerationRequest) -> tuple[list[int], bool]:
        """The prompt's token ids, and whether the chat template opened a ``<think>`` block.

        A prompt that cannot fit the context is refused before it is rendered or tokenized (this
        runs on the decode loop): more characters than the context holds tokens times the longest
        token's characters, or more messages than the context holds tokens."""
        if request.endpoint == COMPLETIONS or request.messages is None:
            self._refuse_oversized(len(request.prompt or ""), 0)
            ids = list(self._tokenizer(request.prompt or "")["input_ids"])
            # an empty prompt (legal, as on OpenAI) generates from the start-of-text token
            return ids or [self._start_id], False
        messages = text_messages(request.messages, backend="transformers")
        self._refuse_oversized(
            sum(len(str(message.get("content") or "")) for message in messages), len(messages)
        )
        text = self._tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=True,
        )
        ids = list(self._tokenizer(text, add_special_tokens=False)["input_ids"])
        return ids, prompt_opens_reasoning(text)

    def _refuse_oversized(self, characters: int, messages: int) -> None:
        limit = self.context_length * self._max_token_chars
        if characters > limit or messages > self.context_length:
            raise RequestRejected(
                "context_length_exceeded",
                f"Prompt of {characters} characters in {messages} messages exceeds model context "
                f"{self.context_length} (at most {self._max_token_chars} characters a token)",
            )

    # --- one step -------------------------------------------------------------------------
    def step(self) -> list[Outcome]:
        """Admit, decode one token, end finished rows; the requests that ended."""
        import torch

        with torch.inference_mode():
            self._drop_aborted_waiting()
            self._take_grammars()
            if self._compiling and not (self._waiting or self._running or self._finished):
                self._grammars.wait(GRAMMAR_POLL_S)  # nothing else to do: do not spin
                self._take_grammars()
            admitted = self._admit()
            if self._running and not admitted:
                self._decode()
            self._end_finished_rows()
        finished, self._finished = self._finished, []
        return finished

    def _take_grammars(self) -> None:
        """Rows whose grammar is ready join the waiting rows; a failed compile ends its rows."""
        if not self._compiling:
            return
        still: list[_Row] = []
        for row in self._compiling:
            if not row.grammar.done():
                still.append(row)
                continue
            try:
                compiled = row.grammar.result()
            except RequestRejected as exc:
                self._row_ended(row, failure=Failure(REJECTED, exc.message, exc.code))
                continue
            row.grammar, row.matcher = None, self._grammars.matcher(compiled)
            self._waiting.append(row)
        self._compiling = still

    def _drop_aborted_waiting(self) -> None:
        if not self._aborted:
            return
        compiling = [row for row in self._compiling if row.request_id not in self._aborted]
        for row in self._compiling:
            if row.request_id in self._aborted:
                self._row_ended(row, failure=Failure(ABORTED, "aborted"))
        self._compiling = compiling
        keep: deque[_Row] = deque()
        for row in self._waiting:
            if row.request_id in self._aborted:
                self._row_ended(row, failure=Failure(ABORTED, "aborted"))
            else:
                keep.append(row)
        self._waiting = keep

    def _row_ended(self, row: _Row, *, choice: Choice | None = None, failure: Failure | None = None) -> None:
        """Record one row's end; the request's outcome comes when its last row has ended."""
        group = self._groups[row.request_id]
        if choice is not None:
            group.choices[row.choice] = choice
        elif group.failure is None:
            group.failure = failure
        group.remaining -= 1
        if group.remaining > 0:
            return
        del self._groups[row.request_id]
        self._aborted.discard(row.request_id)
        if group.failure is not None:
            self._finished.append(Outcome(row.request_id, failure=group.failure))
            return
        request = group.request
        choices = [group.choices[index] for index in sorted(group.choices)]
        keep_choices = len(choices) > 1 or choices[0].logprobs is not None
        result = combined_result(
            request.endpoint, request.prompt or "", len(row.prompt), choices, self._token_text, keep_choices
        )
        self._finished.append(Outcome(row.request_id, result=result))

    def _token_text(self, token: int) -> str:
        return str(self._tokenizer.decode([token]))

    def _admit(self) -> bool:
        """Prefill waiting rows into free places; whether any were admitted this step."""
        free = self.max_batch_size - len(self._running)
        if not self._waiting or free <= 0 or (self._running and not self._can_merge):
            return False
        rows = [self._waiting.popleft()]
        width = len(rows[0].prompt)
        while self._waiting and len(rows) < free:
            # Bound one prefill's padded size, so that many long prompts join over several steps.
            width = max(width, len(self._waiting[0].prompt))
            if width * (len(rows) + 1) > PREFILL_TOKENS:
                break
            rows.append(self._waiting.popleft())
        cache, mask, next_ids, positions = self._prefill(rows)
        if self._running:
            self._merge(cache, mask, next_ids, positions)
        else:
            self._cache, self._mask, self._next_ids, self._positions = cache, mask, next_ids, positions
        self._running.extend(rows)
        return True

    def _prefill(self, rows: list[_Row]) -> tuple[Any, Any, Any, Any]:
        import torch

        width = max(len(row.prompt) for row in rows)
        input_ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for index, row in enumerate(rows):
            input_ids[index, width - len(row.prompt) :] = torch.tensor(row.prompt)
            mask[index, width - len(row.prompt) :] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        output = self._model(
            input_ids=input_ids.to(self._device),
            attention_mask=mask.to(self._device),
            position_ids=position_ids.to(self._device),
            use_cache=True,
            logits_to_keep=1,
        )
        cache = _cache_of(output)
        self._can_merge = self._can_merge and all(
            type(layer).__name__ == "DynamicLayer" for layer in cache.layers
        )
        next_ids = self._choose(rows, output.logits[:, -1, :])
        positions = torch.tensor([len(row.prompt) for row in rows], dtype=torch.long)
        return cache, mask.to(self._device), next_ids, positions

    def _merge(self, cache: Any, mask: Any, next_ids: Any, positions: Any) -> None:
        """Append prefilled rows to the running batch, left-padding the shorter of the two caches."""
        import torch

        width = max(self._mask.shape[1], mask.shape[1])

        def pad(tensor: Any, dim: int) -> Any:
            missing = width - tensor.shape[dim]
            if missing == 0:
                return tensor
            shape = list(tensor.shape)
            shape[dim] = missing
            return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)

        for running, new in zip(self._cache.layers, cache.layers, strict=True):
            running.keys = torch.cat([pad(running.keys, 2), pad(new.keys, 2)], dim=0)
            running.values = torch.cat([pad(running.values, 2), pad(new.values, 2)], dim=0)
        self._mask = torch.cat([pad(self._mask, 1), pad(mask, 1)], dim=0)
        self._next_ids = torch.cat([self._next_ids, next_ids])
        self._positions = torch.cat([self._positions, positions])

    def _decode(self) -> None:
        import torch

        batch = len(self._running)
        self._mask = torch.cat([self._mask, self._mask.new_ones((batch, 1))], dim=1)
        output = self._model(
            input_ids=self._next_ids[:, None],
            attention_mask=self._mask,
            position_ids=self._positions[:, None].to(self._device),
            use_cache=True,
            **{self._cache_keyword: self._cache},
        )
        self._cache = _cache_of(output)
        self._positions += 1
        self._next_ids = self._choose(self._running, output.logits[:, -1, :])

    def _choose(self, rows: list[_Row], logits: Any) -> Any:
        """The next token of every row (recorded in its ``generated``), as a tensor on the device."""
        import torch

        raw = logits
        constrained = [index for index, row in enumerate(rows) if row.matcher is not None]
        biased = [index for index, row in enumerate(rows) if row.bias is not None]
        penalized = [index for index, row in enumerate(rows) if row.penalties is not None and row.generated]
        if constrained or biased or penalized:
            logits = logits.to(torch.float32, copy=True)
            for index in biased:  # added to the logits, as OpenAI does, before the grammar's mask
                ids, values = rows[index].bias  # type: ignore[misc]
                logits[index, ids] += torch.tensor(values, dtype=logits.dtype, device=logits.device)
            for index in penalized:  # OpenAI's: on the counts of the tokens this row has generated
                frequency, presence = rows[index].penalties  # type: ignore[misc]
                generated = torch.tensor(rows[index].generated, device=logits.device)
                counts = torch.bincount(generated, minlength=logits.shape[-1]).to(logits.dtype)
                logits[index] -= frequency * counts + presence * (counts > 0).to(logits.dtype)
            for index in constrained:
                rows[index].matcher.mask(logits[index])
        chosen = logits.argmax(dim=-1)
        sampled = [index for index, row in enumerate(rows) if not row.request.sampling.greedy]
        if sampled:
            scores = logits.float()
            for index in sampled:
                chosen[index] = _sample(scores[index], rows[index])
        tokens = chosen.tolist()
        self.tokens_generated += len(tokens)
        for row, token in zip(rows, tokens, strict=True):
            row.generated.append(token)
            if row.matcher is not None:
                row.matcher.accept(token)
        wanted = [index for index, row in enumerate(rows) if row.top_logprobs is not None]
        if wanted:
            self._record_logprobs([rows[index] for index in wanted], raw[wanted])
        return chosen.to(torch.long)

    @staticmethod
    def _record_logprobs(rows: list[_Row], logits: Any) -> None:
        """Each row's chosen token's log-probability and its step's most likely tokens (raw logits)."""
        logprobs = logits.float().log_softmax(dim=-1)
        most = max(row.top_logprobs or 0 for row in rows)
        top_values, top_ids = logprobs.topk(max(most, 1), dim=-1)
        for index, row in enumerate(rows):
            token = row.generated[-1]
            top: tuple[tuple[int, float], ...] = ()
            if row.top_logprobs:
                ids = top_ids[index, : row.top_logprobs].tolist()
                values = top_values[index, : row.top_logprobs].tolist()
                top = tuple(zip(ids, values, strict=True))
            row.logprobs.append(TokenLogprob(token, float(logprobs[index, token]), top))

    def _end_finished_rows(self) -> None:
        if not self._running:
            return
        keep: list[int] = []
        for index, row in enumerate(self._running):
            if row.request_id in self._aborted:
                self._row_ended(row, failure=Failure(ABORTED, "aborted"))
            elif self._row_done(row):
                self._row_ended(row, choice=self._choice(row))
            else:
                keep.append(index)
        if len(keep) == len(self._running):
            return
        self._running = [self._running[index] for index in keep]
        if not self._running:
            self._cache = self._mask = self._next_ids = self._positions = None
            return
        self._select(keep)

    def _select(self, keep: list[int]) -> None:
        """Keep only the rows at ``keep``, and cut mask columns no remaining row attends to."""
        import torch

        indices = torch.tensor(keep, dtype=torch.long, device=self._mask.device)
        mask = self._mask.index_select(0, indices)
        first = int(mask.any(dim=0).nonzero()[0])
        self._mask = mask[:, first:]
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, indices)[:, :, first:]
            layer.values = layer.values.index_select(0, indices)[:, :, first:]
        self._next_ids = self._next_ids.index_select(0, indices)
        self._positions = self._positions.index_select(0, indices.to(self._positions.device))

    def _row_done(self, row: _Row) -> bool:
        if row.generated[-1] in self._eos_ids or len(row.generated) >= row.limit:
            return True
        if row.matcher is not None and row.matcher.finished:
            return True
        stops = row.request.sampling.stop
        if stops:
            # Only the newest token can complete a stop string (an earlier one would have ended the
            # row): decode the tail that can hold the longest stop, not the whole answer each step.
            # A character is at most 4 bytes and a token at least one byte.
            tail = row.generated[-(4 * max(len(stop) for stop in stops) + 4) :]
            _, hit = trim_at_stop(self._tokenizer.decode(tail, skip_special_tokens=True), stops)
            return hit
        return False

    # --- results --------------------------------------------------------------------------
    def _choice(self, row: _Row) -> Choice:
        generated = row.generated
        ended = bool(generated) and generated[-1] in self._eos_ids
        finish_reason = "stop" if ended or (row.matcher is not None and row.matcher.finished) else "length"
        text = self._tokenizer.decode(generated, skip_special_tokens=True)
        if row.request.sampling.stop:
            generated, text, hit = self._apply_stop(generated, row.request.sampling.stop)
            if hit:
                finish_reason = "stop"
        answer, reasoning = split_reasoning(text, opened_by_prompt=row.opens_reasoning)
        logprobs = None
        if row.top_logprobs is not None:
            listed = len(generated) - (1 if generated and generated[-1] in self._eos_ids else 0)
            logprobs = tuple(row.logprobs[:listed])
        return Choice(answer, finish_reason, len(generated), reasoning, logprobs)

    def _apply_stop(self, generated: list[int], stops: tuple[str, ...]) -> tuple[list[int], str, bool]:
        """Cut at the first stop string; count the tokens up to the one that completed it.

        Whether a prefix holds a stop only grows with its length, so the shortest such prefix is
        found by bisection (a few decodes, not one per token)."""
        full, hit = trim_at_stop(self._tokenizer.decode(generated, skip_special_tokens=True), stops)
        if not hit:
            return generated, full, False
        low, high = 1, len(generated)  # the shortest prefix with a stop is in [low, high]
        while low < high:
            middle = (low + high) // 2
            if trim_at_stop(self._tokenizer.decode(generated[:middle], skip_special_tokens=True), stops)[1]:
                high = middle
            else:
                low = middle + 1
        text, _ = trim_at_stop(self._tokenizer.decode(generated[:high], skip_special_tokens=True), stops)
        return generated[:high], text, True


def _penalties(options: dict[str, Any]) -> tuple[float, float] | None:
    """A line's ``frequency_penalty`` and ``presence_penalty`` (the schema bounded them to -2..2),
    or None when neither asks for anything."""
    frequency = float(options.get("frequency_penalty") or 0)
    presence = float(options.get("presence_penalty") or 0)
    return (frequency, presence) if frequency or presence else None


def _logit_bias(bias: Any, vocab_size: int) -> tuple[list[int], list[float]] | None:
    """A line's ``logit_bias`` (token id strings to biases; the schema bounded its size and
    values) as token ids and biases; RequestRejected naming an id the model does not have."""
    if not bias:
        return None
    by_id: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key)
        if not 0 <= token < vocab_size:
            raise RequestRejected(
                "invalid_request",
                f"'body.logit_bias' names token {key}, which the model's vocabulary (ids 0 to "
                f"{vocab_size - 1}) does not have",
            )
        by_id[token] = float(value)
    return list(by_id), list(by_id.values())


def _cache_of(output: Any) -> Any:
    """The key/value cache a forward pass returned (``cache``, or ``past_key_values`` before 5.24)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _sample(scores: Any, row: _Row) -> Any:
    """One token drawn from a row's scores as ``generate`` would: temperature, top-k, then top-p."""
    import torch

    sampling = row.request.sampling
    scores = scores / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(scores, min(sampling.top_k, scores.shape[-1])).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - sampling.top_p)
        drop[-1] = False  # always keep the most likely token
        scores = scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probabilities = scores.softmax(dim=-1)
    return torch.multinomial(probabilities, 1, generator=row.generator)[0]
