"""The DeepSeek-V4 chat format: ``messages`` -> prompt text, and completion text -> a message.

Written from DeepSeek's published description of the format: ``encoding/README.md`` and
``encoding/encoding_dsv4.py`` beside ``inference/`` in the DeepSeek-V4-Flash / -Pro
repositories, and checked against the four example conversations published with them
(``tests/data/chat/``). The rules, in the order the official encoder applies them:

1. ``tool`` messages become ``<tool_result>...</tool_result>`` blocks of a user turn; every run of
   consecutive user / tool messages is one ``<｜User｜>`` turn, its blocks joined by a blank line,
   and the results of one assistant turn's calls are put in the order of those calls (by id).
2. ``drop_thinking`` (on by default; off whenever any message carries ``tools``): in thinking
   mode, assistant turns before the last user turn lose their reasoning and developer messages
   before it are dropped.
3. Each message renders as: system ``content [+ tools block] [+ response format]``; developer
   ``<｜User｜>content [+ tools block]``; user ``<｜User｜>blocks``; latest_reminder
   ``<｜latest_reminder｜>content``; assistant ``[reasoning</think>]content[tool calls]<EOS>``.
4. A user/developer message that is last or followed by an assistant / latest_reminder message
   opens the next assistant turn: ``<｜Assistant｜>`` + ``<think>`` (thinking mode, the last user
   turn or drop_thinking off) or ``</think>``. A ``task`` replaces that opening with its
   quick-instruction token.

Everything here is plain Python (no JAX) so the tokenizer and servers can use it.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence

__all__ = ["encode_chat", "parse_completion", "BOS", "EOS", "USER", "ASSISTANT",
           "LATEST_REMINDER", "THINK_START", "THINK_END", "DSML", "TASK_TOKENS",
           "FORMAT_TOKENS", "ROLES"]

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"                   # one token; the DSML tags are "<" + DSML + "name>"
# Quick-instruction tasks (``"task"`` on a message) and their tokens.
TASK_TOKENS = {"action": "<｜action｜>", "query": "<｜query｜>", "authority": "<｜authority｜>",
               "domain": "<｜domain｜>", "title": "<｜title｜>", "read_url": "<｜read_url｜>"}
# Every token the format writes; each must be a single id in the tokenizer.
FORMAT_TOKENS = (BOS, EOS, USER, ASSISTANT, LATEST_REMINDER, THINK_START, THINK_END, DSML,
                 *TASK_TOKENS.values())
ROLES = ("system", "user", "assistant", "tool", "latest_reminder", "developer")
REASONING_EFFORTS = (None, "high", "max")

CALLS_OPEN, CALLS_CLOSE = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
INVOKE_OPEN, INVOKE_CLOSE = f"<{DSML}invoke", f"</{DSML}invoke>"
PARAM_OPEN, PARAM_CLOSE = f"<{DSML}parameter", f"</{DSML}parameter>"
# The tool-call block always follows the content after a blank line, which belongs to the syntax.
CALLS_START = "\n\n" + CALLS_OPEN

# Prompt text of the official format (must match byte for byte).
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n")

TOOLS_HEADER = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by \
writing a "{CALLS_OPEN}" block like the following:

{CALLS_OPEN}
{INVOKE_OPEN} name="$TOOL_NAME">
{PARAM_OPEN} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAM_CLOSE}
...
{INVOKE_CLOSE}
{INVOKE_OPEN} name="$TOOL_NAME2">
...
{INVOKE_CLOSE}
{CALLS_CLOSE}

String parameters should be specified as is and set `string="true"`. For all other types \
(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete \
reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

"""
TOOLS_FOOTER = ("\n\nYou MUST strictly follow the above defined tool name and parameter schemas "
                "to invoke tool calls.\n")
RESPONSE_FORMAT_HEADER = ("## Response Format:\n\nYou MUST strictly adhere to the following "
                          "schema to reply:\n")


def _json(value) -> str:
    # The official encoder's serialisation: Python's default separators, non-ASCII kept as is.
    return json.dumps(value, ensure_ascii=False)


