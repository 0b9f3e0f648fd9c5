"""DSV4 chat format: encode_chat against DeepSeek's published examples and each rule of the
format, parse_completion (well-formed output, round trips, malformed DSML), and the tokenizer."""
import json
import pathlib

import pytest

from chat_cases import WEATHER_TOOL, byte_level_tokenizer, call
from dsv4_jax.chat import (ASSISTANT, BOS, DSML, EOS, FORMAT_TOKENS, LATEST_REMINDER,
                           REASONING_EFFORT_MAX, TASK_TOKENS, THINK_END, THINK_START, USER,
                           encode_chat, parse_completion)

DATA = pathlib.Path(__file__).parent / "data" / "chat"
CASES = sorted(DATA.glob("case_*.json"))


def load(path):
    return json.loads(path.read_text(encoding="utf-8"))


# ----------------------------------------------------------------------------- published examples
def test_there_are_four_published_examples():
    assert [p.name for p in CASES] == [f"case_{n}.json" for n in range(1, 5)]


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_encode_chat_matches_the_published_prompt(path):
    case = load(path)
    assert encode_chat(case["messages"], thinking=case["thinking"],
                       tools=case["tools"]) == case["expected"]


def test_published_case_1_assistant_turns_parse_back():
    case = load(DATA / "case_1.json")
    prompt = case["expected"]
    marker = ASSISTANT + THINK_START
    first = prompt.index(marker) + len(marker)
    tool_turn = parse_completion(prompt[first:prompt.index(USER, first)], thinking=True)
    assert tool_turn == {
        "role": "assistant", "content": "",
        "reasoning_content": case["messages"][2]["reasoning_content"],
        "tool_calls": [call("get_weather", '{"location": "Beijing", "unit": "celsius"}')]}
    final = parse_completion(prompt[prompt.rindex(marker) + len(marker):], thinking=True)
    assert final == {"role": "assistant", "content": case["messages"][4]["content"],
                     "reasoning_content": case["messages"][4]["reasoning_content"],
                     "tool_calls": []}


def test_published_case_2_drops_the_earlier_reasoning():
    case = load(DATA / "case_2.json")
    prompt = encode_chat(case["messages"], thinking=True)
    assert case["messages"][2]["reasoning_content"] not in prompt
    last = prompt[prompt.rindex(ASSISTANT + THINK_START) + len(ASSISTANT + THINK_START):]
    assert parse_completion(last, thinking=True)["content"] == "The capital of France is Paris."


# ----------------------------------------------------------------------------- rules
def test_chat_and_thinking_openings():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert encode_chat(msgs) == f"{BOS}S{USER}hi{ASSISTANT}{THINK_END}"
    assert encode_chat(msgs, thinking=True) == f"{BOS}S{USER}hi{ASSISTANT}{THINK_START}"
    assert encode_chat(msgs, add_bos=False) == f"S{USER}hi{ASSISTANT}{THINK_END}"


def test_reasoning_is_written_only_in_thinking_mode():
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "reasoning_content": "r", "content": "a"}]
    assert encode_chat(msgs) == f"{BOS}{USER}q{ASSISTANT}{THINK_END}a{EOS}"
    assert encode_chat(msgs, thinking=True) == (
        f"{BOS}{USER}q{ASSISTANT}{THINK_START}r{THINK_END}a{EOS}")


def test_drop_thinking_default_and_off():
    msgs = [{"role": "user", "content": "q1"},
            {"role": "assistant", "reasoning_content": "old reasoning", "content": "a1"},
            {"role": "user", "content": "q2"}]
    assert encode_chat(msgs, thinking=True) == (
        f"{BOS}{USER}q1{ASSISTANT}{THINK_END}a1{EOS}{USER}q2{ASSISTANT}{THINK_START}")
    assert encode_chat(msgs, thinking=True, drop_thinking=False) == (
        f"{BOS}{USER}q1{ASSISTANT}{THINK_START}old reasoning{THINK_END}a1{EOS}"
        f"{USER}q2{ASSISTANT}{THINK_START}")
    # Without a user turn before it the assistant turn is past history only when one follows.
    assert encode_chat(msgs[1:], thinking=True, drop_thinking=False) == (
        f"{BOS}old reasoning{THINK_END}a1{EOS}{USER}q2{ASSISTANT}{THINK_START}")


