"""The decode driver shared by plain and speculative decoding.

A decoding *method* is pure functions traced inside ``jax.jit``:

* ``prefill(params, tokens, lengths, offset, following, cache, key, carry) -> (carry, cache)``
  consumes one chunk of the right-padded prompts (``tokens [B, C]`` = prompt positions
  ``offset .. offset + C - 1``; ``following [B]``: the prompt token after the chunk, 0 past
  the end) and, for every row whose prompt ends in this chunk, samples its first token into
  ``carry``; ``init_carry(batch)`` is the carry before the first chunk and ``start(carry) ->
  (first, first_logprob, state)`` ends the prefill;
* ``step(params, state, cache, key, live) -> (tokens [B, K], logprobs [B, K], n_new [B],
  advance)`` proposes up to ``K`` new tokens per live row (the first ``n_new`` are real);
  ``advance(done) -> (state, cache)`` then finishes the step once the driver knows which
  rows are done (speculative decoding skips drafting for them).

Prompts are prefilled in fixed chunks (``prefill_chunks``): one compiled program per chunk
width, whatever the prompt length, and activations bounded by the chunk, not the prompt. A
row's first token is drawn from the logits at its last prompt position with the same key
whichever chunk holds it, so the result equals a one-shot prefill.

The driver owns everything else, once: which proposed tokens are kept (a row stops after a
stop token or at its budget), where they go in the output, the ``lax.while_loop`` of
``generate``, the per-step program of ``stream``, timings and the result. Plain decoding
(generation.py) is a method with ``K = 1``, MTP speculative decoding (speculative.py) one with
``K = 2``.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from .generation_options import GenerationOptions
from .mesh_rules import padded_rows
from .tokenizer import ByteTokenizer

__all__ = ["GenerationResult", "StreamEvent", "Method", "Programs", "Prepared", "bucket",
           "prefill_alignment", "default_prefill_chunk", "prefill_chunks", "prepare_prompts",
           "token_logprob", "build_programs", "run_prefill", "place_like_rows", "ends_in_chunk",
           "chunk_num_new",
           "finish", "timed"]


@dataclasses.dataclass
class GenerationResult:
    """Generated ids per row (stop token excluded), text when a tokenizer is known,
    per-token log-probabilities (model distribution) when asked, and timings."""
    tokens: list
    finish_reasons: list
    text: list | None = None
    logprobs: list | None = None
    stats: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class StreamEvent:
    """One new token position: ``tokens[b]`` is row b's new token, -1 when row b has none
    here (it has finished, or -- speculative decoding -- its draft was rejected this step);
    ``done[b]``: row b will yield no further token; ``text[b]``: its new printable text.
    In chat mode the last event also has each row's parsed ``messages`` (None where the
    completion does not parse) and ``errors`` (why not; None where it parsed)."""
    step: int
    tokens: np.ndarray
    done: np.ndarray
    logprobs: np.ndarray | None = None
    text: list | None = None
    messages: list | None = None
    errors: list | None = None


@dataclasses.dataclass(frozen=True)
class Method:
    """A decoding method (see the module docstring). ``width``: the most tokens one step
    proposes; ``extra_len``: cache positions it needs beyond prompt + budget; ``summary``
    turns the final state into host statistics."""
    prefill: Callable
    init_carry: Callable
    start: Callable
    step: Callable
    width: int = 1
    extra_len: int = 0
    summary: Callable = lambda state: {}


def bucket(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum): shapes that are reused across calls."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def prefill_alignment(cfg) -> int:
    """What ``prefill_chunk`` must be a multiple of: every compression ratio, so a full chunk
    ends on a block boundary of every compressor (the sliding window needs nothing: a chunk
    attends the ring and its own entries, whatever its width)."""
    align = 1
    for ratio in cfg.compress_ratios:
        if ratio:
            align = align * ratio // np.gcd(align, ratio)
    return int(align)


# Prompt tokens one prefill call takes over all rows together: on a GPU, where prefill
# throughput per layer still grows from 4096 to 8192 tokens a call and full Flash on two
# GPUs has the memory for the larger activations (docs/performance.md, prefill and the
# 131072-token prompt); CPU runs are small models.
PREFILL_CALL_TOKENS = {"gpu": 8192, "cpu": 512}


def default_prefill_chunk(cfg, batch: int = 1) -> int:
    """The chunk ``prefill_chunk=None`` takes: ``PREFILL_CALL_TOKENS`` shared by the
    ``batch`` rows (so a call's activations do not grow with the batch), rounded down to a
    multiple of ``prefill_alignment`` and at least one alignment."""
    tokens = PREFILL_CALL_TOKENS.get(jax.default_backend(), PREFILL_CALL_TOKENS["cpu"])
    align = prefill_alignment(cfg)
    return max(align, tokens // max(int(batch), 1) // align * align)


def prefill_chunks(longest: int, chunk: int) -> tuple:
    """``(offset, width)`` of each prefill call for prompts of up to ``longest`` tokens: full
    chunks, then the rest in a power-of-two bucket (at most ``chunk``); a prompt that fits one
    chunk is one bucketed call. Prompts are not padded to a power of two beyond one chunk."""
    full, rest = divmod(int(longest), int(chunk))
    widths = [chunk] * full + ([min(bucket(rest), chunk)] if rest else [])
    offsets = np.cumsum([0] + widths[:-1])
    return tuple((int(o), int(w)) for o, w in zip(offsets, widths))


@dataclasses.dataclass
class Prepared:
    tokens: np.ndarray            # [B, P] right-padded prompt ids (P = the chunks' widths)
    lengths: np.ndarray           # [B]
    stop_tokens: np.ndarray       # [K]
    max_len: int
    budget: int                   # max_new_tokens
    steps: int                    # bucketed budget (static output width)
    tokenizer: object
    chunks: tuple = ()            # (offset, width) of each prefill call
    real_rows: int | None = None  # rows that are prompts (the rest pad a mesh's batch)

    @property
    def rows(self) -> int:
        """The prompts' rows (the first ``rows`` of every batch array)."""
        return len(self.lengths) if self.real_rows is None else self.real_rows


def prepare_prompts(model, prompts, options: GenerationOptions, *, tokenizer=None,
                    extra_len: int = 0) -> Prepared:
    """Validate and tokenize prompts, check ``options`` against the model (stop tokens in the
    vocabulary, prompts + budget within ``max_len`` and the model's RoPE range, the prefill
    chunk a multiple of ``prefill_alignment``); choose the prefill chunks and bucketed
    shapes. Raises ValueError/TypeError."""
    cfg = model.config
    max_new_tokens, max_len = options.max_new_tokens, options.max_len
    if isinstance(prompts, (str, bytes)) or (isinstance(prompts, Sequence) and prompts
                                            and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
    if any(isinstance(p, str) for p in prompts) and tokenizer is None:
        tokenizer = ByteTokenizer(cfg.vocab_size)
    ids = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            p = tokenizer.encode(p)
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} outside [0, {cfg.vocab_size})")
        ids.append(p)
    # A model on a mesh splits the batch over its data-parallel devices (a small batch over
    # the ``data`` axis only, mesh_rules.row_axes): pad with copies of the last prompt (their
    # results are dropped) to a batch the mesh splits evenly.
    real_rows = len(ids)
    mesh = getattr(model, "mesh", None)
    if mesh is not None:
        ids = ids + [ids[-1]] * (padded_rows(mesh, len(ids)) - len(ids))
    stop_tokens = (cfg.eos_token_id,) if options.stop_tokens is None else options.stop_tokens
    bad = [t for t in stop_tokens if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"stop token {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    chunk = options.prefill_chunk
    align = prefill_alignment(cfg)
    if chunk is None:
        chunk = default_prefill_chunk(cfg, len(ids))
    elif chunk % align:
        raise ValueError(f"prefill_chunk must be a positive multiple of {align} (the "
                         f"compression ratios {sorted(set(cfg.compress_ratios) - {0})}), got "
                         f"{chunk}")
    longest = max(len(p) for p in ids)
    chunks = prefill_chunks(longest, chunk)
    width = sum(w for _, w in chunks)
    steps = bucket(max_new_tokens, 8)
    needed = longest + max_new_tokens + extra_len
    if cfg.max_positions is not None and needed > cfg.max_positions:
        raise ValueError(f"prompt too long for the model: the longest prompt has {longest} "
                         f"tokens, + max_new_tokens {max_new_tokens} > {cfg.max_positions} "
                         f"positions (the RoPE range, original_seq_len x rope_factor)")
    if max_len is None:
        max_len = width + steps + extra_len
    elif needed > max_len:
        raise ValueError(f"prompts longer than the cache: the longest prompt has {longest} tokens, "
                         f"+ max_new_tokens {max_new_tokens} > max_len {max_len}")
    tokens = np.zeros((len(ids), width), np.int32)
    for i, p in enumerate(ids):
        tokens[i, :len(p)] = p
    return Prepared(tokens, np.array([len(p) for p in ids], np.int32),
                    np.array(stop_tokens or (-1,), np.int32), int(max_len), max_new_tokens,
                    steps, tokenizer, chunks, real_rows)


def token_logprob(logits, token):
    """log softmax(logits)[token] per row, in f32 (the model's distribution, not the sampler's)."""
    return jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1),
                               token[:, None], axis=-1)[:, 0]


