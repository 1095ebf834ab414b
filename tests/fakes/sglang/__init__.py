"""A FAKE ``sglang`` package for BatchGen's tests. It is not SGLang and runs no model.

SGLang needs CUDA and cannot be installed on the CPU-only machines the tests run on, so BatchGen's
``sglang`` backend is tested against this stand-in. It implements only the slice of SGLang's
offline-engine API that the backend uses, shaped as SGLang documents it (upstream ``python/sglang/srt/entrypoints/engine.py`` and
``python/sglang/srt/managers/tokenizer_manager.py``):

- ``Engine(**server_args)``: keyword arguments as ``ServerArgs`` takes them (``model_path``,
  ``tp_size``, ``dp_size``, ``context_length``, ``mem_fraction_static``, ...). The fake accepts any
  keyword and records them in ``engine.kwargs``.
- ``await engine.async_generate(prompt=... | input_ids=..., sampling_params={...}, rid=...)``
  returns ``{"text": ..., "meta_info": {"id", "prompt_tokens", "completion_tokens",
  "cached_tokens", "finish_reason"}}``; ``finish_reason`` is ``{"type": "stop", "matched": ...}``,
  ``{"type": "length", "length": ...}`` or ``{"type": "abort", "message", "status_code",
  "err_type"}``. Sampling parameters are checked the way SGLang's ``SamplingParams`` does: an
  unknown name is a ``TypeError``, an out-of-range value a ``ValueError`` (the penalties too:
  ``frequency_penalty`` and ``presence_penalty`` in [-2, 2], ``repetition_penalty`` in [0, 2]).
  The penalties change no words here; what arrived is in ``FakeCall.sampling_params``. A prompt
  that does not fit the context, or a prompt plus ``max_new_tokens`` that does not, is a
  ``ValueError`` with SGLang's own messages, as the tokenizer manager raises them.
- ``engine.tokenizer_manager.abort_request(rid)`` (synchronous, a no-op for an unknown rid): the
  request ends with ``{"type": "abort", ...}`` at its next token.
- ``engine.tokenizer_manager.tokenizer``: ``apply_chat_template(messages, tokenize=False,
  add_generation_prompt=True)`` (ChatML), ``encode(text, add_special_tokens=True)`` and
  ``decode(ids)``; ``engine.tokenizer_manager.context_len``.
- ``engine.shutdown()``.

``cached_tokens`` is what SGLang's radix (prefix) cache served of the prompt: the longest token
prefix the prompt shares with a prompt of an earlier finished request still in the cache, at most
the prompt's length less one (SGLang always computes the last prompt token, for its logits). The
cache keeps the prompts of the last ``PREFIX_CACHE_PROMPTS`` finished requests (least recently
used, a hit counting as a use, evicted first) and starts empty with each engine; with
``disable_radix_cache=True`` every request reports 0, as SGLang does.

The "model" is deterministic: the same prompt, seed and temperature give the same words. It
writes 4 to 40 words, one token each, stops at a ``stop`` string, or at ``max_new_tokens`` with
``finish_reason`` length. A prompt containing ``/think`` is answered with a ``<think>...</think>``
block first, as reasoning models do. A prompt containing ``[fake:busy]`` is refused the way
SGLang refuses a request when its queue is full (an exception carrying ``status_code`` 503, like
the ``fastapi.HTTPException`` SGLang raises).

Environment variables, read when an ``Engine`` is created:

- ``FAKE_SGLANG_DELAY_S``: seconds per generated token (default 0), so aborts can be exercised.
- ``FAKE_SGLANG_DIE_AFTER=N``: the engine serves N requests, then dies when request N+1 arrives:
  that call, every request still running and every later call raise ``FakeEngineDied`` (a
  ``RuntimeError``). This stands in for an engine failure surfacing in the calling process; a real
  SGLang whose scheduler process crashes usually also kills the calling process through its own
  SIGQUIT watchdog, which no in-process fake can show.
- ``FAKE_SGLANG_RECORD=path``: each ``async_generate`` call appends one JSON line ``{"rid",
  "sampling_params"}`` to the file, so a test can see what a server process sent its engine.
- ``FAKE_SGLANG_FAIL_START=message``: ``Engine()`` raises ``RuntimeError(message)``, like a failed
  SGLang launch ("Initialization failed. Please see the error messages above.").

For assertions, ``Engine.instances`` lists every engine created; each has ``kwargs``, ``calls``
(one ``FakeCall`` per ``async_generate``, with the prompt text, input ids, sampling params and
rid), ``aborted`` (the rids aborted through the tokenizer manager) and ``shutdown_called``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import re
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar

__version__ = "0.0.0+fake"

#: The sampling parameter names SGLang's ``SamplingParams`` accepts.
SAMPLING_PARAMETERS = frozenset(
    {
        "max_new_tokens",
        "min_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "n",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "json_schema",
        "regex",
        "ebnf",
        "sampling_seed",
    }
)

DEFAULT_CONTEXT_LENGTH = 4096
#: How many finished requests' prompts the fake radix cache keeps.
PREFIX_CACHE_PROMPTS = 64

_WORDS = [
    "a",
    "fake",
    "engine",
    "writes",
    "these",
    "words",
    "in",
    "a",
    "fixed",
    "order",
    "so",
    "that",
    "tests",
    "can",
    "predict",
    "every",
    "reply",
    "it",
    "gives",
    "without",
    "running",
    "any",
    "model",
    "at",
    "all",
    "here",
]
_REASONING = [
    "the",
    "user",
    "asks",
    "a",
    "question",
    "so",
    "I",
    "think",
    "about",
    "it",
    "step",
    "by",
    "step",
    "first",
]


class FakeEngineDied(RuntimeError):
    """What every call raises once the fake engine is dead."""


class FakeHTTPException(Exception):
    """Shaped like the ``fastapi.HTTPException`` SGLang raises for scheduler-side aborts."""

    def __init__(self, status_code: int, detail: str) -> None:
        super().__init__(detail)
        self.status_code = status_code
        self.detail = detail


class FakeTokenizer:
    """A reversible tokenizer: each run of whitespace and each run of non-space is one token."""

    bos_token_id = 1
    eos_token_id = 2

    def __init__(self) -> None:
        self._pieces: list[str] = ["<unk>", "<s>", "</s>"]
        self._ids: dict[str, int] = {}

    def _id(self, piece: str) -> int:
        if piece not in self._ids:
            self._ids[piece] = len(self._pieces)
            self._pieces.append(piece)
        return self._ids[piece]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self._id(piece) for piece in re.findall(r"\s+|\S+", text)]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        special = {self.bos_token_id, self.eos_token_id}
        return "".join(self._pieces[i] for i in ids if not (skip_special_tokens and i in special) and i > 0)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        parts = []
        for message in conversation:
            content = message.get("content")
            if not isinstance(content, str):
                raise TypeError(f"this chat template takes string content, got {type(content).__name__}")
            parts.append(f"<|im_start|>{message['role']}\n{content}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        text = "".join(parts)
        return self.encode(text, add_special_tokens=False) if tokenize else text


@dataclass
class FakeCall:
    """One ``async_generate`` call as the engine received it."""

    rid: str
    prompt: str | None
    input_ids: list[int] | None
    prompt_text: str
    sampling_params: dict[str, Any]
    aborted: bool = False
    result: dict[str, Any] | None = None


@dataclass
class _Running:
    call: FakeCall
    aborted: bool = False


class FakeTokenizerManager:
    def __init__(self, engine: Engine, context_len: int) -> None:
        self._engine = engine
        self.tokenizer = FakeTokenizer()
        self.context_len = context_len
        self.rid_to_state: dict[str, _Running] = {}

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        targets = list(self.rid_to_state) if abort_all else [rid]
        for target in targets:
            state = self.rid_to_state.get(target)
            if state is not None:
                state.aborted = True
                self._engine.aborted.append(target)


class FakePrefixCache:
    """The token ids of finished requests' prompts, least recently used first, ``capacity`` at most."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._prompts: OrderedDict[tuple[int, ...], None] = OrderedDict()

    def match(self, ids: list[int]) -> int:
        """The prompt tokens served from the cache: the longest prefix ``ids`` shares with a
        cached prompt (marked used), at most ``len(ids) - 1``."""
        best, best_length = None, 0
        for cached in self._prompts:
            length = 0
            for mine, theirs in zip(ids, cached, strict=False):
                if mine != theirs:
                    break
                length += 1
            if length > best_length:
                best, best_length = cached, length
        if best is not None:
            self._prompts.move_to_end(best)
        return min(best_length, max(0, len(ids) - 1))

    def insert(self, ids: list[int]) -> None:
        key = tuple(ids)
        self._prompts[key] = None
        self._prompts.move_to_end(key)
        while len(self._prompts) > self.capacity:
            self._prompts.popitem(last=False)