@dataclasses.dataclass
class _Turn:
    """One rendered unit: a message, or a user turn merged from user and tool messages."""
    role: str
    index: int                          # index of the message it came from (error messages)
    content: str = ""
    blocks: list | None = None          # user turns: [("text" | "tool_result", text, call_id)]
    tools: list | None = None           # function schemas (system / developer)
    response_format: object = None
    reasoning: str | None = None
    calls: list | None = None           # assistant: [(name, {param: value})]
    call_ids: list | None = None
    task: str | None = None
    wo_eos: bool = False


def _fail(i: int, why: str):
    raise ValueError(f"encode_chat: message {i}: {why}")


def _text(i: int, m: Mapping, key: str) -> str:
    value = m.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"encode_chat: message {i}: {key!r} must be a string, "
                        f"got {type(value).__name__}")
    return value


def _tool_result_text(i: int, content) -> str:
    """A tool result's text; content may be a list of parts (text parts joined by a blank line)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if not isinstance(part, Mapping):
                _fail(i, f"tool content parts must be dicts, got {type(part).__name__}")
            kind = part.get("type")
            parts.append(part.get("text", "") if kind == "text" else f"[Unsupported {kind}]")
        return "\n\n".join(parts)
    raise TypeError(f"encode_chat: message {i}: tool 'content' must be a string or a list of "
                    f"parts, got {type(content).__name__}")


def _tool_schemas(i: int, tools) -> list:
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        _fail(i, f"'tools' must be a list of OpenAI function schemas, got {type(tools).__name__}")
    schemas = []
    for k, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            _fail(i, f"tools[{k}] is not a function schema "
                     f'({{"type": "function", "function": {{"name": ..., ...}}}})')
        schemas.append(fn)
    return schemas


def _tool_calls(i: int, calls) -> tuple[list, list]:
    """[(name, arguments dict)] and ids from OpenAI-format ``tool_calls``."""
    if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
        _fail(i, f"'tool_calls' must be a list, got {type(calls).__name__}")
    parsed, ids = [], []
    for k, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            _fail(i, f'tool_calls[{k}] has no function name ({{"type": "function", '
                     f'"function": {{"name": ..., "arguments": "{{...}}"}}}})')
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                _fail(i, f"tool_calls[{k}] ({fn['name']}): arguments are not valid JSON: {e}")
        if not isinstance(args, Mapping):
            _fail(i, f"tool_calls[{k}] ({fn['name']}): arguments must be a JSON object, "
                     f"got {type(args).__name__}")
        parsed.append((fn["name"], dict(args)))
        ids.append(call.get("id") or fn.get("id") or "")
    return parsed, ids


def _read_messages(messages, tools) -> list[_Turn]:
    """Validate ``messages`` and turn each into a ``_Turn`` (tool messages still separate)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"encode_chat: messages must be a list of dicts, "
                        f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("encode_chat: messages is empty")
    turns, last_assistant = [], None
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"encode_chat: message {i} must be a dict, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            _fail(i, f"unknown role {role!r} (expected one of {', '.join(ROLES)})")
        if m.get("tools") and role not in ("system", "developer"):
            _fail(i, f"'tools' belong on a system or developer message, not on a {role} message")
        if m.get("tool_calls") and role != "assistant":
            _fail(i, f"'tool_calls' are only allowed on assistant messages, not on {role}")
        task = m.get("task")
        if task is not None and task not in TASK_TOKENS:
            _fail(i, f"unknown task {task!r} (expected one of {', '.join(TASK_TOKENS)})")
        turn = _Turn(role, i, task=task, wo_eos=bool(m.get("wo_eos", False)))
        if role == "tool":
            if last_assistant is None or not last_assistant.calls:
                _fail(i, "a tool message must follow an assistant message with tool_calls")
            turn.content = _tool_result_text(i, m.get("content"))
            call_id = m.get("tool_call_id") or ""
            turn.blocks = [("tool_result", turn.content, call_id)]
        else:
            turn.content = _text(i, m, "content")
        if role == "developer" and not turn.content:
            _fail(i, "a developer message needs non-empty content")
        if role in ("system", "developer"):
            turn.tools = _tool_schemas(i, m["tools"]) if m.get("tools") else None
            turn.response_format = m.get("response_format")
        if role == "assistant":
            turn.reasoning = _text(i, m, "reasoning_content")
            if m.get("tool_calls"):
                turn.calls, turn.call_ids = _tool_calls(i, m["tool_calls"])
            last_assistant = turn
        turns.append(turn)
    if tools is not None:
        schemas = _tool_schemas(0, tools)
        if turns[0].role == "system":
            if turns[0].tools:
                raise ValueError("encode_chat: tools given both as tools= and on message 0")
            turns[0].tools = schemas
        else:       # no system message: the tools block goes in an empty one in front
            turns.insert(0, _Turn("system", 0, tools=schemas))
    return turns