def test_tools_anywhere_turn_drop_thinking_off():
    msgs = [{"role": "system", "content": "S", "tools": [WEATHER_TOOL]},
            {"role": "user", "content": "q1"},
            {"role": "assistant", "reasoning_content": "kept", "content": "a1"},
            {"role": "user", "content": "q2"}]
    prompt = encode_chat(msgs, thinking=True)
    assert f"{USER}q1{ASSISTANT}{THINK_START}kept{THINK_END}a1{EOS}" in prompt


def test_developer_before_the_last_user_turn_is_dropped_with_drop_thinking():
    msgs = [{"role": "developer", "content": "dev"}, {"role": "assistant", "content": "a"},
            {"role": "user", "content": "q"}]
    assert encode_chat(msgs, thinking=True) == f"{BOS}a{EOS}{USER}q{ASSISTANT}{THINK_START}"
    assert encode_chat(msgs) == (
        f"{BOS}{USER}dev{ASSISTANT}{THINK_END}a{EOS}{USER}q{ASSISTANT}{THINK_END}")


def test_tools_block_and_tools_argument():
    tools_block = encode_chat([{"role": "system", "content": "S", "tools": [WEATHER_TOOL]},
                               {"role": "user", "content": "q"}])
    schema = json.dumps(WEATHER_TOOL["function"], ensure_ascii=False)
    assert tools_block.startswith(f"{BOS}S\n\n## Tools\n\nYou have access to a set of tools")
    assert f"### Available Tool Schemas\n\n{schema}\n\nYou MUST strictly follow" in tools_block
    assert tools_block.endswith(f"invoke tool calls.\n{USER}q{ASSISTANT}{THINK_END}")
    same = encode_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "q"}],
                       tools=[WEATHER_TOOL])
    assert same == tools_block
    no_system = encode_chat([{"role": "user", "content": "q"}], tools=[WEATHER_TOOL])
    assert no_system == BOS + tools_block[len(BOS) + 1:]        # an empty system message
    with pytest.raises(ValueError, match="tools given both"):
        encode_chat([{"role": "system", "content": "S", "tools": [WEATHER_TOOL]}],
                    tools=[WEATHER_TOOL])


def test_tool_calls_block_string_and_json_parameters():
    args = {"city": "北京", "days": 3, "metric": True, "extra": None, "tags": ["a", "b"],
            "opts": {"x": 1.5}}
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [
                call("get_weather", json.dumps(args)), call("ping", "{}")]}]
    p = lambda k, flag, v: f'<{DSML}parameter name="{k}" string="{flag}">{v}</{DSML}parameter>'
    expected = (f"{BOS}{USER}q{ASSISTANT}{THINK_END}Let me check.\n\n<{DSML}tool_calls>\n"
                f'<{DSML}invoke name="get_weather">\n'
                + "\n".join([p("city", "true", "北京"), p("days", "false", "3"),
                             p("metric", "false", "true"), p("extra", "false", "null"),
                             p("tags", "false", '["a", "b"]'), p("opts", "false", '{"x": 1.5}')])
                + f'\n</{DSML}invoke>\n<{DSML}invoke name="ping">\n\n</{DSML}invoke>\n'
                f"</{DSML}tool_calls>{EOS}")
    assert encode_chat(msgs) == expected
    # Arguments given as a dict encode the same as their JSON text.
    msgs[1]["tool_calls"][0]["function"]["arguments"] = args
    assert encode_chat(msgs) == expected


