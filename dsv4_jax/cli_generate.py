"""``python -m dsv4_jax generate``: the main command.

Without ``--model`` it runs the embedded default -- ``Config.tiny()`` with parameters from a
fixed seed, byte-level tokenizer -- so it works anywhere with no download (its text is noise:
the weights are random). ``--model`` takes an official HF directory or an orbax directory.

Every argument is checked before the model loads; errors are one line on stderr, exit code 2.
This module imports no JAX at import time, so ``--help`` answers at once.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", action="append", default=[],
                   help="prompt text (repeat for a batch)")
    p.add_argument("--prompts-file", help="UTF-8 file with one prompt per line (batched)")
    p.add_argument("--prompt-file", action="append", default=[],
                   help="UTF-8 file that is one whole prompt, e.g. a long document "
                        "(repeatable: one row each)")
    p.add_argument("--model", help="HF safetensors or orbax checkpoint directory "
                                   "(default: the embedded tiny random model)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-len", type=int, default=None, help="cache capacity per row")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per prefill call (a multiple of the compression "
                        "ratios; default: sized for the device); a progress bar shows on "
                        "stderr while a longer prompt is prefilled")
    p.add_argument("--kv-dtype", choices=("fp8", "fp8+fp4"), default=None,
                   help="fp8: the compressed cache entries as 584-byte FP8 rows (the official "
                        "layout, 1.75x smaller; default: the model's dtype); fp8+fp4: also "
                        "the indexer's keys as 72-byte MXFP4 rows (3.6x smaller, a slower "
                        "indexer)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", type=int, action="append", default=None,
                   help="stop token id (repeatable; default: the config's EOS)")
    p.add_argument("--stream", action="store_true",
                   help="print tokens as they come (several prompts: one line per prompt)")
    p.add_argument("--speculative", action="store_true", help="MTP speculative decoding")
    p.add_argument("--chat", action="store_true",
                   help="each prompt is a user message (DSV4 chat encoding); prints each "
                        "parsed assistant message as a JSON line (see cli_chat.py)")
    p.add_argument("--logprobs", action="store_true", help="print per-token log-probabilities")
    p.add_argument("--compilation-cache", metavar="DIR|off", default=None,
                   help="persistent compilation cache folder, or 'off' (default: "
                        "$DSV4_COMPILATION_CACHE, else ~/.cache/dsv4_jax/jax)")


def build_sampler(args):
    from dsv4_jax import sampling
    t = args.temperature
    chosen = [n for n in ("top_k", "top_p", "min_p") if getattr(args, n) is not None]
    if len(chosen) > 1:
        raise ValueError(f"choose one of --top-k/--top-p/--min-p, got {chosen}")
    if t == 0 and chosen:
        raise ValueError(f"--{chosen[0].replace('_', '-')} needs --temperature > 0")
    if t == 0:
        return sampling.Greedy()
    if args.top_k is not None:
        return sampling.TopK(args.top_k, temperature=t)
    if args.top_p is not None:
        return sampling.TopP(args.top_p, temperature=t)
    if args.min_p is not None:
        return sampling.MinP(args.min_p, temperature=t)
    return sampling.Temperature(t)


def build_options(args):
    """The ``GenerationOptions`` of the flags (``build_sampler``'s sampler); ValueError /
    TypeError naming what is wrong."""
    from dsv4_jax.generation import GenerationOptions
    return GenerationOptions(max_new_tokens=args.max_new_tokens, sampler=build_sampler(args),
                             stop_tokens=args.stop, seed=args.seed, logprobs=args.logprobs,
                             max_len=args.max_len, speculative=args.speculative,
                             prefill_chunk=args.prefill_chunk, prefill_progress=True,
                             kv_dtype=args.kv_dtype)


def _read_text(flag: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ValueError(f"{flag} {path!r}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{flag} {path!r} is a directory") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path!r} is not UTF-8 text (byte "
                         f"0x{e.object[e.start]:02x} at offset {e.start})") from None


def read_prompts(args) -> list[str]:
    """``--prompt``s, the lines of ``--prompts-file``, then each ``--prompt-file`` whole;
    ValueError naming what is wrong."""
    prompts = list(args.prompt)
    if args.prompts_file:
        path = args.prompts_file
        lines = [line for line in _read_text("--prompts-file", path).split("\n")
                 if line.strip()]
        if not lines:
            raise ValueError(f"--prompts-file {path!r} holds no prompt (it is empty or blank)")
        prompts += lines
    for path in args.prompt_file:
        text = _read_text("--prompt-file", path)
        if not text.strip():
            raise ValueError(f"--prompt-file {path!r} is empty or blank")
        prompts.append(text)
    if not prompts:
        raise ValueError("give at least one --prompt, a --prompts-file or a --prompt-file")
    return prompts


def check_arguments(args) -> None:
    """What can be checked without the model (so a typo costs no load)."""
    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.max_len is not None and args.max_len <= 0:
        raise ValueError(f"--max-len must be positive, got {args.max_len}")
    if args.prefill_chunk is not None and args.prefill_chunk <= 0:
        raise ValueError(f"--prefill-chunk must be positive, got {args.prefill_chunk}")
    if args.model is not None and not os.path.isdir(args.model):
        raise ValueError(f"--model: no such directory {args.model!r}")


def load_model(path):
    import dsv4_jax as dj
    from dsv4_jax.tokenizer import ByteTokenizer, load_tokenizer
    if path is None:
        cfg = dj.Config.tiny()
        model = dj.DSV4(cfg, implementation=dj.KernelPolicy.from_environment())
        return model, dj.init_params(cfg, 0), ByteTokenizer(cfg.vocab_size)
    model, params = dj.load(path)                  # the environment's KernelPolicy
    return model, params, load_tokenizer(path, model.config.vocab_size)


def main(args) -> int:
    try:
        check_arguments(args)
        options = build_options(args)
        prompts = read_prompts(args)
        from dsv4_jax.compilation_cache import enable_compilation_cache
        enable_compilation_cache(args.compilation_cache)
        t0 = time.perf_counter()
        model, params, tokenizer = load_model(args.model)
        load_s = time.perf_counter() - t0
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import jax
    from dsv4_jax.generation import generate, stream
    print(f"model: {args.model or 'embedded tiny (random weights, seed 0)'} | device: "
          f"{jax.devices()[0].platform} | load {load_s:.1f}s", file=sys.stderr)
    try:
        if args.stream:
            stop = options.stop_tokens
            stop = set(stop if stop is not None else (model.config.eos_token_id,))
            return _run_stream(stream(model, params, prompts, tokenizer=tokenizer,
                                      options=options), prompts, stop, options.logprobs)
        result = generate(model, params, prompts, tokenizer=tokenizer, options=options)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i, p in enumerate(prompts):
        print(f"[{i}] {p!r} -> {result.text[i]!r} ({result.finish_reasons[i]}, "
              f"{len(result.tokens[i])} tokens)")
        if options.logprobs:
            print(f"    logprobs: {[round(x, 3) for x in result.logprobs[i]]}")
    s = result.stats
    extra = (f" | acceptance {s['acceptance_rate']:.2f}" if "acceptance_rate" in s else "")
    print(f"{s['generated_tokens']} tokens | {s['tokens_per_s']:.1f} tokens/s | "
          f"{compile_summary(s['compile_s'], s['compilations'], s['cache_hits'], s['trace_s'])}"
          f"{extra}")
    return 0


def compile_summary(compile_s, compilations, cache_hits, trace_s) -> str:
    """``compile 0.0 s (cached)`` when every program came from the persistent cache."""
    if compilations == 0 and cache_hits:
        what = "cached"
    elif cache_hits:
        what = f"{compilations} programs, {cache_hits} cached"
    else:
        what = f"{compilations} programs"
    return f"compile {compile_s:.1f} s ({what}) | trace {trace_s:.1f} s"


def printable(text: str, keep: str = "\n\t") -> str:
    """``text`` with every non-printable character (control bytes, ...) written as an escape,
    except those in ``keep``: generated text must not drive the terminal."""
    return "".join(c if c.isprintable() or c in keep else _escape(c) for c in text)


_NAMED_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escape(c: str) -> str:
    if c in _NAMED_ESCAPES:
        return _NAMED_ESCAPES[c]
    o = ord(c)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


class StreamPrinter:
    """Shows a stream as it comes. One prompt: its text, escaped, as it grows. Several
    prompts on a terminal: one line per prompt, redrawn in place; elsewhere (a pipe, a log):
    one ``[row] 'piece'`` line per new piece. Then per row the same summary ``generate``
    prints."""

    def __init__(self, prompts, stop, out=None, tty=None):
        self.prompts, self.stop = prompts, stop
        self.out = out or sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self.texts = [""] * len(prompts)
        self.tokens = [[] for _ in prompts]
        self.logprobs = [[] for _ in prompts]
        self.drawn = False

    def add(self, event) -> None:
        for r, t in enumerate(event.tokens.tolist()):
            if t >= 0:
                self.tokens[r].append(t)
                if event.logprobs is not None:
                    self.logprobs[r].append(float(event.logprobs[r]))
        pieces = event.text or [""] * len(self.prompts)
        for r, piece in enumerate(pieces):
            self.texts[r] += piece
        if len(self.prompts) == 1:
            self.out.write(printable(pieces[0]))
        elif self.tty:
            self._redraw()
        else:
            for r, piece in enumerate(pieces):
                if piece:
                    self.out.write(f"[{r}] {piece!r}\n")
        self.out.flush()

    def _redraw(self) -> None:
        width = max(20, shutil.get_terminal_size().columns - 1)
        if self.drawn:
            self.out.write(f"\x1b[{len(self.prompts)}F")        # back to the first row line
        for r, text in enumerate(self.texts):
            text = printable(text, keep="")
            if len(f"[{r}] {text}") > width:                     # show the newest text
                head = f"[{r}] ..."
                text = "..." + text[len(text) - (width - len(head)):]
            self.out.write(f"\x1b[2K[{r}] {text}\n")
        self.drawn = True

    def close(self, logprobs: bool) -> int:
        """Per-row summary lines; returns the number of tokens (stop tokens excluded)."""
        if len(self.prompts) == 1:
            self.out.write("\n")
        n = 0
        for r, (prompt, text) in enumerate(zip(self.prompts, self.texts)):
            ids = self.tokens[r]
            reason = "stop" if ids and ids[-1] in self.stop else "length"
            kept = ids[:-1] if reason == "stop" else ids
            n += len(kept)
            print(f"[{r}] {prompt!r} -> {text!r} ({reason}, {len(kept)} tokens)", file=self.out)
            if logprobs:
                print(f"    logprobs: {[round(x, 3) for x in self.logprobs[r][:len(kept)]]}",
                      file=self.out)
        return n


def _run_stream(events, prompts, stop, logprobs) -> int:
    from dsv4_jax._monitor import count_compilations
    printer = StreamPrinter(prompts, stop)
    t0 = time.perf_counter()
    with count_compilations() as compiled:
        for event in events:
            printer.add(event)
    elapsed = time.perf_counter() - t0
    n = printer.close(logprobs)
    run_s = max(elapsed - compiled.seconds, 1e-9)
    summary = compile_summary(compiled.compile_s, compiled.compilations, compiled.cache_hits,
                              compiled.trace_s)
    print(f"{n} tokens | {n / run_s:.1f} tokens/s | {summary}")
    return 0