def _merge_user_turns(turns: list[_Turn]) -> list[_Turn]:
    """Tool results and user text of consecutive messages -> one user turn (rule 1)."""
    merged: list[_Turn] = []
    for t in turns:
        prev = merged[-1] if merged else None
        joinable = prev is not None and prev.role == "user"
        if t.role == "tool":
            if joinable:
                prev.blocks.append(t.blocks[0])
            else:
                merged.append(_Turn("user", t.index, blocks=list(t.blocks)))
        elif t.role == "user":
            if joinable and prev.task is None:
                prev.blocks.append(("text", t.content, ""))
            else:
                t.blocks = [("text", t.content, "")]
                merged.append(t)
        else:
            merged.append(t)
    order: dict = {}           # call id -> position in the latest assistant turn with calls
    for t in merged:
        if t.role == "assistant" and t.calls:
            order = {cid: k for k, cid in enumerate(t.call_ids) if cid}
        elif t.role == "user" and order:
            results = [b for b in t.blocks if b[0] == "tool_result"]
            if len(results) > 1:
                ranked = iter(sorted(results, key=lambda b: order.get(b[2], 0)))
                t.blocks = [next(ranked) if b[0] == "tool_result" else b for b in t.blocks]
    return merged


def _last_user(turns: list[_Turn]) -> int:
    return max((k for k, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)


def _drop_old_reasoning(turns: list[_Turn]) -> list[_Turn]:
    """Rule 2: before the last user turn, assistants lose reasoning; developers are dropped."""
    last = _last_user(turns)
    kept = []
    for k, t in enumerate(turns):
        if k < last and t.role == "assistant":
            t = dataclasses.replace(t, reasoning=None)
        elif k < last and t.role == "developer":
            continue
        kept.append(t)
    return kept


def _render_calls(calls: list) -> str:
    invokes = []
    for name, args in calls:
        params = [f'{PARAM_OPEN} name="{key}" string="true">{value}{PARAM_CLOSE}'
                  if isinstance(value, str) else
                  f'{PARAM_OPEN} name="{key}" string="false">{_json(value)}{PARAM_CLOSE}'
                  for key, value in args.items()]
        invokes.append(f'{INVOKE_OPEN} name="{name}">\n' + "\n".join(params) + f"\n{INVOKE_CLOSE}")
    return f"{CALLS_START}\n" + "\n".join(invokes) + f"\n{CALLS_CLOSE}"


def _render_extras(t: _Turn) -> str:
    out = ""
    if t.tools:
        out += "\n\n" + TOOLS_HEADER + "\n".join(_json(s) for s in t.tools) + TOOLS_FOOTER
    if t.response_format:
        out += "\n\n" + RESPONSE_FORMAT_HEADER + _json(t.response_format)
    return out


def _render(k: int, turns: list[_Turn], thinking: bool, keep_reasoning: bool, last_user: int,
            effort: str | None) -> str:
    t = turns[k]
    out = REASONING_EFFORT_MAX if k == 0 and thinking and effort == "max" else ""
    if t.role == "system":
        out += t.content + _render_extras(t)
    elif t.role == "developer":
        out += USER + t.content + _render_extras(t)
    elif t.role == "user":
        out += USER + "\n\n".join(text if kind == "text" else f"<tool_result>{text}</tool_result>"
                                  for kind, text, _ in t.blocks)
    elif t.role == "latest_reminder":
        out += LATEST_REMINDER + t.content
    else:                                                   # assistant
        after_task = k > 0 and turns[k - 1].task is not None     # a task's answer: no thinking
        if thinking and not after_task and (keep_reasoning or k > last_user):
            out += (t.reasoning or "") + THINK_END
        out += t.content + (_render_calls(t.calls) if t.calls else "")
        out += "" if t.wo_eos else EOS
    nxt = turns[k + 1].role if k + 1 < len(turns) else None
    if nxt not in (None, "assistant", "latest_reminder"):
        return out
    if t.task == "action":
        out += ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS["action"]
    elif t.task is not None:
        out += TASK_TOKENS[t.task]
    elif t.role in ("user", "developer"):
        opens_thinking = thinking and (keep_reasoning or k >= last_user)
        out += ASSISTANT + (THINK_START if opens_thinking else THINK_END)
    return out


def encode_chat(messages: list[dict], *, thinking: bool = False, tools: list | None = None,
                drop_thinking: bool = True, reasoning_effort: str | None = None,
                add_bos: bool = True) -> str:
    """DeepSeek-V4 prompt text for OpenAI-style ``messages``, exactly as the official encoder.

    Roles: system, user, assistant (``content``, ``reasoning_content``, ``tool_calls``), tool
    (``content``, ``tool_call_id``), latest_reminder, developer. ``tools`` (OpenAI function
    schemas) go on a system or developer message, or here: then on the first system message
    (an empty one is put in front if there is none). ``thinking`` selects thinking mode;
    ``drop_thinking`` drops the reasoning of turns before the last user turn (ignored when any
    tools are present); ``reasoning_effort="max"`` prefixes the official max-effort instruction
    in thinking mode ("high" and None add nothing). Messages may carry ``task`` (a
    quick-instruction name in ``TASK_TOKENS``), ``response_format`` (system / developer) and
    ``wo_eos`` (an assistant turn left open). Bad input raises ValueError / TypeError naming
    the message index.
    """
    if not isinstance(thinking, bool):
        raise TypeError(f"encode_chat: thinking must be a bool, got {thinking!r}")
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"encode_chat: reasoning_effort must be one of {REASONING_EFFORTS}, "
                         f"got {reasoning_effort!r}")
    turns = _merge_user_turns(_read_messages(messages, tools))
    keep_reasoning = not drop_thinking or any(t.tools for t in turns)
    if thinking and not keep_reasoning:
        turns = _drop_old_reasoning(turns)
    last_user = _last_user(turns)
    return (BOS if add_bos else "") + "".join(
        _render(k, turns, thinking, keep_reasoning, last_user, reasoning_effort)
        for k in range(len(turns)))


