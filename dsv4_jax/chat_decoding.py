"""What chat mode adds around decoding: conversations in, parsed assistant messages out.

``generate``/``stream`` (generation.py) call this in chat mode (``chat_options``, or
``chat=True``, ``tools``, ``thinking``; see generation_options.py): each conversation is
encoded with the DSV4 chat format (``chat.encode_chat``), rows stop at end-of-sentence, and
each completion is parsed back (``chat.parse_completion``).
A completion that cannot be parsed -- cut by ``max_new_tokens``, or malformed -- gives ``None``
in ``messages`` and the reason in ``errors``, so one bad row does not lose the others.

This module sits below generation.py in the generation layer (docs/architecture.md §1.2): it
prepares prompts and reads results, and never calls generation itself.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Iterator

import numpy as np

from .chat import EOS, encode_chat, parse_completion
from .decoding import GenerationResult, StreamEvent
from .generation_options import ChatOptions, GenerationOptions
from .tokenizer import ByteTokenizer

__all__ = ["ChatResult", "ChatBatch", "as_conversations", "chat_batch"]


@dataclasses.dataclass
class ChatResult(GenerationResult):
    """``GenerationResult`` of a chat (``text`` keeps special tokens, e.g. the DSML tags) plus,
    per conversation, its prompt text, the parsed assistant message (or None) and why not."""
    prompts: list = dataclasses.field(default_factory=list)
    messages: list = dataclasses.field(default_factory=list)
    errors: list = dataclasses.field(default_factory=list)


def as_conversations(conversations) -> list[list]:
    """One conversation (a list of message dicts) or a list of them -> a list of conversations."""
    def is_conversation(c):
        return (isinstance(c, Sequence) and not isinstance(c, (str, bytes)) and len(c) > 0
                and all(isinstance(m, Mapping) for m in c))
    if is_conversation(conversations):
        return [list(conversations)]
    if (isinstance(conversations, Sequence) and not isinstance(conversations, (str, bytes))
            and len(conversations) > 0 and all(is_conversation(c) for c in conversations)):
        return [list(c) for c in conversations]
    raise TypeError("chat: conversations must be a non-empty list of message dicts "
                    "(one conversation) or a list of such lists")


def _parse(text: str, finish_reason: str, thinking: bool):
    """(message, None) or (None, why) for one completion (its stop token not included)."""
    try:
        if finish_reason == "stop":
            return parse_completion(text + EOS, thinking=thinking), None
        # Cut by the budget: only a completion that ends with a closed tool-call block parses.
        return parse_completion(text, thinking=thinking), None
    except ValueError as e:
        cut = "" if finish_reason == "stop" else "stopped at max_new_tokens: "
        return None, cut + str(e)


@dataclasses.dataclass
class ChatBatch:
    """Encoded conversations ready for decoding: ``prompts`` (text), the ``tokenizer`` to use
    and the ``options`` to decode them with (their ``stop_tokens``: its end-of-sentence id);
    ``finish`` / ``stream`` read the results."""
    prompts: list
    tokenizer: object
    options: GenerationOptions
    thinking: bool

    def _texts(self, token_rows) -> list[str]:
        return [self.tokenizer.decode(ids, skip_special_tokens=False) for ids in token_rows]

    def finish(self, result: GenerationResult) -> ChatResult:
        texts = self._texts(result.tokens)
        parsed = [_parse(t, r, self.thinking) for t, r in zip(texts, result.finish_reasons)]
        fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(GenerationResult)}
        fields["text"] = texts
        return ChatResult(**fields, prompts=self.prompts, messages=[m for m, _ in parsed],
                          errors=[e for _, e in parsed])

    def stream(self, events: Iterator[StreamEvent]) -> Iterator[StreamEvent]:
        """Pass ``events`` through; the last one also carries ``messages`` and ``errors``."""
        stop = set(self.options.stop_tokens)
        tokens = [[] for _ in self.prompts]
        reasons = ["length"] * len(self.prompts)
        for event in events:
            for row, token in enumerate(np.asarray(event.tokens).tolist()):
                if token in stop:
                    reasons[row] = "stop"
                elif token >= 0 and reasons[row] != "stop":
                    tokens[row].append(token)
            if np.all(event.done):
                parsed = [_parse(t, r, self.thinking)
                          for t, r in zip(self._texts(tokens), reasons)]
                event = dataclasses.replace(event, messages=[m for m, _ in parsed],
                                            errors=[e for _, e in parsed])
            yield event


def chat_batch(model, conversations, tokenizer, options: GenerationOptions,
               chat: ChatOptions) -> ChatBatch:
    """Encode ``conversations`` for ``model`` with the ``chat`` options (see the module
    docstring); the batch's options are ``options`` with the end-of-sentence stop.
    ``tokenizer``: a ``tokenizer.json`` holding the chat tokens or, by default, the byte
    fallback. Raises ValueError / TypeError naming the conversation (and the message) that is
    wrong."""
    if options.stop_tokens is not None:
        raise ValueError("stop_tokens cannot be given with chat=True: a chat turn ends at "
                         "end-of-sentence, where its completion is parsed")
    if tokenizer is None:
        tokenizer = ByteTokenizer(model.config.vocab_size)
    elif hasattr(tokenizer, "chat_token_ids"):
        tokenizer.chat_token_ids()        # ValueError when the chat tokens are not single ids
    prompts = []
    for k, conversation in enumerate(as_conversations(conversations)):
        try:
            prompts.append(encode_chat(conversation, thinking=chat.thinking, tools=chat.tools,
                                       drop_thinking=chat.drop_thinking,
                                       reasoning_effort=chat.reasoning_effort))
        except (ValueError, TypeError) as e:
            raise type(e)(f"conversation {k}: {e}") from None
    return ChatBatch(prompts, tokenizer,
                     dataclasses.replace(options, stop_tokens=(tokenizer.eos_id,)),
                     chat.thinking)
