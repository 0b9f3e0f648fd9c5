"""Tokenizers: HF ``tokenizer.json`` (via the ``tokenizers`` library) or a byte-level fallback,
and the DeepSeek-V4 chat encoding of ``messages`` (``encode_chat``, defined in ``chat.py``).
"""
from __future__ import annotations

import os

from .chat import (ASSISTANT, BOS, DSML, EOS, FORMAT_TOKENS, LATEST_REMINDER, THINK_END,
                   THINK_START, USER, encode_chat, parse_completion)

__all__ = ["ByteTokenizer", "HFTokenizer", "load_tokenizer", "encode_chat", "parse_completion",
           "BOS", "EOS", "USER", "ASSISTANT", "LATEST_REMINDER", "THINK_START", "THINK_END",
           "DSML", "FORMAT_TOKENS"]


class ByteTokenizer:
    """UTF-8 bytes as ids ``3 + byte`` (0 = BOS, 1 = EOS, 2 = pad), so any model with a
    vocabulary of at least 259 ids can run text without a download."""
    bos_id, eos_id, pad_id, offset = 0, 1, 2, 3
    has_chat_tokens = False

    def __init__(self, vocab_size: int = 259):
        if vocab_size < 259:
            raise ValueError(f"ByteTokenizer needs a vocabulary of at least 259 ids, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if text.startswith(BOS):        # chat prompts carry BOS as text: one BOS id, not its bytes
            text, add_bos = text[len(BOS):], True
        ids = [b + self.offset for b in text.encode("utf-8")]
        return [self.bos_id] + ids if add_bos else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (BOS / EOS / pad ids have no bytes, whatever ``skip_special_tokens``)."""
        data = bytes(int(i) - self.offset for i in ids if self.offset <= int(i) < self.offset + 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` (HF ``tokenizers``); DSV4's chat special tokens when present."""

    def __init__(self, path: str | os.PathLike, bos_id: int | None = None,
                 eos_id: int | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:                    # pragma: no cover - dependency is declared
            raise ImportError("loading tokenizer.json needs the `tokenizers` package") from e
        path = os.fspath(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no tokenizer.json at {path!r}")
        self._tok = Tokenizer.from_file(file)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._tok.token_to_id(BOS) if bos_id is None else bos_id
        self.eos_id = self._tok.token_to_id(EOS) if eos_id is None else eos_id
        self.has_chat_tokens = all(self._tok.token_to_id(t) is not None
                                   for t in (BOS, EOS, USER, ASSISTANT))

    def chat_token_ids(self) -> dict[str, int]:
        """Id of every token the DSV4 chat format writes (``FORMAT_TOKENS``); raises ValueError
        naming those that do not encode to exactly one id (a tokenizer.json from elsewhere)."""
        ids, missing = {}, []
        for token in FORMAT_TOKENS:
            got = self._tok.encode(token, add_special_tokens=False).ids
            if len(got) == 1 and self._tok.id_to_token(got[0]) == token:
                ids[token] = got[0]
            else:
                missing.append(token)
        if missing:
            raise ValueError(f"tokenizer.json lacks the DSV4 chat tokens {missing} "
                             f"(each must encode to one id)")
        return ids

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None and not text.startswith(BOS):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ``skip_special_tokens=False`` keeps BOS / EOS (needed to parse chat
        completions: the DSML, think and role tokens are never skipped in the official file)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def load_tokenizer(path: str | os.PathLike | None, vocab_size: int):
    """``tokenizer.json`` from a checkpoint directory if there is one, else the byte fallback."""
    if path is not None:
        file = os.path.join(os.fspath(path), "tokenizer.json")
        if os.path.isfile(file):
            return HFTokenizer(file)
    return ByteTokenizer(vocab_size)