def test_tool_results_merge_into_the_next_user_turn_in_call_order():
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                call("second_tool", "{}", "b"), call("first_tool", "{}", "a")]},
            {"role": "tool", "tool_call_id": "a", "content": "A"},
            {"role": "tool", "tool_call_id": "b", "content": "B"},
            {"role": "user", "content": "and now?"}]
    prompt = encode_chat(msgs)
    assert prompt.endswith(f"{EOS}{USER}<tool_result>B</tool_result>\n\n"
                           f"<tool_result>A</tool_result>\n\nand now?{ASSISTANT}{THINK_END}")
    parts = [{"type": "text", "text": "x"}, {"type": "image", "url": "u"}]
    msgs[2]["content"] = parts
    assert "<tool_result>x\n\n[Unsupported image]</tool_result>" in encode_chat(msgs)


def test_consecutive_user_messages_form_one_turn():
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert encode_chat(msgs) == f"{BOS}{USER}a\n\nb{ASSISTANT}{THINK_END}"


def test_latest_reminder_and_developer_roles():
    msgs = [{"role": "system", "content": "S"}, {"role": "latest_reminder", "content": "date"},
            {"role": "developer", "content": "do it"}]
    assert encode_chat(msgs, thinking=True) == (
        f"{BOS}S{LATEST_REMINDER}date{USER}do it{ASSISTANT}{THINK_START}")
    # A user turn followed by a reminder opens the assistant turn before the reminder.
    msgs = [{"role": "user", "content": "q"}, {"role": "latest_reminder", "content": "r"}]
    assert encode_chat(msgs) == f"{BOS}{USER}q{ASSISTANT}{THINK_END}{LATEST_REMINDER}r"


def test_reasoning_effort_max():
    msgs = [{"role": "user", "content": "solve it"}]
    assert REASONING_EFFORT_MAX.startswith("Reasoning Effort: Absolute maximum")
    assert REASONING_EFFORT_MAX.endswith("left unchecked.\n\n")
    assert encode_chat(msgs, thinking=True, reasoning_effort="max") == (
        f"{BOS}{REASONING_EFFORT_MAX}{USER}solve it{ASSISTANT}{THINK_START}")
    plain = encode_chat(msgs, thinking=True)
    assert encode_chat(msgs, thinking=True, reasoning_effort="high") == plain
    assert encode_chat(msgs, reasoning_effort="max") == f"{BOS}{USER}solve it{ASSISTANT}{THINK_END}"
    with pytest.raises(ValueError, match="reasoning_effort"):
        encode_chat(msgs, thinking=True, reasoning_effort="extreme")


@pytest.mark.parametrize("task", ["query", "authority", "domain", "read_url"])
def test_quick_instruction_tasks_on_a_user_message(task):
    msgs = [{"role": "user", "content": "q", "task": task}]
    assert encode_chat(msgs) == f"{BOS}{USER}q{TASK_TOKENS[task]}"


def test_action_and_title_tasks():
    msgs = [{"role": "user", "content": "q", "task": "action"},
            {"role": "assistant", "content": "Search"}]
    for thinking, think in ((False, THINK_END), (True, THINK_START)):
        # the answer to a task carries no reasoning block, even in thinking mode
        assert encode_chat(msgs, thinking=thinking) == (
            f"{BOS}{USER}q{ASSISTANT}{think}<｜action｜>Search{EOS}")
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "task": "title"},
            {"role": "assistant", "content": "A title"}]
    assert encode_chat(msgs) == f"{BOS}{USER}q{ASSISTANT}{THINK_END}a{EOS}<｜title｜>A title{EOS}"


