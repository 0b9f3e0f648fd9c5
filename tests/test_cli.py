"""The command line as a new user meets it: --help without JAX, the persistent compilation
cache, arguments checked before the model loads (and the options they make), --chat (JSON
messages), streaming several rows, logprobs and speculative decoding while streaming, escaped
terminal output."""
import argparse
import io
import os
import subprocess
import sys

import numpy as np
import pytest

from dsv4_jax import cli_chat, cli_generate, compilation_cache
from dsv4_jax.__main__ import main
from dsv4_jax.decoding import StreamEvent
from dsv4_jax.generation_options import ChatOptions, GenerationOptions
from dsv4_jax.sampling import TopK

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "dsv4_jax", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_help_does_not_import_jax():
    code = ("import sys, runpy; sys.argv = ['dsv4_jax', '--help']\n"
            "try:\n    runpy.run_module('dsv4_jax', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print('JAX IMPORTED' if 'jax' in sys.modules else 'NO JAX')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert "generate" in out.stdout and "convert" in out.stdout
    assert out.stdout.strip().endswith("NO JAX"), out.stdout + out.stderr


def test_second_identical_run_compiles_nothing(tmp_path):
    env = {**os.environ, "DSV4_COMPILATION_CACHE": str(tmp_path / "cache")}
    args = ("generate", "--prompt", "The capital of France is", "--max-new-tokens", "4")
    first = run_cli(*args, env=env)           # the README's main command (shorter)
    assert first.returncode == 0, first.stderr
    assert "The capital of France is" in first.stdout and "tokens/s" in first.stdout
    assert "(cached)" not in first.stdout and os.listdir(tmp_path / "cache")
    second = run_cli(*args, env=env)
    assert second.returncode == 0, second.stderr
    assert "compile 0.0 s (cached)" in second.stdout, second.stdout
    # the same text both times
    assert first.stdout.splitlines()[0] == second.stdout.splitlines()[0]


def test_compilation_cache_setting(monkeypatch, tmp_path):
    monkeypatch.delenv(compilation_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation_cache.resolve() == str(tmp_path / "dsv4_jax" / "jax")
    monkeypatch.setenv(compilation_cache.ENV, "off")
    assert compilation_cache.resolve() is None
    assert compilation_cache.resolve(str(tmp_path / "x")) == str(tmp_path / "x")   # flag wins
    monkeypatch.setenv(compilation_cache.ENV, str(tmp_path / "y"))
    assert compilation_cache.resolve() == str(tmp_path / "y")
    assert compilation_cache.resolve("OFF") is None


@pytest.fixture
def no_model_load(monkeypatch):
    """Arguments must be rejected before the (slow) model load."""
    def refuse(path):
        raise AssertionError("the model was loaded before the arguments were checked")
    monkeypatch.setattr(cli_generate, "load_model", refuse)


@pytest.mark.parametrize("args, message", [
    (["--max-len", "-5"], "--max-len must be positive, got -5"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be positive, got 0"),
    (["--temperature", "-1"], "temperature"),
    (["--top-k", "5"], "--top-k needs --temperature > 0"),
])
def test_bad_arguments_are_rejected_before_the_model_loads(no_model_load, capsys, args,
                                                           message):
    assert main(["generate", "--prompt", "x", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_options_of_the_flags(no_model_load, capsys):
    """The flags become one GenerationOptions (and ChatOptions in chat mode); what it refuses
    is refused before the model loads."""
    parser = argparse.ArgumentParser()
    cli_generate.add_arguments(parser)
    cli_chat.add_arguments(parser)
    args = parser.parse_args(["--max-new-tokens", "5", "--temperature", "0.5", "--top-k", "3",
                              "--seed", "7", "--stop", "1", "--stop", "2", "--logprobs",
                              "--max-len", "64", "--speculative", "--thinking",
                              "--reasoning-effort", "max", "--prefill-chunk", "256"])
    assert cli_generate.build_options(args) == GenerationOptions(
        max_new_tokens=5, sampler=TopK(3, temperature=0.5), stop_tokens=(1, 2), seed=7,
        logprobs=True, max_len=64, speculative=True, prefill_chunk=256, prefill_progress=True)
    assert cli_chat.build_chat_options(args, None) == ChatOptions(thinking=True,
                                                                  reasoning_effort="max")
    assert main(["generate", "--prompt", "x", "--seed", str(2 ** 63)]) == 2
    assert capsys.readouterr().err == f"error: seed must be in [-2**63, 2**63), got {2 ** 63}\n"


def test_prompts_file_problems_name_the_file(no_model_load, capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert main(["generate", "--prompts-file", str(empty)]) == 2
    assert capsys.readouterr().err == (f"error: --prompts-file {str(empty)!r} holds no prompt "
                                       "(it is empty or blank)\n")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9\n".encode("latin-1"))
    assert main(["generate", "--prompts-file", str(latin1)]) == 2
    assert capsys.readouterr().err == (f"error: --prompts-file {str(latin1)!r} is not UTF-8 "
                                       "text (byte 0xe9 at offset 3)\n")
    missing = str(tmp_path / "missing.txt")
    assert main(["generate", "--prompts-file", missing]) == 2
    assert capsys.readouterr().err == f"error: --prompts-file {missing!r}: no such file\n"


def test_chat_prints_the_parsed_message_as_json(capsys, monkeypatch):
    """--chat runs the model on the chat template and prints what parses of each reply as a
    JSON line (here, random weights: a reply cut by the budget, reported on stderr instead)."""
    import json
    from dsv4_jax import generation
    from dsv4_jax.chat import encode_chat, parse_completion
    real_generate, seen = generation._generate, []

    def recording_generate(model, params, prompts, *args, **kw):
        seen.append(real_generate(model, params, prompts, *args, **kw))
        seen.append(prompts)
        return seen[0]

    monkeypatch.setattr(generation, "_generate", recording_generate)
    status = main(["generate", "--prompt", "Hi there", "--chat", "--max-new-tokens", "2"])
    result, prompts = seen
    assert prompts == [encode_chat([{"role": "user", "content": "Hi there"}])]
    captured = capsys.readouterr()
    text = result.text[0]
    try:
        want = parse_completion(text + ("<｜end▁of▁sentence｜>"
                                        if result.finish_reasons[0] == "stop" else ""))
    except ValueError as e:
        want = None
        assert status == 1 and captured.out == ""
        assert "error: conversation 0: " in captured.err and str(e) in captured.err
        assert f"raw completion: {text!r}" in captured.err
    if want is not None:
        assert status == 0 and [json.loads(line) for line in captured.out.splitlines()] == [want]


def event(step, tokens, text, done=None, logprobs=None):
    tokens = np.array(tokens)
    return StreamEvent(step, tokens, np.zeros(len(tokens), bool) if done is None else done,
                       None if logprobs is None else np.array(logprobs), text)


def test_stream_printer_escapes_control_bytes_of_one_row():
    out = io.StringIO()
    printer = cli_generate.StreamPrinter(["p"], stop={1}, out=out, tty=False)
    printer.add(event(0, [70], ["a\x07b"]))
    printer.add(event(1, [71], ["\x1b[2J\nc"]))
    printer.add(event(2, [1], [""], done=np.array([True])))
    assert printer.close(logprobs=False) == 2
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["a\\x07b\\x1b[2J", "c"]
    assert lines[2] == "[0] 'p' -> 'a\\x07b\\x1b[2J\\nc' (stop, 2 tokens)"


def test_stream_printer_redraws_one_line_per_row_on_a_terminal():
    out = io.StringIO()
    printer = cli_generate.StreamPrinter(["a", "b"], stop=set(), out=out, tty=True)
    printer.add(event(0, [5, 6], ["x", "y\n"]))
    printer.add(event(1, [7, -1], ["z", ""]))
    text = out.getvalue()
    assert text == ("\x1b[2K[0] x\n\x1b[2K[1] y\\n\n"
                    "\x1b[2F\x1b[2K[0] xz\n\x1b[2K[1] y\\n\n")


def test_streaming_several_prompts_with_logprobs(capsys):
    """Rows are printed as they come (a pipe gets one line per new piece), and the summary
    equals that of the same run without --stream, logprobs included. (The notebook's
    prompts and budget: the same compiled programs serve both.)"""
    args = ["generate", "--prompt", "The capital of France is", "--prompt", "Hello",
            "--max-new-tokens", "16", "--logprobs"]
    assert main(args) == 0
    plain = capsys.readouterr().out.splitlines()
    assert main(args + ["--stream"]) == 0
    out = capsys.readouterr().out.splitlines()
    pieces = [line for line in out if line.startswith(("[0] '", "[1] '")) and "->" not in line]
    summary = [line for line in out if "->" in line or "logprobs:" in line]
    assert summary == [line for line in plain if "->" in line or "logprobs:" in line]
    assert len(summary) == 4
    if pieces:
        assert out.index(pieces[-1]) < out.index(summary[0])   # printed before the end
    # the streamed pieces of each row add up to its final text
    for row in range(2):
        streamed = "".join(eval(p[4:]) for p in pieces if p.startswith(f"[{row}]"))
        line = summary[2 * row]
        assert line.split(" -> ")[1].rsplit(" (", 1)[0] == repr(streamed)
    assert all(ch >= " " for line in out for ch in line)


def test_streaming_speculative_from_the_command_line(capsys):
    """(That speculative streams equal speculative generate is tested in test_generate.)"""
    assert main(["generate", "--prompt", "ab", "--max-new-tokens", "3", "--stream",
                 "--speculative", "--logprobs"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("[0] 'ab' -> ")]
    assert out[-1].startswith(tuple(f"{n} tokens | " for n in range(4)))
