"""``python -m dsv4_jax generate`` in chat mode (``--chat``, ``--messages``, ``--tools``,
``--thinking``): conversations in, each parsed assistant message printed as one JSON line.

``--messages FILE.json`` holds one conversation (a list of messages), ``{"messages": [...],
"tools": [...]}``, or a list of conversations; otherwise each ``--prompt`` (and line of
``--prompts-file``) is a one-message conversation. ``--tools FILE.json`` holds OpenAI function
schemas (a list, or ``{"tools": [...]}``). Only the JSON goes to stdout (streamed text and
timings go to stderr), so the output pipes into ``jq``; a completion that does not parse is
reported on stderr with its raw text, and the exit status is then 1.

Like cli_generate, this module imports no JAX at import time (``--help`` answers at once).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from . import cli_generate


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--messages", metavar="FILE.json",
                   help="a conversation to continue (implies --chat); prints the parsed "
                        "assistant message as JSON")
    p.add_argument("--tools", metavar="FILE.json",
                   help="OpenAI function schemas offered to the model (implies --chat)")
    p.add_argument("--thinking", action="store_true", help="DSV4 thinking mode (implies --chat)")
    p.add_argument("--reasoning-effort", choices=["high", "max"], default=None,
                   help="with --thinking: 'max' adds the official max-effort instruction")


def wants_chat(args) -> bool:
    return bool(args.chat or args.messages or args.tools or args.thinking
                or args.reasoning_effort)


def _read_json(path: str, flag: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{flag}: no such file {path!r}") from None
    except IsADirectoryError:
        raise ValueError(f"{flag}: {path!r} is a directory") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag}: {path!r} is not valid JSON: {e}") from None


def read_inputs(args) -> tuple[list, list | None]:
    """Conversations and tools from the flags; ValueError for anything inconsistent."""
    if args.reasoning_effort and not args.thinking:
        raise ValueError("--reasoning-effort needs --thinking")
    if args.logprobs or args.stop:
        raise ValueError("--logprobs and --stop are not available in chat mode "
                         "(a chat turn ends at end-of-sentence)")
    tools = None
    if args.tools:
        tools = _read_json(args.tools, "--tools")
        if isinstance(tools, dict):
            tools = tools.get("tools")
        if not isinstance(tools, list):
            raise ValueError("--tools: expected a list of function schemas or {\"tools\": [...]}")
    if not args.messages:
        prompts = cli_generate.read_prompts(args)
        return [[{"role": "user", "content": p}] for p in prompts], tools
    if args.prompt or args.prompts_file or args.prompt_file:
        raise ValueError("give --messages or --prompt/--prompts-file/--prompt-file, not both")
    data = _read_json(args.messages, "--messages")
    if isinstance(data, dict):
        if data.get("tools") is not None:
            if tools is not None:
                raise ValueError(f"tools given both in {args.messages!r} and by --tools")
            tools = data["tools"]
        data = data.get("messages")
    if not isinstance(data, list) or not data:
        raise ValueError("--messages: expected a list of messages, {\"messages\": [...]}, "
                         "or a list of conversations")
    return (data if isinstance(data[0], list) else [data]), tools


def build_chat_options(args, tools):
    """The ``ChatOptions`` of the flags and the ``tools`` read from ``--tools``/``--messages``."""
    from dsv4_jax.generation import ChatOptions
    return ChatOptions(tools=tools, thinking=args.thinking,
                       reasoning_effort=args.reasoning_effort)


def main(args) -> int:
    try:
        cli_generate.check_arguments(args)
        options = cli_generate.build_options(args)
        conversations, tools = read_inputs(args)
        chat_options = build_chat_options(args, tools)
        from dsv4_jax.compilation_cache import enable_compilation_cache
        enable_compilation_cache(args.compilation_cache)
        t0 = time.perf_counter()
        model, params, tokenizer = cli_generate.load_model(args.model)
        load_s = time.perf_counter() - t0
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from dsv4_jax.generation import generate, stream
    kw = dict(tokenizer=tokenizer, options=options, chat_options=chat_options)
    print(f"model: {args.model or 'embedded tiny (random weights, seed 0)'} | "
          f"load {load_s:.1f}s | {len(conversations)} conversation(s)", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        if args.stream:
            messages, errors, texts, n = _run_stream(
                stream(model, params, conversations, **kw),
                len(conversations), getattr(tokenizer, "eos_id", None))
        else:
            result = generate(model, params, conversations, **kw)
            messages, errors, texts = result.messages, result.errors, result.text
            n = sum(len(t) for t in result.tokens)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - t0
    status = 0
    for k, (message, error) in enumerate(zip(messages, errors)):
        if message is None:
            status = 1
            print(f"error: conversation {k}: {error}\n  raw completion: {texts[k]!r}",
                  file=sys.stderr)
        else:
            print(json.dumps(message, ensure_ascii=False))
    print(f"{n} tokens in {elapsed:.1f}s (compilation included)", file=sys.stderr)
    return status


def _run_stream(events, rows: int, eos_id: int):
    """Show one conversation's text on stderr as it comes; (messages, errors, texts, number of
    tokens without the end-of-sentence ones)."""
    texts, n, last = [""] * rows, 0, None
    for last in events:
        for r, piece in enumerate(last.text or [""] * rows):
            texts[r] += piece
        n += sum(t >= 0 and t != eos_id for t in last.tokens.tolist())
        if rows == 1 and last.text:
            print(cli_generate.printable(last.text[0]), end="", flush=True, file=sys.stderr)
    print(file=sys.stderr)
    return last.messages, last.errors, texts, n
