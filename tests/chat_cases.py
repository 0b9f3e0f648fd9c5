"""Chat inputs shared by the chat test files: a tool call, a tool, and a small tokenizer
shaped like the official one."""
import pytest

from dsv4_jax.chat import BOS, EOS, FORMAT_TOKENS


def call(name, arguments, id_=None):
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return out if id_ is None else {"id": id_, **out}


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def byte_level_tokenizer(path):
    """A small tokenizer.json shaped like the official one: byte-level BPE (no merges here), BOS
    and EOS as special added tokens, the other format tokens as plain added tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok = tokenizers.Tokenizer(tokenizers.models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    tok.add_tokens([t for t in FORMAT_TOKENS if t not in (BOS, EOS)])
    tok.save(str(path / "tokenizer.json"))
    return tok