def keep_proposed(count, done, tokens, n_new, stop, budget):
    """Which of a step's proposed tokens are kept, and where they go.

    Row b keeps its proposals in order while it is live, the proposal is real
    (``j < n_new[b]``), no earlier kept token was a stop token and the budget is not reached.
    Returns (positions [B, K] in the output, -1 where not kept; new count; new done)."""
    positions = []
    stopped = jnp.zeros_like(done)
    for j in range(tokens.shape[1]):
        kept = ~done & (j < n_new) & ~stopped & (count < budget)
        positions.append(jnp.where(kept, count, -1))
        stopped = stopped | (kept & jnp.isin(tokens[:, j], stop))
        count = count + kept.astype(jnp.int32)
    return jnp.stack(positions, axis=1), count, done | stopped | (count >= budget)


@dataclasses.dataclass(frozen=True)
class Programs:
    """The jitted programs of one (method, model, sampler): ``prefill`` (one prompt chunk),
    ``start`` (the driver state after the last chunk), ``step`` (one driver step, for
    ``stream``) and ``loop`` (every step on the device, for ``generate``); ``run_prefill``
    drives the first two."""
    prefill: Callable
    start: Callable
    step: Callable
    loop: Callable
    method: Method


def build_programs(method: Method) -> Programs:
    def start(first, first_lp, stop, budget):
        """Driver state after prefill: the first token is always kept (at position 0)."""
        done = jnp.isin(first, stop) | (budget <= 1)
        return jnp.ones(first.shape, jnp.int32), done

    def one_step(params, state, count, done, cache, key, i, stop, budget):
        key_i = jax.random.fold_in(key, i)
        tokens, lps, n_new, advance = method.step(params, state, cache, key_i, ~done)
        positions, count, new_done = keep_proposed(count, done, tokens, n_new, stop, budget)
        state, cache = advance(new_done)
        return state, count, new_done, cache, tokens, lps, positions

    def step(params, state, count, done, cache, key, i, stop, budget):
        state, count, done, cache, tokens, lps, positions = one_step(
            params, state, count, done, cache, key, i, stop, budget)
        kept = positions >= 0
        return (state, count, done, cache, jnp.where(kept, tokens, -1),
                jnp.where(kept, lps, 0.0))

    def loop(params, first, first_lp, state, cache, key, stop, budget, steps):
        b = first.shape[0]
        rows = jnp.arange(b)[:, None]
        out = jnp.full((b, steps), -1, jnp.int32).at[:, 0].set(first)
        lps = jnp.zeros((b, steps), jnp.float32).at[:, 0].set(first_lp)
        count, done = start(first, first_lp, stop, budget)

        def cond(carry):
            return ~jnp.all(carry[4])

        def body(carry):
            i, out, lps, count, done, state, cache = carry
            state, count, done, cache, tokens, step_lps, positions = one_step(
                params, state, count, done, cache, key, i, stop, budget)
            where = jnp.where(positions >= 0, positions, steps)      # `steps`: dropped
            out = out.at[rows, where].set(tokens, mode="drop")
            lps = lps.at[rows, where].set(step_lps, mode="drop")
            return i + 1, out, lps, count, done, state, cache

        carry = (jnp.int32(1), out, lps, count, done, state, cache)
        _, out, lps, _, _, state, cache = jax.lax.while_loop(cond, body, carry)
        return out, lps, state, cache

    def prefill(params, tokens, lengths, offset, following, cache, key, carry):
        return method.prefill(params, tokens, lengths, offset, following, cache, key, carry)

    def start_decoding(carry, stop, budget):
        first, first_lp, state = method.start(carry)
        count, done = start(first, first_lp, stop, budget)
        return first, first_lp, state, count, done

    return Programs(jax.jit(prefill, donate_argnames=("cache", "carry")),
                    jax.jit(start_decoding),
                    jax.jit(step, donate_argnames=("cache",)),
                    jax.jit(loop, donate_argnames=("cache",), static_argnames=("steps",)),
                    method)


