"""Chat generation: generate/stream(chat=True) == plain generation of the encoded prompt with an
end-of-sentence stop, messages == parse_completion of the completion, and the chat CLI
(--messages/--tools/--thinking). The runs of the model use test_generate's model and shapes
(batch 2, prompts <= 16 tokens -- the chat tokens are single ids here --, budget bucket 8),
so they compile nothing new; the rest stands a fake in for the decoding."""
import json

import numpy as np
import pytest

import dsv4_jax as dj
from dsv4_jax import chat_decoding, generation
from dsv4_jax.chat import DSML, EOS, encode_chat, parse_completion
from dsv4_jax.decoding import GenerationResult, StreamEvent
from dsv4_jax.generation import generate, stream
from dsv4_jax.tokenizer import ByteTokenizer, HFTokenizer
from chat_cases import WEATHER_TOOL, byte_level_tokenizer, call

CFG = dj.Config.tiny(dtype="float32", quant_simulation=False)       # test_generate's model
# each encodes to <= 16 ids with the chat tokens as single ids
CONVERSATIONS = [[{"role": "user", "content": "hi"}],
                 [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                  {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]]


@pytest.fixture(scope="module")
def tiny():
    return dj.DSV4(CFG), dj.init_params(CFG, 0)


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    byte_level_tokenizer(path)
    return HFTokenizer(path)


def expected_messages(texts, reasons, thinking=False):
    """The reference: the official parse of each completion (EOS back on rows that stopped)."""
    out = []
    for text, reason in zip(texts, reasons):
        try:
            out.append(parse_completion(text + (EOS if reason == "stop" else ""),
                                        thinking=thinking))
        except ValueError:
            out.append(None)
    return out


def test_generate_chat_is_generation_of_the_encoded_prompts(tiny, chat_tokenizer):
    model, params = tiny
    tok = chat_tokenizer
    got = generate(model, params, CONVERSATIONS, 6, chat=True, tokenizer=tok)
    assert isinstance(got, chat_decoding.ChatResult)
    prompts = [encode_chat(c) for c in CONVERSATIONS]
    assert got.prompts == prompts
    assert max(len(tok.encode(p)) for p in prompts) <= 16           # test_generate's bucket
    plain = generate(model, params, prompts, 6, tokenizer=tok, stop_tokens=(tok.eos_id,))
    assert got.tokens == plain.tokens and got.finish_reasons == plain.finish_reasons
    assert got.text == [tok.decode(t, skip_special_tokens=False) for t in plain.tokens]
    assert got.messages == expected_messages(got.text, got.finish_reasons)
    assert [e is None for e in got.errors] == [m is not None for m in got.messages]


def test_stream_chat_equals_generate_chat_and_carries_the_messages(tiny, chat_tokenizer):
    model, params = tiny
    want = generate(model, params, CONVERSATIONS, 6, tokenizer=chat_tokenizer, thinking=True)
    events = list(stream(model, params, CONVERSATIONS, 6, tokenizer=chat_tokenizer,
                         thinking=True))                             # thinking implies chat
    assert all(e.messages is None and e.errors is None for e in events[:-1])
    assert events[-1].messages == want.messages and events[-1].errors == want.errors
    streamed = np.stack([e.tokens for e in events], axis=1)
    for row, tokens in enumerate(want.tokens):
        assert [t for t in streamed[row].tolist() if t >= 0][:len(tokens)] == tokens


def test_one_conversation_is_a_batch_of_one():
    assert chat_decoding.as_conversations(CONVERSATIONS[1]) == [CONVERSATIONS[1]]
    assert chat_decoding.as_conversations(tuple(CONVERSATIONS)) == CONVERSATIONS
    for bad in ([], "hi", ["hi"], [[]], [CONVERSATIONS[0], "x"]):
        with pytest.raises(TypeError, match="conversations must be"):
            chat_decoding.as_conversations(bad)


TOOL_COMPLETION = (f'Checking.\n\n<{DSML}tool_calls>\n<{DSML}invoke name="get_weather">\n'
                   f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n'
                   f'</{DSML}invoke>\n</{DSML}tool_calls>')
TOOL_MESSAGE = {"role": "assistant", "reasoning_content": "", "content": "Checking.",
                "tool_calls": [call("get_weather", '{"city": "Paris"}')]}


def fake_decoding(monkeypatch, completions, reasons, tok=ByteTokenizer(CFG.vocab_size)):
    """Stands in for the decoding under ``generate``/``stream``: records the prompts, the
    tokenizer and the stop tokens it gets, returns ``completions`` as token ids (+ the stop
    token where the reason is "stop", as the decoding does)."""
    seen = []
    rows = [tok.encode(c, add_bos=False) for c in completions]

    def run(model, params, prompts, options, *, tokenizer):
        seen.append((prompts, dict(tokenizer=tokenizer, stop_tokens=options.stop_tokens)))
        return GenerationResult(rows, list(reasons), [tok.decode(t) for t in rows])

    def run_stream(model, params, prompts, options, *, tokenizer):
        seen.append((prompts, dict(tokenizer=tokenizer, stop_tokens=options.stop_tokens)))
        full = [r + ([options.stop_tokens[0]] if why == "stop" else [])
                for r, why in zip(rows, reasons)]
        for k in range(max(map(len, full))):
            tokens = np.array([r[k] if k < len(r) else -1 for r in full])
            done = np.array([k >= len(r) - 1 for r in full])
            yield StreamEvent(k, tokens, done, None, [""] * len(full))

    monkeypatch.setattr(generation, "_generate", run)
    monkeypatch.setattr(generation, "_stream", run_stream)
    return seen


def test_messages_of_stopped_and_cut_rows(tiny, monkeypatch):
    model, params = tiny
    completions = [TOOL_COMPLETION, TOOL_COMPLETION, "Hello", "cut off mid-sen"]
    reasons = ["stop", "length", "stop", "length"]
    seen = fake_decoding(monkeypatch, completions, reasons)
    convs = [CONVERSATIONS[0]] * 4
    got = generate(model, params, convs, 8, chat=True, tools=[WEATHER_TOOL])
    prompt = encode_chat(CONVERSATIONS[0], tools=[WEATHER_TOOL])
    assert seen[0][0] == [prompt] * 4 and seen[0][1]["stop_tokens"] == (1,)
    assert isinstance(seen[0][1]["tokenizer"], ByteTokenizer)       # the default: bytes
    hello = {"role": "assistant", "reasoning_content": "", "content": "Hello", "tool_calls": []}
    # a closed tool-call block parses even when the budget ended right after it
    assert got.messages == [TOOL_MESSAGE, TOOL_MESSAGE, hello, None]
    assert got.errors[:3] == [None] * 3
    assert got.errors[3].startswith("stopped at max_new_tokens: parse_completion: the "
                                    "completion does not end with")
    events = list(stream(model, params, convs, 8, tools=[WEATHER_TOOL]))
    assert events[-1].messages == got.messages and events[-1].errors == got.errors


def test_chat_options_reach_the_encoding(tiny, monkeypatch, chat_tokenizer):
    model, params = tiny
    completion = "r2</think>" + TOOL_COMPLETION
    seen = fake_decoding(monkeypatch, [completion], ["stop"], chat_tokenizer)
    history = [{"role": "user", "content": "q"},
               {"role": "assistant", "reasoning_content": "r", "content": "x"},
               {"role": "user", "content": "again"}]
    got = generate(model, params, history, 6, tokenizer=chat_tokenizer, thinking=True,
                   drop_thinking=False, reasoning_effort="max")
    assert seen[0][0] == [encode_chat(history, thinking=True, drop_thinking=False,
                                      reasoning_effort="max")]
    assert seen[0][0] != [encode_chat(history, thinking=True)]
    assert seen[0][1]["stop_tokens"] == (chat_tokenizer.eos_id,)
    assert got.messages == [{**TOOL_MESSAGE, "reasoning_content": "r2"}]
    assert got.text == [completion]
    # DSML tags are single tokens here, as in the official tokenizer.json
    assert len(got.tokens[0]) < len(completion.encode()) - 50


def test_chat_options_value_encodes_as_the_keywords(tiny, monkeypatch, chat_tokenizer):
    model, params = tiny
    seen = fake_decoding(monkeypatch, ["r</think>fine"], ["stop"], chat_tokenizer)
    chat = dict(tools=[WEATHER_TOOL], thinking=True, drop_thinking=False,
                reasoning_effort="max")
    value = dj.ChatOptions(**chat)
    want = generate(model, params, CONVERSATIONS[1], 6, tokenizer=chat_tokenizer, **chat)
    got = generate(model, params, CONVERSATIONS[1], tokenizer=chat_tokenizer,
                   options=dj.GenerationOptions(max_new_tokens=6), chat_options=value)
    events = list(stream(model, params, CONVERSATIONS[1], 6, tokenizer=chat_tokenizer,
                         chat_options=value))
    assert seen[0] == seen[1] == seen[2]
    assert seen[0][0] == [encode_chat(CONVERSATIONS[1], **chat)]
    assert got.messages == want.messages == events[-1].messages
    assert got.messages[0]["reasoning_content"] == "r"


def test_chat_bad_input(tiny, tmp_path):
    model, params = tiny
    with pytest.raises(ValueError, match=r"conversation 1: encode_chat: message 0: unknown role"):
        generate(model, params, [CONVERSATIONS[0], [{"role": "bot"}]], 4, chat=True)
    with pytest.raises(ValueError, match="conversation 1: encode_chat: message 0: unknown role"):
        stream(model, params, [CONVERSATIONS[0], [{"role": "bot"}]], 4, chat=True)  # at once
    with pytest.raises(ValueError, match="stop_tokens cannot be given with chat=True"):
        generate(model, params, CONVERSATIONS, 4, chat=True, stop_tokens=[1])
    with pytest.raises(TypeError, match="conversations must be"):
        generate(model, params, ["hi"], 4, chat=True)
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="lacks the DSV4 chat tokens"):
        generate(model, params, CONVERSATIONS, 4, chat=True, tokenizer=HFTokenizer(tmp_path))


