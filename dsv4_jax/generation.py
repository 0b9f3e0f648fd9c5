"""Text generation: batched prefill, a fully jitted ``lax.while_loop`` decode, streaming.

``generate`` runs prefill (prompts right-padded, each row with its own length, consumed in
fixed chunks: see decoding.py) and then the whole decode loop on the device; every row stops
at a stop token or the budget. ``stream`` yields tokens as they come from a Python loop over
one jitted step. Both drive the same programs (decoding.py), donate the cache, bucket shapes
(prompt chunks and budget) so new prompts of lengths in the same buckets reuse the compiled
programs, and draw the same random numbers (``fold_in(key, step)``), so they produce the
same tokens. ``speculative=True`` uses the MTP block (see speculative.py). ``chat=True`` takes
conversations and returns parsed assistant messages (see chat_decoding.py). The options of a
call are one ``GenerationOptions`` value (and a ``ChatOptions`` one in chat mode, see
generation_options.py), built once by ``generate``/``stream``; the functions below take it.
"""
from __future__ import annotations

import functools
import sys
import time
from typing import Iterator

import numpy as np
import jax
import jax.numpy as jnp
from tqdm import tqdm

from ._monitor import count_compilations
from .cache import Cache
from .chat_decoding import ChatResult, chat_batch
from .compilation_cache import enable_compilation_cache
from .decoding import (GenerationResult, Method, Programs, StreamEvent, build_programs,
                       chunk_num_new, ends_in_chunk, finish, prepare_prompts, run_prefill,
                       timed, token_logprob)
from .generation_options import (ChatOptions, GenerationOptions, call_chat_options,
                                 call_options)
from .sampling import Greedy, Sampler
from .speculative import speculative_method

__all__ = ["generate", "stream", "GenerationOptions", "ChatOptions", "GenerationResult",
           "ChatResult", "StreamEvent", "prepare_prompts"]


def plain_method(model, sampler: Sampler) -> Method:
    """One token per step: the model consumes the last token and samples the next."""
    quiet = model.clone(runtime_checks=False)        # inputs are validated on the host

    def prefill(params, tokens, lengths, offset, following, cache, key, carry):
        width = tokens.shape[1]
        logits, cache = quiet.apply({"params": params}, tokens, cache,
                                    num_new=chunk_num_new(lengths, offset, width),
                                    logits_at="last")
        first = sampler.sample(logits, jax.random.fold_in(key, 0))
        ends = ends_in_chunk(lengths, offset, width)
        kept_first, kept_lp = carry
        return (jnp.where(ends, first, kept_first),
                jnp.where(ends, token_logprob(logits, first), kept_lp)), cache

    def init_carry(batch):
        return jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.float32)

    def start(carry):
        first, first_lp = carry
        return first, first_lp, first

    def step(params, token, cache, key, live):
        logits, cache = quiet.apply({"params": params}, token[:, None], cache,
                                    num_new=jnp.where(live, 1, 0), logits_at="last")
        nxt = sampler.sample(logits, key)
        n_new = jnp.ones(nxt.shape, jnp.int32)
        return nxt[:, None], token_logprob(logits, nxt)[:, None], n_new, \
            lambda done: (jnp.where(live, nxt, 0), cache)

    return Method(prefill, init_carry, start, step)


@functools.lru_cache(maxsize=32)
def _programs(model, sampler: Sampler, speculative: bool) -> Programs:
    """Jitted programs of one (model, sampler, method); cached so a second call with the
    same shapes compiles nothing."""
    method = speculative_method(model, sampler) if speculative else plain_method(model, sampler)
    return build_programs(method)


def _start(model, prompts, options: GenerationOptions, tokenizer):
    """Checks shared by generate and stream; the programs and the prepared prompts."""
    if options.speculative and model.config.n_mtp_layers < 1:
        raise ValueError("speculative decoding needs an MTP block (config.n_mtp_layers >= 1)")
    programs = _programs(model, options.sampler, options.speculative)
    prep = prepare_prompts(model, prompts, options, tokenizer=tokenizer,
                           extra_len=programs.method.extra_len)
    enable_compilation_cache()
    return programs, prep


def _chat(model, prompts, tokenizer, options: GenerationOptions, chat: ChatOptions | None):
    """``(prompts, tokenizer, options, batch)`` to decode: in chat mode (``chat`` given) the
    encoded conversations, their tokenizer, the options with the end-of-sentence stop and the
    ``ChatBatch`` that reads the results; otherwise the arguments as they are and None."""
    if chat is None:
        return prompts, tokenizer, options, None
    batch = chat_batch(model, prompts, tokenizer, options, chat)
    return batch.prompts, batch.tokenizer, batch.options, batch