def run_prefill(programs: Programs, params, tokens, lengths, cache, key, stop, budget,
                chunks=None, progress=None):
    """Prefill right-padded prompts ``tokens [B, P]`` (row b: ``lengths[b]`` tokens) chunk by
    chunk (``chunks``: ``(offset, width)`` pairs, default one call over P) and start decoding:
    ``(first, first_logprob, state, count, done, cache)``. ``progress(tokens_done, total)``
    is called after each chunk. Host arrays are sliced on the host, so only one chunk's
    tokens go to the device per call."""
    tokens, lengths = np.asarray(tokens), np.asarray(lengths, np.int32)
    b, total = tokens.shape
    chunks = ((0, total),) if chunks is None else chunks
    # On a mesh the chunks' program returns the carry split like the cache: start it that way,
    # or the second chunk compiles the program again for the new input shardings.
    carry = place_like_rows(programs.method.init_carry(b), cache.lengths)
    lengths_dev = jnp.asarray(lengths)
    for offset, width in chunks:
        end = offset + width
        following = tokens[:, end] if end < total else np.zeros((b,), np.int32)
        carry, cache = programs.prefill(params, jnp.asarray(tokens[:, offset:end]), lengths_dev,
                                        jnp.int32(offset), jnp.asarray(following), cache, key,
                                        carry)
        if progress is not None:        # wait for the chunk, so the progress is the device's
            jax.block_until_ready(carry)
            progress(min(end, int(lengths.max())), int(lengths.max()))
    return (*programs.start(carry, stop, budget), cache)


