"""The options of a ``generate``/``stream`` call as two frozen values, checked on construction.

``GenerationOptions`` says how to decode: the budget, the sampler, stop tokens, cache size,
seed, log-probabilities, speculative decoding. ``ChatOptions`` says how conversations become
prompts in chat mode (``encode_chat``'s ``tools``, ``thinking``, ``drop_thinking``,
``reasoning_effort``). ``generate``/``stream`` (generation.py) take either the values
(``options=``, ``chat_options=``) or the same options as keyword arguments, and build the
values once (``call_options``, ``call_chat_options``); everything below them -- the decoding
driver, chat mode, the command line -- takes the values.

Two values rather than one: every field of ``GenerationOptions`` is hashable (the value can
be a cache key or a static argument of ``jax.jit``), while chat tools are JSON schemas
(dicts); and only chat mode (chat_decoding.py) reads the chat options, only the decoding the
others.
"""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Mapping

import numpy as np

from .chat import REASONING_EFFORTS
from .sampling import Greedy, Sampler

__all__ = ["GenerationOptions", "ChatOptions", "call_options", "call_chat_options",
           "CALL_DEFAULTS", "CHAT_CALL_DEFAULTS"]

_SEED_RANGE = (-2 ** 63, 2 ** 63)           # what jax.random.key accepts (a C long)
# Cache.init's kv_dtype values (dsv4_jax.kv_entry.KV_DTYPES; a test keeps them equal): not
# imported from there, so that the command line parses its flags without importing JAX.
KV_DTYPES = (None, "fp8", "fp8+fp4")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationOptions:
    """How ``generate``/``stream`` decode; the keyword arguments of the same names there.

    ``max_new_tokens``: the budget per row (required). ``sampler``: a ``dsv4_jax.sampling``
    sampler. ``stop_tokens``: ids that end a row (kept as a tuple; None: the config's EOS;
    ``()``: none). ``seed``: of the random draws. ``logprobs``: return per-token
    log-probabilities. ``max_len``: cache capacity per row (None: the bucketed prompt
    length + budget). ``speculative``: MTP speculative decoding. ``prefill_chunk``: prompts
    are prefilled this many tokens per row and call (None: ``decoding.default_prefill_chunk``,
    8192 tokens per call on a GPU shared by the rows; it must be a multiple of the model's
    compression ratios, checked at the call), so memory and compiled programs do not grow
    with the prompt. ``prefill_progress``: show a progress
    bar (stderr) while a prompt longer than one chunk is prefilled. ``kv_dtype``: ``"fp8"``
    keeps the compressed cache entries as 584-byte FP8 rows (``Cache.init``; 1.75x smaller,
    the same values under the model's FP8 simulation), ``"fp8+fp4"`` those and the indexer's
    keys as 72-byte MXFP4 rows (3.6x smaller, exact under the FP4 simulation; a slower
    indexer: docs/performance.md), None in the model's dtype.

    Raises ValueError / TypeError naming the field and the bad value. Whether stop tokens are
    in the vocabulary, and whether the model has an MTP block, is checked at the call, where
    the model is known.
    """
    max_new_tokens: int
    sampler: Sampler = Greedy()
    stop_tokens: tuple[int, ...] | None = None
    seed: int = 0
    logprobs: bool = False
    max_len: int | None = None
    speculative: bool = False
    prefill_chunk: int | None = None
    prefill_progress: bool = False
    kv_dtype: str | None = None

    def __post_init__(self):
        n = self.max_new_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"max_new_tokens must be a positive int, got {n!r}")
        if not isinstance(self.sampler, Sampler):
            raise TypeError(f"sampler must be a dsv4_jax Sampler, got "
                            f"{type(self.sampler).__name__}")
        stop = self.stop_tokens
        if stop is not None:
            if isinstance(stop, (str, bytes)) or not isinstance(stop, Iterable):
                raise TypeError(f"stop_tokens must be a list of token ids, got {stop!r}")
            stop = tuple(stop)
            bad = [t for t in stop if not _is_int(t)]
            if bad:
                raise TypeError(f"stop_tokens must be ints, got {bad[0]!r}")
            object.__setattr__(self, "stop_tokens", tuple(int(t) for t in stop))
        if not _is_int(self.seed):
            raise TypeError(f"seed must be an int, got {self.seed!r}")
        if not _SEED_RANGE[0] <= self.seed < _SEED_RANGE[1]:
            raise ValueError(f"seed must be in [-2**63, 2**63), got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "logprobs", _check_bool("logprobs", self.logprobs))
        m = self.max_len
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m <= 0):
            raise ValueError(f"max_len must be a positive int, got {m!r}")
        object.__setattr__(self, "speculative", _check_bool("speculative", self.speculative))
        c = self.prefill_chunk
        if c is not None and (not _is_int(c) or c <= 0):
            raise ValueError(f"prefill_chunk must be a positive int, got {c!r}")
        if c is not None:
            object.__setattr__(self, "prefill_chunk", int(c))
        object.__setattr__(self, "prefill_progress",
                           _check_bool("prefill_progress", self.prefill_progress))
        if not (self.kv_dtype is None or (isinstance(self.kv_dtype, str)
                                          and self.kv_dtype in KV_DTYPES)):
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatOptions:
    """Chat mode of ``generate``/``stream``: ``prompts`` are conversations, encoded with
    ``encode_chat(tools=, thinking=, drop_thinking=, reasoning_effort=)`` (see there), and
    each completion is parsed back into a message. ``tools`` is kept as a tuple; the value is
    hashable only without tools (the schemas are dicts). The schemas and the conversations
    themselves are checked by ``encode_chat`` at the call."""
    tools: tuple | None = None
    thinking: bool = False
    drop_thinking: bool = True
    reasoning_effort: str | None = None

    def __post_init__(self):
        tools = self.tools
        if tools is not None:
            if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Iterable):
                raise TypeError(f"tools must be a list of OpenAI function schemas, got "
                                f"{type(tools).__name__}")
            object.__setattr__(self, "tools", tuple(tools))
        object.__setattr__(self, "thinking", _check_bool("thinking", self.thinking))
        object.__setattr__(self, "drop_thinking",
                           _check_bool("drop_thinking", self.drop_thinking))
        if self.reasoning_effort not in REASONING_EFFORTS:
            raise ValueError(f"reasoning_effort must be one of {REASONING_EFFORTS}, got "
                             f"{self.reasoning_effort!r}")


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING}


