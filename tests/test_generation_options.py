"""GenerationOptions and ChatOptions: checked on construction (one line naming the field and
the value), frozen and hashable, the same defaults as generate/stream's arguments, and an
argument set beside its value raises. Nothing here runs the model (the calls that raise do so
before any model work); that options= decodes as the keywords do is in test_generate."""
import dataclasses
import inspect

import numpy as np
import pytest

import dsv4_jax as dj
from dsv4_jax import sampling
from dsv4_jax.generation import generate, stream
from dsv4_jax.generation_options import (CALL_DEFAULTS, CHAT_CALL_DEFAULTS, ChatOptions,
                                         GenerationOptions, call_chat_options, call_options)

CONVERSATION = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("fields, error, message", [
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be a positive int, got 0"),
    (dict(max_new_tokens=True), ValueError, "max_new_tokens must be a positive int, got True"),
    (dict(max_new_tokens=2.5), ValueError, "max_new_tokens must be a positive int, got 2.5"),
    (dict(sampler="greedy"), TypeError, "sampler must be a dsv4_jax Sampler, got str"),
    (dict(stop_tokens=[1, 2.0]), TypeError, "stop_tokens must be ints, got 2.0"),
    (dict(stop_tokens=[True]), TypeError, "stop_tokens must be ints, got True"),
    (dict(stop_tokens="5"), TypeError, "stop_tokens must be a list of token ids, got '5'"),
    (dict(stop_tokens=5), TypeError, "stop_tokens must be a list of token ids, got 5"),
    (dict(seed=1.5), TypeError, "seed must be an int, got 1.5"),
    (dict(seed=2 ** 63), ValueError, f"seed must be in [-2**63, 2**63), got {2 ** 63}"),
    (dict(logprobs="yes"), TypeError, "logprobs must be a bool, got 'yes'"),
    (dict(max_len=0), ValueError, "max_len must be a positive int, got 0"),
    (dict(max_len=-5), ValueError, "max_len must be a positive int, got -5"),
    (dict(speculative=1), TypeError, "speculative must be a bool, got 1"),
])
def test_bad_generation_options_are_one_line_naming_field_and_value(fields, error, message):
    with pytest.raises(error) as err:
        GenerationOptions(**{"max_new_tokens": 4, **fields})
    assert str(err.value) == message


@pytest.mark.parametrize("fields, error, message", [
    (dict(tools="get_weather"), TypeError, "tools must be a list of OpenAI function schemas, "
                                           "got str"),
    (dict(tools={"type": "function"}), TypeError, "tools must be a list of OpenAI function "
                                                  "schemas, got dict"),
    (dict(thinking="yes"), TypeError, "thinking must be a bool, got 'yes'"),
    (dict(drop_thinking=None), TypeError, "drop_thinking must be a bool, got None"),
    (dict(reasoning_effort="low"), ValueError, "reasoning_effort must be one of (None, 'high', "
                                               "'max'), got 'low'"),
])
def test_bad_chat_options_are_one_line_naming_field_and_value(fields, error, message):
    with pytest.raises(error) as err:
        ChatOptions(**fields)
    assert str(err.value) == message


def test_options_are_frozen_hashable_and_normalised():
    a = GenerationOptions(max_new_tokens=8, sampler=sampling.TopK(40, temperature=0.9),
                          stop_tokens=np.array([3, 4]), seed=np.int64(5))
    assert a.stop_tokens == (3, 4) and all(type(t) is int for t in a.stop_tokens)
    assert type(a.seed) is int
    b = GenerationOptions(max_new_tokens=8, sampler=sampling.TopK(40, temperature=0.9),
                          stop_tokens=[3, 4], seed=5)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert GenerationOptions(max_new_tokens=8, stop_tokens=()).stop_tokens == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.seed = 6
    with pytest.raises(TypeError):
        GenerationOptions(8)                                    # keyword-only
    tools = [{"type": "function", "function": {"name": "f"}}]
    chat = ChatOptions(tools=tools, thinking=True)
    assert chat.tools == tuple(tools)
    assert hash(ChatOptions(thinking=True)) == hash(ChatOptions(thinking=True))
    assert dj.GenerationOptions is GenerationOptions and dj.ChatOptions is ChatOptions


@pytest.mark.parametrize("function", [generate, stream])
def test_option_defaults_are_those_of_generate_and_stream(function):
    parameters = inspect.signature(function).parameters
    for name, default in {**CALL_DEFAULTS, **CHAT_CALL_DEFAULTS}.items():
        assert parameters[name].default == default, name
    assert list(parameters) == list(inspect.signature(generate).parameters)
    names = {f.name for f in dataclasses.fields(GenerationOptions)}
    names |= {f.name for f in dataclasses.fields(ChatOptions)}
    assert names <= set(parameters)                 # every option is also an argument


def test_an_argument_beside_its_value_raises_naming_both():
    opts = GenerationOptions(max_new_tokens=4, seed=1)
    with pytest.raises(ValueError) as err:
        generate(None, None, ["x"], seed=3, options=opts)
    assert str(err.value) == ("options= and seed=3 given together: set seed in the "
                              "GenerationOptions, or leave options= out")
    with pytest.raises(ValueError, match=r"options= and max_new_tokens=4, logprobs=True given"):
        stream(None, None, ["x"], 4, logprobs=True, options=opts)
    with pytest.raises(ValueError, match=r"options= and sampler=TopK\("):
        generate(None, None, ["x"], sampler=sampling.TopK(3, temperature=1.0), options=opts)
    with pytest.raises(ValueError, match="chat_options= and thinking=True given together: set "
                                         "thinking in the ChatOptions"):
        generate(None, None, CONVERSATION, 4, thinking=True, chat_options=ChatOptions())
    with pytest.raises(ValueError, match="chat_options= and reasoning_effort='max'"):
        stream(None, None, CONVERSATION, 4, reasoning_effort="max", chat_options=ChatOptions())
    # arguments left at their defaults, and chat=True (the switch), go with the values
    assert call_options(opts, max_new_tokens=None, sampler=sampling.Greedy(), seed=0,
                        stop_tokens=None) is opts
    chat = ChatOptions(thinking=True)
    assert call_chat_options(chat, True, tools=None, drop_thinking=True) is chat


def test_calls_without_or_with_wrong_values():
    with pytest.raises(TypeError, match=r"max_new_tokens is required \(or options="):
        generate(None, None, ["x"])
    with pytest.raises(TypeError, match="options must be a GenerationOptions, got dict"):
        stream(None, None, ["x"], options={"max_new_tokens": 4})
    with pytest.raises(TypeError, match="chat_options must be a ChatOptions, got bool"):
        generate(None, None, CONVERSATION, 4, chat_options=True)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int, got -1"):
        generate(None, None, ["x"], -1)
    # keywords build the same value; chat mode only when asked for
    assert call_options(None, max_new_tokens=4, seed=2) == GenerationOptions(max_new_tokens=4,
                                                                             seed=2)
    assert call_chat_options(None, False, tools=None, thinking=False,
                             reasoning_effort="max") is None
    assert call_chat_options(None, True, tools=None, thinking=False) == ChatOptions()
    assert call_chat_options(None, False, tools=[], thinking=False) == ChatOptions(tools=())
    # chat mode keeps refusing stop tokens, given as a keyword or in the value
    with pytest.raises(ValueError, match="stop_tokens cannot be given with chat=True"):
        generate(None, None, CONVERSATION, options=GenerationOptions(max_new_tokens=4,
                                                                     stop_tokens=[1]),
                 chat_options=ChatOptions())