# ----------------------------------------------------------------------------- CLI
@pytest.fixture
def cli(tiny, monkeypatch):
    """``main`` with the model load replaced by test_generate's model (no load, no compile)."""
    from dsv4_jax import cli_generate
    from dsv4_jax.__main__ import main
    model, params = tiny
    monkeypatch.setattr(cli_generate, "load_model",
                        lambda path: (model, params, ByteTokenizer(CFG.vocab_size)))
    return main


def test_cli_messages_and_tools_print_the_parsed_message(cli, tmp_path, monkeypatch, capsys):
    seen = fake_decoding(monkeypatch, [TOOL_COMPLETION], ["stop"])
    conversation = [{"role": "system", "content": "S"}, {"role": "user", "content": "Paris?"}]
    (tmp_path / "m.json").write_text(json.dumps(conversation))
    (tmp_path / "t.json").write_text(json.dumps([WEATHER_TOOL]))
    argv = ["generate", "--messages", str(tmp_path / "m.json"), "--tools", str(tmp_path / "t.json"),
            "--max-new-tokens", "8"]
    assert cli(argv) == 0
    assert json.loads(capsys.readouterr().out) == TOOL_MESSAGE
    assert seen[-1][0] == [encode_chat(conversation, tools=[WEATHER_TOOL])]
    assert cli(argv + ["--stream"]) == 0                              # the same message
    assert json.loads(capsys.readouterr().out) == TOOL_MESSAGE
    # {"messages", "tools"} in one file, thinking mode with max effort
    (tmp_path / "both.json").write_text(json.dumps({"messages": conversation,
                                                    "tools": [WEATHER_TOOL]}))
    seen = fake_decoding(monkeypatch, ["Paris is sunny.</think>" + TOOL_COMPLETION], ["stop"])
    assert cli(["generate", "--messages", str(tmp_path / "both.json"), "--thinking",
                "--reasoning-effort", "max"]) == 0
    assert json.loads(capsys.readouterr().out) == {**TOOL_MESSAGE,
                                                  "reasoning_content": "Paris is sunny."}
    assert seen[0][0] == [encode_chat(conversation, tools=[WEATHER_TOOL], thinking=True,
                                      reasoning_effort="max")]