# ----------------------------------------------------------------------------- parsing
def _malformed(text: str, at: int, expected: str):
    raise ValueError(f"parse_completion: malformed DSML tool call at offset {at}: expected "
                     f"{expected}, found {text[at:at + 40]!r}")


def _expect(text: str, at: int, literal: str) -> int:
    if not text.startswith(literal, at):
        _malformed(text, at, repr(literal))
    return at + len(literal)


def _until(text: str, at: int, literal: str, what: str) -> tuple[str, int]:
    """Text from ``at`` up to ``literal`` and the offset after it."""
    end = text.find(literal, at)
    if end < 0:
        _malformed(text, at, f"{what} ending in {literal!r}")
    return text[at:end], end + len(literal)


def _parse_invoke(text: str, at: int) -> tuple[dict, int]:
    at = _expect(text, at, INVOKE_OPEN)
    while at < len(text) and text[at].isspace():       # the official parser allows any spacing
        at += 1
    at = _expect(text, at, 'name="')
    name, at = _until(text, at, '">\n', "a tool name")
    if not name:
        _malformed(text, at, "a non-empty tool name")
    if text.startswith("\n", at):                       # blank line: a call without parameters
        at += 1
    fields = []
    seen = set()
    while not text.startswith(INVOKE_CLOSE, at):
        at = _expect(text, at, PARAM_OPEN + ' name="')
        key, at = _until(text, at, '" string="', "a parameter name")
        flag, at = _until(text, at, '">', 'string="true" or "false"')
        if flag not in ("true", "false"):
            _malformed(text, at, f'string="true" or "false" for parameter {key!r}, not {flag!r}')
        value, at = _until(text, at, PARAM_CLOSE, f"the value of parameter {key!r}")
        at = _expect(text, at, "\n")
        if key in seen:
            raise ValueError(f"parse_completion: tool call {name!r} repeats parameter {key!r}")
        seen.add(key)
        if flag == "false":
            try:
                json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"parse_completion: tool call {name!r}: parameter {key!r} has "
                                 f'string="false" but its value is not JSON ({e}): '
                                 f"{value[:60]!r}") from None
        fields.append(f"{_json(key)}: {_json(value) if flag == 'true' else value}")
    at = _expect(text, at + len(INVOKE_CLOSE), "\n")
    # Same text as the official decoder: string values JSON-quoted, the others as written.
    return {"type": "function",
            "function": {"name": name, "arguments": "{" + ", ".join(fields) + "}"}}, at