def test_response_format_and_open_assistant_turn():
    fmt = {"type": "object", "properties": {"answer": {"type": "string"}}}
    msgs = [{"role": "system", "content": "S", "response_format": fmt},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "par", "wo_eos": True}]
    assert encode_chat(msgs) == (
        f"{BOS}S\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to "
        f"reply:\n{json.dumps(fmt)}{USER}q{ASSISTANT}{THINK_END}par")


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": "q"}, {"role": "robot", "content": "x"}],
     r"message 1: unknown role 'robot'"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call("f", "{oops")]}],
     r"message 1: tool_calls\[0\] \(f\): arguments are not valid JSON"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call("f", "[1]")]}],
     r"message 1: tool_calls\[0\] \(f\): arguments must be a JSON object"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}],
     r"message 1: a tool message must follow an assistant message with tool_calls"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
      {"role": "tool", "content": "r"}], r"message 2: a tool message must follow"),
    ([{"role": "user", "content": "q", "tools": [WEATHER_TOOL]}],
     r"message 0: 'tools' belong on a system or developer message, not on a user message"),
    ([{"role": "user", "content": "q", "task": "summary"}], r"message 0: unknown task 'summary'"),
    ([{"role": "developer", "content": ""}], r"message 0: a developer message needs"),
    ([{"role": "system", "tools": [{"type": "function"}]}], r"message 0: tools\[0\] is not a"),
    ([], r"messages is empty"),
])
def test_bad_messages_raise_one_clear_value_error(messages, match):
    with pytest.raises(ValueError, match=match):
        encode_chat(messages)


def test_bad_types_raise_type_error():
    with pytest.raises(TypeError, match="messages must be a list"):
        encode_chat("hello")
    with pytest.raises(TypeError, match="message 0 must be a dict"):
        encode_chat(["hello"])
    with pytest.raises(TypeError, match="message 0: 'content' must be a string"):
        encode_chat([{"role": "user", "content": 3}])
    with pytest.raises(TypeError, match="thinking must be a bool"):
        encode_chat([{"role": "user", "content": "q"}], thinking="yes")


# ----------------------------------------------------------------------------- parsing
def completion_of(message, thinking):
    """The text the model would generate for ``message``: its turn in an encoded conversation."""
    prompt = encode_chat([{"role": "user", "content": "q"}], thinking=thinking)
    full = encode_chat([{"role": "user", "content": "q"}, message], thinking=thinking)
    assert full.startswith(prompt)
    return full[len(prompt):]


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("message", [
    {"content": "Plain answer.\nTwo lines."},
    {"content": "", "tool_calls": [call("get_weather", '{"city": "Paris"}')]},
    {"content": "Checking both.", "tool_calls": [
        call("get_weather", '{"city": "北京", "days": 3, "hourly": false, "extra": null}'),
        call("search", '{"query": "a <b> \\"c\\"", "filters": {"lang": ["en", "fr"]}, "n": 2.5}'),
        call("ping", "{}")]},
], ids=["content", "one-call", "three-calls"])
def test_round_trip_encode_then_parse(message, thinking):
    message = {"role": "assistant", "reasoning_content": "Think.\n\nHard." if thinking else "",
               "tool_calls": [], **message}
    parsed = parse_completion(completion_of(message, thinking), thinking=thinking)
    assert parsed == message


def test_parse_is_the_official_decoding_of_arguments():
    # Compact JSON comes back in Python's default layout (the official decoder's), same value.
    text = completion_of({"role": "assistant", "tool_calls": [call("f", '{"a":1,"b":"x"}')]}, False)
    got = parse_completion(text)["tool_calls"][0]["function"]["arguments"]
    assert got == '{"a": 1, "b": "x"}'
    # The tool-call block may also end the text (generation stopped at its end).
    assert parse_completion(text[:-len(EOS)]) == parse_completion(text)