def place_like_rows(tree, rows: jax.Array):
    """``tree`` with its batch-leading arrays (``rows.shape[0]`` first) split like ``rows``
    when ``rows`` is split over a mesh; unchanged otherwise."""
    sharding = rows.sharding
    if not isinstance(sharding, NamedSharding):
        return tree
    first = sharding.spec[0] if len(sharding.spec) else None

    def place(x):
        if isinstance(x, (jax.Array, np.ndarray)) and x.ndim and x.shape[0] == rows.shape[0]:
            return jax.device_put(x, NamedSharding(sharding.mesh,
                                                   P(first, *([None] * (x.ndim - 1)))))
        return x
    return jax.tree.map(place, tree)


def ends_in_chunk(lengths, offset, width):
    """[B] bool: the row's last prompt token is in the chunk ``offset .. offset + width - 1``."""
    return (lengths > offset) & (lengths <= offset + width)


def chunk_num_new(lengths, offset, width):
    """[B] how many of a chunk's ``width`` tokens are the row's prompt."""
    return jnp.clip(lengths - offset, 0, width).astype(jnp.int32)


def finish(prep: Prepared, rows, lps, logprobs: bool, stats: dict) -> GenerationResult:
    """Host result of the output buffers: rows cut at their first stop token and the budget."""
    stop = set(prep.stop_tokens.tolist())
    tokens, reasons, lp_out = [], [], []
    for r, row in enumerate(rows[:prep.rows]):
        row = [int(t) for t in row if t >= 0][:prep.budget]
        cut = next((k for k, t in enumerate(row) if t in stop), None)
        reasons.append("stop" if cut is not None else "length")
        kept = row if cut is None else row[:cut]
        tokens.append(kept)
        lp_out.append([float(x) for x in lps[r][:len(kept)]])
    text = None
    if prep.tokenizer is not None:
        text = [prep.tokenizer.decode(t) for t in tokens]
    return GenerationResult(tokens, reasons, text, lp_out if logprobs else None, stats)


def timed(fn, *args, **kw):
    """``(fn(*args, **kw) ready on the device, seconds)``."""
    t = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kw))
    return out, time.perf_counter() - t