@dataclass
class _Knobs:
    delay_s: float = 0.0
    die_after: int | None = None
    record: str | None = None

    @classmethod
    def from_environment(cls) -> _Knobs:
        die_after = os.environ.get("FAKE_SGLANG_DIE_AFTER")
        return cls(
            delay_s=float(os.environ.get("FAKE_SGLANG_DELAY_S", "0")),
            die_after=int(die_after) if die_after else None,
            record=os.environ.get("FAKE_SGLANG_RECORD") or None,
        )


class Engine:
    """The fake offline engine; see the module docstring for what it does and does not do."""

    instances: ClassVar[list[Engine]] = []

    def __init__(self, **kwargs: Any) -> None:
        failure = os.environ.get("FAKE_SGLANG_FAIL_START")
        if failure:
            raise RuntimeError(failure)
        if "model_path" not in kwargs:
            raise TypeError("ServerArgs.__init__() missing 1 required positional argument: 'model_path'")
        self.kwargs = dict(kwargs)
        self.calls: list[FakeCall] = []
        self.aborted: list[str] = []
        self.shutdown_called = False
        self._knobs = _Knobs.from_environment()
        self._dead: str | None = None
        context = kwargs.get("context_length") or DEFAULT_CONTEXT_LENGTH
        self.tokenizer_manager = FakeTokenizerManager(self, int(context))
        self.prefix_cache = (
            None if kwargs.get("disable_radix_cache") else FakePrefixCache(PREFIX_CACHE_PROMPTS)
        )
        Engine.instances.append(self)

    # --- the documented API -----------------------------------------------------------------
    async def async_generate(
        self,
        prompt: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        input_ids: list[int] | None = None,
        rid: str | None = None,
        stream: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        await asyncio.sleep(0)
        self._check_alive()
        if (prompt is None) == (input_ids is None):
            raise ValueError("Either text, input_ids or input_embeds should be provided.")
        if stream:
            raise NotImplementedError("the fake engine does not stream")
        tokenizer = self.tokenizer_manager.tokenizer
        ids = list(input_ids) if input_ids is not None else tokenizer.encode(prompt or "")
        params = dict(sampling_params or {})
        rid = rid or uuid.uuid4().hex
        call = FakeCall(rid, prompt, input_ids, prompt or tokenizer.decode(ids), params)
        self.calls.append(call)
        if self._knobs.record:
            with open(self._knobs.record, "a", encoding="utf-8") as record:
                record.write(json.dumps({"rid": rid, "sampling_params": params}) + "\n")
        if self._knobs.die_after is not None and len(self.calls) > self._knobs.die_after:
            self._dead = f"the fake engine died after {self._knobs.die_after} requests"
            self._check_alive()
        max_new_tokens = _validate_sampling(params)
        self._validate_length(len(ids), max_new_tokens)
        if "[fake:busy]" in call.prompt_text:
            raise FakeHTTPException(503, "The request queue is full.")
        if rid in self.tokenizer_manager.rid_to_state:
            raise ValueError(f"Duplicate request ID: {rid}")
        state = _Running(call)
        self.tokenizer_manager.rid_to_state[rid] = state
        cached_tokens = 0 if self.prefix_cache is None else self.prefix_cache.match(ids)
        try:
            call.result = await self._generate(state, ids, params, max_new_tokens)
        finally:
            del self.tokenizer_manager.rid_to_state[rid]
        call.result["meta_info"]["cached_tokens"] = cached_tokens
        if self.prefix_cache is not None:
            self.prefix_cache.insert(ids)
        return call.result

    def shutdown(self) -> None:
        self.shutdown_called = True
        self._dead = self._dead or "the fake engine was shut down"

    # --- internals ----------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise FakeEngineDied(self._dead)

    def _validate_length(self, prompt_tokens: int, max_new_tokens: int | None) -> None:
        # The same two checks (and messages) as SGLang's TokenizerManager._validate_one_request.
        context = self.tokenizer_manager.context_len
        if prompt_tokens >= context:
            raise ValueError(
                f"The input ({prompt_tokens} tokens) is longer than the model's context length "
                f"({context} tokens)."
            )
        if max_new_tokens is not None and prompt_tokens + max_new_tokens >= context:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {context} "
                f"tokens. You requested a total of {prompt_tokens + max_new_tokens} tokens: "
                f"{prompt_tokens} tokens from the input messages and {max_new_tokens} tokens for the "
                "completion. Please reduce the number of tokens in the input messages or the "
                "completion to fit within the limit."
            )

    async def _generate(
        self, state: _Running, ids: list[int], params: dict[str, Any], max_new_tokens: int | None
    ) -> dict[str, Any]:
        key = f"{ids}|{params.get('sampling_seed')}|{params.get('temperature', 1.0)}"
        rng = random.Random(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big"))
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 40))]
        if "/think" in state.call.prompt_text:
            words = ["<think>", *_REASONING, "</think>", *words]
        limit = 128 if max_new_tokens is None else max_new_tokens
        stops = params.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        emitted: list[str] = []
        finish: dict[str, Any] = {"type": "stop", "matched": FakeTokenizer.eos_token_id}
        for word in words:
            if self._knobs.delay_s:
                await asyncio.sleep(self._knobs.delay_s)
            self._check_alive()
            if state.aborted:
                state.call.aborted = True
                finish = {"type": "abort", "message": "Abort in running batch", "status_code": None}
                break
            if len(emitted) == limit:
                finish = {"type": "length", "length": limit}
                break
            emitted.append(word)
            text = " ".join(emitted)
            matched = next((stop for stop in stops if stop in text), None)
            if matched is not None:  # SGLang trims the stop string and counts the tokens made
                finish = {"type": "stop", "matched": matched}
                return self._output(state, ids, text[: text.index(matched)], len(emitted), finish)
        return self._output(state, ids, " ".join(emitted), len(emitted), finish)

    @staticmethod
    def _output(
        state: _Running, ids: list[int], text: str, completion_tokens: int, finish: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "text": text,
            "meta_info": {
                "id": state.call.rid,
                "prompt_tokens": len(ids),
                "completion_tokens": completion_tokens,
                "cached_tokens": 0,
                "finish_reason": finish,
            },
        }


def _validate_sampling(params: dict[str, Any]) -> int | None:
    """Check the parameters as SGLang's SamplingParams(**params).verify() would."""
    unknown = set(params) - SAMPLING_PARAMETERS
    if unknown:
        raise TypeError(
            f"SamplingParams.__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}"
        )
    temperature = params.get("temperature", 1.0)
    if temperature < 0:
        raise ValueError(f"temperature must be non-negative, got {temperature}.")
    top_p = params.get("top_p", 1.0)
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    top_k = params.get("top_k", -1)
    if top_k < 1 and top_k != -1:
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    for penalty in ("frequency_penalty", "presence_penalty"):
        value = params.get(penalty, 0.0)
        if not -2.0 <= value <= 2.0:
            raise ValueError(f"{penalty} must be in [-2, 2], got {value}.")
    repetition_penalty = params.get("repetition_penalty", 1.0)
    if not 0.0 <= repetition_penalty <= 2.0:
        raise ValueError(f"repetition_penalty must be in [0, 2], got {repetition_penalty}.")
    max_new_tokens = params.get("max_new_tokens")
    if max_new_tokens is not None and max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
    return max_new_tokens