def _parse_calls(text: str, at: int) -> tuple[list, int]:
    at = _expect(text, at, CALLS_OPEN + "\n")
    calls = []
    while not text.startswith(CALLS_CLOSE, at):
        call, at = _parse_invoke(text, at)
        calls.append(call)
    return calls, at + len(CALLS_CLOSE)


def parse_completion(text: str, *, thinking: bool = False) -> dict:
    """The assistant message in a completion (the text generated after the prompt).

    Returns ``{"role": "assistant", "reasoning_content", "content", "tool_calls": [{"type":
    "function", "function": {"name", "arguments"}}]}`` (arguments a JSON string). In thinking
    mode the text starts with the reasoning, closed by ``</think>``. Content ends at the
    end-of-sentence token, or at the DSML tool-call block, which may end the text or be
    followed by end-of-sentence. Anything else -- a missing ``</think>`` or end-of-sentence,
    malformed DSML, a non-JSON ``string="false"`` value, special tokens inside the text --
    raises ValueError.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_completion: text must be a string, got {type(text).__name__}")
    at, reasoning = 0, ""
    if thinking:
        end = text.find(THINK_END)
        calls_at = text.find(CALLS_START)
        if end < 0 or 0 <= calls_at < end:
            raise ValueError(f"parse_completion: thinking-mode completion without {THINK_END!r} "
                             f"closing the reasoning: {text[:60]!r}")
        reasoning, at = text[:end], end + len(THINK_END)
    eos_at, calls_at = text.find(EOS, at), text.find(CALLS_START, at)
    calls = []
    if calls_at >= 0 and (eos_at < 0 or calls_at < eos_at):
        content = text[at:calls_at]
        calls, at = _parse_calls(text, calls_at + 2)
        if text.startswith(EOS, at):
            at += len(EOS)
        if at != len(text):
            raise ValueError(f"parse_completion: text after the tool calls: {text[at:at + 40]!r}")
    else:
        if eos_at < 0:
            raise ValueError(f"parse_completion: the completion does not end with {EOS!r}: "
                             f"{text[-60:]!r}")
        content, at = text[at:eos_at], eos_at + len(EOS)
        if at != len(text):
            raise ValueError(f"parse_completion: text after {EOS!r}: {text[at:at + 40]!r}")
    for where, part in (("reasoning", reasoning), ("content", content)):
        for token in (BOS, EOS, THINK_START, THINK_END, DSML):
            if token in part:
                raise ValueError(f"parse_completion: unexpected {token!r} in the {where} at "
                                 f"offset {part.index(token)}")
    return {"role": "assistant", "reasoning_content": reasoning, "content": content,
            "tool_calls": calls}