# The keyword arguments of generate/stream leave an option unset at these values; the budget
# has no default in GenerationOptions, and None there.
CALL_DEFAULTS = {"max_new_tokens": None, **_defaults(GenerationOptions)}
CHAT_CALL_DEFAULTS = _defaults(ChatOptions)


def _is_default(value, default) -> bool:
    if default is None:
        return value is None
    try:
        return bool(value == default)
    except (TypeError, ValueError):         # e.g. an array: not the default
        return False


def _check_alone(value_name: str, cls, given: dict, defaults: dict) -> None:
    set_beside = {k: v for k, v in given.items() if not _is_default(v, defaults[k])}
    if set_beside:
        args = ", ".join(f"{k}={v!r}" for k, v in set_beside.items())
        raise ValueError(f"{value_name}= and {args} given together: set "
                         f"{', '.join(set_beside)} in the {cls.__name__}, or leave "
                         f"{value_name}= out")


def call_options(options: GenerationOptions | None, **given) -> GenerationOptions:
    """The ``GenerationOptions`` of a ``generate``/``stream`` call: ``options``, or the value
    of the keyword arguments ``given`` (name -> value). An argument set beside ``options``
    (not at its default) raises ValueError naming both."""
    if options is None:
        if given.get("max_new_tokens") is None:
            raise TypeError("max_new_tokens is required (or options=GenerationOptions(...))")
        return GenerationOptions(**given)
    if not isinstance(options, GenerationOptions):
        raise TypeError(f"options must be a GenerationOptions, got {type(options).__name__}")
    _check_alone("options", GenerationOptions, given, CALL_DEFAULTS)
    return options


def call_chat_options(chat_options: ChatOptions | None, chat: bool,
                      **given) -> ChatOptions | None:
    """The ``ChatOptions`` of a call, or None outside chat mode. Chat mode: ``chat_options``
    given, ``chat=True``, ``tools`` given or ``thinking=True``; without one of them
    ``drop_thinking`` and ``reasoning_effort`` are not read. An argument set beside
    ``chat_options`` (``chat=True`` aside) raises ValueError naming both."""
    if chat_options is None:
        if not (chat or given.get("tools") is not None or given.get("thinking")):
            return None
        return ChatOptions(**given)
    if not isinstance(chat_options, ChatOptions):
        raise TypeError(f"chat_options must be a ChatOptions, got "
                        f"{type(chat_options).__name__}")
    _check_alone("chat_options", ChatOptions, given, CHAT_CALL_DEFAULTS)
    return chat_options
