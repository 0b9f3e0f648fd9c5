"""Chunked prefill (decoding.run_prefill): the chunk plan, chunked == one-shot prefill (the
first tokens, the MTP drafts and every cache leaf; fp32, smooth mode), generate/stream with a
small ``prefill_chunk``, and what bad chunk sizes and too-long prompts get."""
import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp

import dsv4_jax as dj
from dsv4_jax.__main__ import main
from dsv4_jax.decoding import (build_programs, default_prefill_chunk, prefill_alignment,
                               prefill_chunks, run_prefill)
from dsv4_jax.generation import generate, plain_method, stream
from dsv4_jax.speculative import speculative_method

CFG = dj.Config.tiny(dtype="float32", quant_simulation=False)
_RNG = np.random.default_rng(0)
# rows ending in the first, second and third 128-token chunk, and one in the last partial one
PROMPTS = [_RNG.integers(0, CFG.vocab_size, n).tolist() for n in (300, 137, 5, 256)]
MAX_LEN = 336


@pytest.fixture(scope="module")
def tiny():
    return dj.DSV4(CFG), dj.init_params(CFG, 0)


def test_chunk_plan():
    assert prefill_chunks(5, 4096) == ((0, 16),)                  # one bucketed call
    assert prefill_chunks(300, 128) == ((0, 128), (128, 128), (256, 64))
    assert prefill_chunks(256, 128) == ((0, 128), (128, 128))
    assert prefill_chunks(300, 384) == ((0, 384),)                 # bucket 512 capped
    assert prefill_chunks(130_000, 4096)[-1] == (126_976, 4096)    # 31 full + bucket(3024)
    assert len(prefill_chunks(130_000, 4096)) == 32
    assert prefill_alignment(CFG) == 128 and prefill_alignment(dj.Config.flash()) == 128
    one, four, many = (default_prefill_chunk(CFG, b) for b in (1, 4, 1000))
    assert one % 128 == 0 and four == max(128, one // 4 // 128 * 128) and many == 128


@pytest.mark.parametrize("speculative", [False, True])
def test_chunked_prefill_equals_one_shot(tiny, speculative):
    model, params = tiny
    method = (speculative_method if speculative else plain_method)(model, dj.Greedy())
    programs = build_programs(method)
    width = 384
    tokens = np.zeros((len(PROMPTS), width), np.int32)
    for i, p in enumerate(PROMPTS):
        tokens[i, :len(p)] = p
    lengths = np.array([len(p) for p in PROMPTS], np.int32)
    key, stop, budget = jax.random.key(3), jnp.array([-1], jnp.int32), jnp.int32(8)

    def prefill(chunks):
        cache = dj.Cache.init(CFG, len(PROMPTS), MAX_LEN)
        return run_prefill(programs, params, tokens, lengths, cache, key, stop, budget, chunks)

    one = prefill(None)
    chunked = prefill(prefill_chunks(int(lengths.max()), 128))
    first, first_lp, state, _, _, cache = one
    c_first, c_lp, c_state, _, _, c_cache = chunked
    np.testing.assert_array_equal(c_first, first)
    np.testing.assert_allclose(c_lp, first_lp, atol=1e-5)
    if speculative:
        np.testing.assert_array_equal(c_state[1], state[1])            # the drafts
        np.testing.assert_allclose(c_state[2], state[2], atol=1e-4)    # their log q
    np.testing.assert_array_equal(c_cache.lengths, lengths)
    leaves, c_leaves = jax.tree.leaves(cache), jax.tree.leaves(c_cache)
    assert len(leaves) == len(c_leaves)
    for a, b in zip(leaves, c_leaves):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-4, rtol=1e-4)


def test_generate_and_stream_with_small_chunks(tiny):
    model, params = tiny
    one = generate(model, params, PROMPTS, 5, stop_tokens=(), logprobs=True, max_len=MAX_LEN,
                   prefill_chunk=384)                                 # one call
    small = generate(model, params, PROMPTS, 5, stop_tokens=(), logprobs=True, max_len=MAX_LEN,
                     prefill_chunk=128)
    assert small.tokens == one.tokens
    for a, b in zip(small.logprobs, one.logprobs):
        np.testing.assert_allclose(a, b, atol=1e-4)
    events = list(stream(model, params, PROMPTS, 5, stop_tokens=(), max_len=MAX_LEN,
                         prefill_chunk=128))
    streamed = np.stack([e.tokens for e in events], axis=1)
    assert streamed.tolist() == one.tokens


@pytest.mark.parametrize("chunk", [100, 64, 130])
def test_chunk_not_a_multiple_of_the_ratios(tiny, chunk):
    model, params = tiny
    with pytest.raises(ValueError, match=f"prefill_chunk must be a positive multiple of 128.*"
                                         f"got {chunk}"):
        generate(model, params, PROMPTS, 4, prefill_chunk=chunk)


@pytest.mark.parametrize("chunk", [0, -128, 1.5, True, "128"])
def test_chunk_not_a_positive_int(chunk):
    with pytest.raises(ValueError, match="prefill_chunk must be a positive int"):
        dj.GenerationOptions(max_new_tokens=4, prefill_chunk=chunk)


def test_prompt_beyond_the_rope_range_raises_before_running(tiny):
    _, params = tiny
    short = dj.DSV4(dataclasses.replace(CFG, original_seq_len=64, rope_factor=4.0))  # 256
    assert short.config.max_positions == 256
    with pytest.raises(ValueError, match="prompt too long for the model.*300 tokens.*> 256"):
        generate(short, params, [PROMPTS[0]], 4)
    assert dataclasses.replace(CFG, original_seq_len=0).max_positions is None


def test_cli_prefills_a_prompt_file_in_chunks_with_progress(tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("long context " * 30, encoding="utf-8")      # BOS + 390 byte tokens
    assert main(["generate", "--prompt-file", str(doc), "--max-new-tokens", "2",
                 "--prefill-chunk", "128"]) == 0
    err = capsys.readouterr().err
    assert "prefill" in err and "391/391" in err
    assert main(["generate", "--prompt-file", str(tmp_path / "none.txt")]) == 2
    assert "--prompt-file" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--prefill-chunk", "100"]) == 2
    assert "prefill_chunk must be a positive multiple of 128" in capsys.readouterr().err