def test_cli_chat_reports_unparseable_completions_and_bad_flags(cli, tmp_path, monkeypatch,
                                                                capsys):
    seen = fake_decoding(monkeypatch, ["no end", "fine"], ["length", "stop"])
    assert cli(["generate", "--chat", "--prompt", "a", "--prompt", "b"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["content"] == "fine"
    assert "conversation 0: stopped at max_new_tokens" in captured.err
    assert "raw completion: 'no end'" in captured.err
    assert seen[0][0] == [encode_chat([{"role": "user", "content": p}]) for p in "ab"]
    (tmp_path / "bad.json").write_text("{not json")
    for argv, err in [
        (["--messages", str(tmp_path / "bad.json")], "is not valid JSON"),
        (["--messages", str(tmp_path / "missing.json")], "no such file"),
        (["--messages", str(tmp_path / "bad.json"), "--prompt", "x"], "not both"),
        (["--chat", "--prompt", "x", "--reasoning-effort", "max"], "needs --thinking"),
        (["--chat", "--prompt", "x", "--logprobs"], "not available in chat mode"),
        (["--tools", str(tmp_path / "bad.json"), "--prompt", "x"], "is not valid JSON"),
        (["--chat"], "at least one --prompt"),
    ]:
        assert cli(["generate", *argv]) == 2
        assert err in capsys.readouterr().err