def good_call_text():
    return completion_of({"role": "assistant", "content": "c",
                          "tool_calls": [call("f", '{"s": "v", "n": 1}')]}, False)


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.replace(f"</{DSML}invoke>", ""), r"malformed DSML tool call at offset \d+"),
    (lambda t: t.replace(f"</{DSML}tool_calls>", ""), "malformed DSML"),
    (lambda t: t.replace('string="true"', 'string="yes"'), r"string=\"true\" or \"false\""),
    (lambda t: t.replace(">1<", ">{1<"),
     r"parameter 'n' has string=\"false\" but its value is not JSON"),
    (lambda t: t.replace('name="n"', 'name="s"'), "repeats parameter 's'"),
    (lambda t: t.replace('name="f"', 'name=""'), "non-empty tool name"),
    (lambda t: t + "more", "text after"),
    (lambda t: t.replace(f"{EOS}", f"tail{EOS}"), "text after the tool calls"),
    (lambda t: t.replace(f"\n<{DSML}invoke", f"\nnoise<{DSML}invoke", 1), "malformed DSML"),
])
def test_malformed_dsml_raises(edit, match):
    parse_completion(good_call_text())                      # the unedited text parses
    with pytest.raises(ValueError, match=match):
        parse_completion(edit(good_call_text()))


def test_malformed_completions_raise():
    with pytest.raises(ValueError, match="without '</think>'"):
        parse_completion(f"no end of thinking{EOS}", thinking=True)
    with pytest.raises(ValueError, match="without '</think>'"):
        parse_completion(f"r\n\n<{DSML}tool_calls>\n</{DSML}tool_calls>{THINK_END}x{EOS}",
                         thinking=True)
    with pytest.raises(ValueError, match="does not end with"):
        parse_completion("cut off")
    with pytest.raises(ValueError, match=r"unexpected '<think>' in the content"):
        parse_completion(f"a{THINK_START}b{EOS}")
    with pytest.raises(ValueError, match="unexpected '｜DSML｜' in the content"):
        parse_completion(f"a<{DSML}tool_calls>{EOS}")
    with pytest.raises(TypeError, match="text must be a string"):
        parse_completion(b"x")


# ----------------------------------------------------------------------------- tokenizer
def test_every_format_token_is_one_id_and_prompts_round_trip(tmp_path):
    from dsv4_jax.tokenizer import HFTokenizer, load_tokenizer
    byte_level_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path, 1000)
    assert isinstance(tok, HFTokenizer) and tok.bos_id == 256 and tok.eos_id == 257
    ids = tok.chat_token_ids()
    assert list(ids) == list(FORMAT_TOKENS) and len(set(ids.values())) == len(FORMAT_TOKENS)
    assert all(i >= 256 for i in ids.values())               # added tokens, not byte pieces
    for path in CASES:
        prompt = load(path)["expected"]
        encoded = tok.encode(prompt)
        assert encoded.count(ids[BOS]) == 1 and encoded[0] == ids[BOS]
        for token, i in ids.items():
            assert encoded.count(i) == prompt.count(token), token
        assert tok.decode(encoded, skip_special_tokens=False) == prompt
        # The default decode drops only BOS / EOS: DSML, think and role tokens stay.
        assert tok.decode(encoded) == prompt.replace(BOS, "").replace(EOS, "")


def test_tokenizer_without_the_format_tokens_is_reported(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from dsv4_jax.tokenizer import HFTokenizer
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.add_special_tokens([BOS, EOS, USER, ASSISTANT])
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"lacks the DSV4 chat tokens \['<｜latest_reminder｜>'"):
        HFTokenizer(tmp_path).chat_token_ids()


def test_byte_tokenizer_turns_a_leading_bos_text_into_the_bos_id():
    from dsv4_jax.tokenizer import ByteTokenizer
    tok = ByteTokenizer(300)
    prompt = encode_chat([{"role": "user", "content": "hé"}])
    ids = tok.encode(prompt)
    assert ids[0] == tok.bos_id and tok.bos_id not in ids[1:]
    assert tok.decode(ids) == prompt[len(BOS):]
    assert tok.encode(prompt, add_bos=False) == ids