def generate(model, params, prompts, max_new_tokens: int | None = None,
             sampler: Sampler = Greedy(), *, tokenizer=None, stop_tokens=None, seed: int = 0,
             logprobs: bool = False, max_len: int | None = None, speculative: bool = False,
             chat: bool = False, tools: list | None = None, thinking: bool = False,
             drop_thinking: bool = True, reasoning_effort: str | None = None,
             prefill_chunk: int | None = None, prefill_progress: bool = False,
             kv_dtype: str | None = None,
             options: GenerationOptions | None = None,
             chat_options: ChatOptions | None = None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` per prompt (strings or token-id lists).

    Rows stop at any of ``stop_tokens`` (default: the config's EOS) or at the budget. With a
    ``tokenizer`` (or string prompts, which get the byte fallback) the result has text.
    ``speculative=True`` drafts with the MTP block and verifies two tokens per step; greedy
    output is then the same as without it. ``stats`` has timings and, for speculative
    decoding, the draft acceptance rate.

    ``chat=True`` (or ``tools``, ``thinking``): ``prompts`` are conversations (a list of
    message dicts, or a list of them) in the DSV4 chat format; ``tools`` (OpenAI function
    schemas), ``thinking``, ``drop_thinking`` and ``reasoning_effort`` are ``encode_chat``'s.
    Rows stop at end-of-sentence (``stop_tokens`` cannot be given) and the result, a
    ``ChatResult``, also has each parsed assistant message (``messages``, None where the
    completion does not parse) and why not (``errors``). ``tokenizer`` must then hold the
    chat tokens (the official ``tokenizer.json``), or be None for the byte fallback.

    Prompts are prefilled ``prefill_chunk`` tokens per row and call (default: 8192 tokens
    per call on a GPU shared by the rows, ``decoding.default_prefill_chunk``; a multiple of
    the compression ratios), so a prompt of any length up to ``max_len`` runs in the memory of
    one chunk; the tokens are those of a one-shot prefill. ``prefill_progress=True`` shows a
    progress bar for long prompts. ``kv_dtype="fp8"`` keeps the compressed cache entries as
    FP8 rows (``Cache.init``): 1.75x less cache for long contexts, the same values under the
    model's FP8 simulation (``Config.quant_simulation``, on by default); ``"fp8+fp4"`` also
    the indexer's keys as MXFP4 rows (smaller still, a slower indexer).

    ``options``, a ``GenerationOptions``, holds ``max_new_tokens``, ``sampler``,
    ``stop_tokens``, ``seed``, ``logprobs``, ``max_len``, ``speculative``, ``prefill_chunk``,
    ``prefill_progress`` and ``kv_dtype`` in one value;
    ``chat_options``, a ``ChatOptions`` (chat mode), holds ``tools``, ``thinking``,
    ``drop_thinking`` and ``reasoning_effort``. Such an argument set beside its value raises
    ValueError. Without ``options``, ``max_new_tokens`` is required.
    """
    options = call_options(options, max_new_tokens=max_new_tokens, sampler=sampler,
                           stop_tokens=stop_tokens, seed=seed, logprobs=logprobs,
                           max_len=max_len, speculative=speculative,
                           prefill_chunk=prefill_chunk, prefill_progress=prefill_progress,
                           kv_dtype=kv_dtype)
    chat_options = call_chat_options(chat_options, chat, tools=tools, thinking=thinking,
                                     drop_thinking=drop_thinking,
                                     reasoning_effort=reasoning_effort)
    prompts, tokenizer, options, batch = _chat(model, prompts, tokenizer, options, chat_options)
    result = _generate(model, params, prompts, options, tokenizer=tokenizer)
    return result if batch is None else batch.finish(result)


def _generate(model, params, prompts, options: GenerationOptions, *,
              tokenizer) -> GenerationResult:
    programs, prep = _start(model, prompts, options, tokenizer)
    key = jax.random.key(options.seed)
    stop = jnp.asarray(prep.stop_tokens)
    started = time.perf_counter()
    with count_compilations() as compiled:
        cache = Cache.init(model.config, len(prep.lengths), prep.max_len,
                           kv_dtype=options.kv_dtype, mesh=getattr(model, "mesh", None))
        (first, first_lp, state, _, _, cache), t_prefill = timed(
            _prefill, programs, params, prep, cache, key, stop, options)
        (out, lps, state, cache), t_decode = timed(
            programs.loop, params, first, first_lp, state, cache, key, stop,
            jnp.int32(prep.budget), steps=prep.steps)
    rows = np.asarray(out)
    n_tokens = int(np.sum(rows[:prep.rows] >= 0))
    run_s = time.perf_counter() - started - compiled.seconds
    stats = dict(prefill_s=t_prefill, decode_s=t_decode, compile_s=compiled.compile_s,
                 trace_s=compiled.trace_s, compilations=compiled.compilations,
                 cache_hits=compiled.cache_hits, generated_tokens=n_tokens,
                 tokens_per_s=n_tokens / max(run_s, 1e-9), **programs.method.summary(state))
    return finish(prep, rows, np.asarray(lps), options.logprobs, stats)


def stream(model, params, prompts, max_new_tokens: int | None = None,
           sampler: Sampler = Greedy(), *, tokenizer=None, stop_tokens=None, seed: int = 0,
           logprobs: bool = False, max_len: int | None = None, speculative: bool = False,
           chat: bool = False, tools: list | None = None, thinking: bool = False,
           drop_thinking: bool = True, reasoning_effort: str | None = None,
           prefill_chunk: int | None = None, prefill_progress: bool = False,
           kv_dtype: str | None = None,
           options: GenerationOptions | None = None,
           chat_options: ChatOptions | None = None) -> Iterator[StreamEvent]:
    """Like ``generate`` (the same arguments) but yields a ``StreamEvent`` per new token
    position, for every row at once, as soon as the step that made it has run. With
    ``speculative=True`` a step yields one event per token it kept (the accepted draft and
    the token after it).

    Concatenating each row's tokens >= 0 gives ``generate``'s tokens (with its stop token);
    ``text`` pieces are decoded from the whole row so far, holding back an incomplete
    UTF-8 sequence until it completes. In chat mode (see ``generate``) the last event also
    carries the parsed ``messages`` and ``errors``; bad options and bad conversations raise
    at the call, before any generation."""
    options = call_options(options, max_new_tokens=max_new_tokens, sampler=sampler,
                           stop_tokens=stop_tokens, seed=seed, logprobs=logprobs,
                           max_len=max_len, speculative=speculative,
                           prefill_chunk=prefill_chunk, prefill_progress=prefill_progress,
                           kv_dtype=kv_dtype)
    chat_options = call_chat_options(chat_options, chat, tools=tools, thinking=thinking,
                                     drop_thinking=drop_thinking,
                                     reasoning_effort=reasoning_effort)
    prompts, tokenizer, options, batch = _chat(model, prompts, tokenizer, options, chat_options)
    events = _stream(model, params, prompts, options, tokenizer=tokenizer)
    return events if batch is None else batch.stream(events)


def _stream(model, params, prompts, options: GenerationOptions, *,
            tokenizer) -> Iterator[StreamEvent]:
    programs, prep = _start(model, prompts, options, tokenizer)
    key = jax.random.key(options.seed)
    stop = jnp.asarray(prep.stop_tokens)
    budget = jnp.int32(prep.budget)
    text = _IncrementalText(prep.tokenizer, prep.rows, set(prep.stop_tokens.tolist()))
    cache = Cache.init(model.config, len(prep.lengths), prep.max_len,
                       kv_dtype=options.kv_dtype, mesh=getattr(model, "mesh", None))
    first, first_lp, state, count, done, cache = _prefill(programs, params, prep, cache, key,
                                                          stop, options)
    real = prep.rows                      # rows past it pad a mesh's batch: not shown
    tokens, lps = np.asarray(first)[:real, None], np.asarray(first_lp)[:real, None]
    now_done = done
    position, i = 0, 1
    while True:
        now_done = np.asarray(now_done)[:real]
        for k in range(tokens.shape[1]):
            if k and not (tokens[:, k] >= 0).any():
                break
            later = (tokens[:, k + 1:] >= 0).any(axis=1)
            yield StreamEvent(position, tokens[:, k], now_done & ~later,
                              lps[:, k] if options.logprobs else None,
                              text.add(tokens[:, k], now_done & ~later))
            position += 1
        if now_done.all():
            return
        state, count, done, cache, step_tokens, step_lps = programs.step(
            params, state, count, done, cache, key, jnp.int32(i), stop, budget)
        tokens, lps = np.asarray(step_tokens)[:real], np.asarray(step_lps)[:real]
        now_done = done
        i += 1


def _prefill(programs: Programs, params, prep, cache, key, stop, options: GenerationOptions):
    """``run_prefill`` over the prepared chunks, with a progress bar on stderr when asked
    and the prompts take more than one chunk."""
    bar = None
    if options.prefill_progress and len(prep.chunks) > 1:
        bar = tqdm(total=int(prep.lengths.max()), unit="tok", desc="prefill", file=sys.stderr)

    def progress(done, total):
        bar.update(done - bar.n)

    try:
        return run_prefill(programs, params, prep.tokens, prep.lengths, cache, key, stop,
                           jnp.int32(prep.budget), prep.chunks,
                           progress if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()


class _IncrementalText:
    """Per-row text pieces of a stream: decode the row so far, emit what is new; hold back a
    trailing U+FFFD (a multi-byte character cut in the middle) until the row ends."""

    def __init__(self, tokenizer, rows: int, stop: set):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids = [[] for _ in range(rows)]
        self.shown = [""] * rows

    def add(self, tokens, done) -> list | None:
        if self.tokenizer is None:
            return None
        pieces = []
        for r, t in enumerate(tokens.tolist()):
            if t >= 0 and t not in self.stop:
                self.ids[r].append(t)
            full = self.tokenizer.decode(self.ids[r]) if self.ids[r] else ""
            if not done[r]:
                full = full.rstrip("\ufffd")
            piece = full[len(self.shown[r]):] if full.startswith(self.shown[r]) else ""
            self.shown[r] += piece
            pieces.append(piece)
        return pieces
