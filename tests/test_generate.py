"""Generation: greedy == argmax rollout, stream == generate, options= == keywords, speculative
== plain greedy, samplers on crafted logits, compile-once, stop tokens, logprobs, bad input,
CLI."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

import dsv4_jax as dj
from dsv4_jax import sampling
from dsv4_jax.generation import generate, stream
from dsv4_jax.speculative import accept_draft

CFG = dj.Config.tiny(dtype="float32", quant_simulation=False)
PROMPTS = [[0, 17, 300, 5, 9], [0, 44, 2, 801, 6, 7, 99, 12, 3, 500, 4]]


@pytest.fixture(scope="module")
def tiny():
    return dj.DSV4(CFG), dj.init_params(CFG, 0)


def test_greedy_generate_equals_argmax_rollout_of_full_forwards(tiny):
    model, params = tiny
    result = generate(model, params, PROMPTS, 6, logprobs=True)
    # one full forward over the whole sequence each time (fixed width 32, padding masked)
    fwd = jax.jit(lambda t, n: model.apply({"params": params}, t, dj.Cache.init(CFG, 1, 64),
                                           num_new=n, logits_at="last")[0][0])
    for prompt, got, lps in zip(PROMPTS, result.tokens, result.logprobs):
        seq = list(prompt)
        for k in range(6):
            padded = jnp.array([seq + [0] * (32 - len(seq))])
            logits = fwd(padded, jnp.array([len(seq)]))
            nxt = int(jnp.argmax(logits))
            assert got[k] == nxt
            want_lp = float(jax.nn.log_softmax(logits)[nxt])
            assert abs(lps[k] - want_lp) < 1e-4
            seq.append(nxt)
    assert result.finish_reasons == ["length", "length"]


@pytest.mark.parametrize("sampler", [sampling.Greedy(), sampling.TopK(40, temperature=0.9)])
def test_stream_yields_the_same_tokens_as_generate(tiny, sampler):
    model, params = tiny
    result = generate(model, params, PROMPTS, 7, sampler, seed=5)
    events = list(stream(model, params, PROMPTS, 7, sampler, seed=5))
    streamed = np.stack([e.tokens for e in events], axis=1)
    for row, want in enumerate(result.tokens):
        assert streamed[row][:len(want)].tolist() == want
    assert events[-1].done.all()


def test_options_value_decodes_as_the_keywords(tiny):
    """generate/stream(options=GenerationOptions(...)) give what the same options as keywords
    give, with the same programs (those of the stream test above: nothing new compiles)."""
    model, params = tiny
    sampler = sampling.TopK(40, temperature=0.9)
    opts = dj.GenerationOptions(max_new_tokens=7, sampler=sampler, seed=5, logprobs=True)
    want = generate(model, params, PROMPTS, 7, sampler, seed=5, logprobs=True)
    got = generate(model, params, PROMPTS, options=opts)
    assert got.tokens == want.tokens and got.finish_reasons == want.finish_reasons
    assert got.logprobs == want.logprobs and got.stats["compilations"] == 0
    keywords = list(stream(model, params, PROMPTS, 7, sampler, seed=5, logprobs=True))
    events = list(stream(model, params, PROMPTS, options=opts))
    assert len(events) == len(keywords)
    for e, k in zip(events, keywords):
        np.testing.assert_array_equal(e.tokens, k.tokens)
        np.testing.assert_array_equal(e.logprobs, k.logprobs)


def test_sampling_is_reproducible_with_a_seed(tiny):
    model, params = tiny
    s = sampling.Temperature(1.0)
    a = generate(model, params, PROMPTS, 6, s, seed=11).tokens
    assert generate(model, params, PROMPTS, 6, s, seed=11).tokens == a
    assert generate(model, params, PROMPTS, 6, s, seed=12).tokens != a


def test_compile_once_for_prompts_in_the_same_buckets(tiny):
    model, params = tiny
    generate(model, params, PROMPTS, 6)                              # warm-up
    other = [[0, 1000, 3], [0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]   # <= 16 tokens
    stats = generate(model, params, other, 5).stats                  # budget bucket 8 too
    assert stats["compilations"] == 0, stats
    assert stats["tokens_per_s"] > 0 and stats["compile_s"] == 0


def test_rows_stop_independently_at_stop_tokens(tiny):
    model, params = tiny
    free = generate(model, params, PROMPTS, 8).tokens
    stop = free[0][3]                                     # row 0 emits it at step 3
    result = generate(model, params, PROMPTS, 8, stop_tokens=[stop])
    assert result.tokens[0] == free[0][:3] and result.finish_reasons[0] == "stop"
    cut = free[1].index(stop) if stop in free[1] else 8
    assert result.tokens[1] == free[1][:cut]


@pytest.mark.parametrize("vocab", [6, CFG.vocab_size])
def test_speculative_greedy_equals_plain_greedy(vocab):
    """vocab 6 makes the random MTP draft right about half the time, so both the accepted
    and the rejected paths (exact rollback) run; the full vocabulary rejects almost always."""
    cfg = CFG.replace(vocab_size=vocab, eos_token_id=0)
    model, params = dj.DSV4(cfg), dj.init_params(cfg, 0)
    prompts = [[p % vocab for p in prompt] for prompt in PROMPTS] + [[3 % vocab]]
    plain = generate(model, params, prompts, 20, stop_tokens=())
    spec = generate(model, params, prompts, 20, stop_tokens=(), speculative=True, logprobs=True)
    assert spec.tokens == plain.tokens
    rate = spec.stats["acceptance_rate"]
    assert 0 <= rate <= 1 and spec.stats["drafts"] > 0
    if vocab == 6:
        assert rate > 0.2, spec.stats
        assert_speculative_stream_matches(model, params, prompts, spec)


@pytest.mark.parametrize("vocab", [6, CFG.vocab_size])
def test_speculative_greedy_equals_plain_greedy_past_the_window(vocab):
    """A prompt longer than the window (verify steps read a wrapped ring), verify steps across
    CSA (4) and HCA (128) block ends (positions 250..262), a short row beside it; float32, so
    an S = 2 verify and an S = 1 decode step agree to rounding (in BF16 a router near-tie can
    turn an ulp into another token)."""
    cfg = CFG.replace(vocab_size=vocab, eos_token_id=0)
    model, params = dj.DSV4(cfg), dj.init_params(cfg, 0)
    prompts = [[(3 + 7 * i) % vocab for i in range(250)], [5 % vocab, 6 % vocab, 7 % vocab]]
    plain = generate(model, params, prompts, 12, stop_tokens=(), logprobs=True)
    spec = generate(model, params, prompts, 12, stop_tokens=(), speculative=True, logprobs=True)
    assert spec.tokens == plain.tokens
    for got, want in zip(spec.logprobs, plain.logprobs):
        np.testing.assert_allclose(got, want, atol=1e-4)
    if vocab == 6:
        assert spec.stats["accepted"] > 0, spec.stats


def assert_speculative_stream_matches(model, params, prompts, result):
    """Streaming speculative decoding yields, step by step, the tokens each verify step kept
    (one or two per row) -- together those of generate -- with their logprobs; a row is
    done from its last token on."""
    events = list(stream(model, params, prompts, 20, stop_tokens=(), speculative=True,
                         logprobs=True))
    for row, want in enumerate(result.tokens):
        got = [(int(e.tokens[row]), float(e.logprobs[row])) for e in events if e.tokens[row] >= 0]
        assert [t for t, _ in got] == want
        np.testing.assert_allclose([lp for _, lp in got], result.logprobs[row], atol=1e-5)
        last = max(k for k, e in enumerate(events) if e.tokens[row] >= 0)
        assert [bool(e.done[row]) for e in events] == [k >= last for k in range(len(events))]
    # accepted drafts put two tokens into one step: fewer events than tokens in all
    assert len(events) < sum(len(t) for t in result.tokens)


def test_speculative_acceptance_rule_preserves_the_target_distribution():
    """Monte Carlo over 40000 rows: the first token of a verify step is distributed as p."""
    v, rows = 5, 40000
    p_logits = jnp.log(jnp.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    q_logp = jnp.log(jnp.array([[0.1, 0.1, 0.6, 0.1, 0.1]] * rows))
    s = sampling.Temperature(1.0)
    draft = jax.random.categorical(jax.random.key(0), q_logp, axis=-1).astype(jnp.int32)
    logits = jnp.broadcast_to(p_logits, (rows, v))
    accepted, first, _ = accept_draft(s, logits, logits, draft, q_logp, jax.random.key(1))
    freq = np.bincount(np.asarray(first), minlength=v) / rows
    np.testing.assert_allclose(freq, [0.5, 0.2, 0.15, 0.1, 0.05], atol=0.01)
    # expected acceptance: sum_x min(p, q)
    assert abs(float(jnp.mean(accepted)) - (0.1 + 0.1 + 0.15 + 0.1 + 0.05)) < 0.01


# ----------------------------------------------------------------------------- samplers
def crafted_logits():
    # probabilities ~ [0.4, 0.3, 0.15, 0.1, 0.05, tiny...]
    p = np.array([0.4, 0.3, 0.15, 0.1, 0.05] + [1e-6] * 11)
    return jnp.asarray(np.log(p / p.sum()), jnp.float32)[None].repeat(4000, 0)


@pytest.mark.parametrize("sampler, allowed", [
    (sampling.TopK(3, temperature=1.5), {0, 1, 2}),
    (sampling.TopP(0.65, temperature=1.0), {0, 1}),         # 0.4 + 0.3 reaches 0.65
    (sampling.TopP(0.75, temperature=1.0), {0, 1, 2}),
    (sampling.MinP(0.3, temperature=1.0), {0, 1, 2}),       # >= 0.3 * 0.4 = 0.12
    (sampling.TopP(0.05, temperature=2.0), {0}),            # top token always kept
    (sampling.Greedy(), {0}),
])
def test_filtered_samplers_never_leave_the_allowed_set(sampler, allowed):
    tokens = np.asarray(sampler.sample(crafted_logits(), jax.random.key(3)))
    assert set(tokens.tolist()) <= allowed
    if len(allowed) > 1:
        assert set(tokens.tolist()) == allowed                      # and every one is used


@pytest.mark.parametrize("make, match", [
    (lambda: sampling.Temperature(-0.1), "temperature"),
    (lambda: sampling.TopP(0.0), "p must be in"),
    (lambda: sampling.TopP(1.5), "p must be in"),
    (lambda: sampling.TopK(0), "k must be"),
    (lambda: sampling.MinP(-1.0), "p must be in"),
])
def test_sampler_arguments_are_validated(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_generate_bad_input(tiny):
    model, params = tiny
    with pytest.raises(ValueError, match="non-empty"):
        generate(model, params, [], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, params, PROMPTS, 0)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, params, [[1, 2], []], 4)
    with pytest.raises(ValueError, match="prompts longer than the cache"):
        generate(model, params, PROMPTS, 60, max_len=64)
    with pytest.raises(ValueError, match="stop token 5000"):
        generate(model, params, PROMPTS, 4, stop_tokens=[5000])
    with pytest.raises(ValueError, match="outside"):
        generate(model, params, [[1, 99999]], 4)
    with pytest.raises(TypeError, match="sampler"):
        generate(model, params, PROMPTS, 4, sampler="greedy")


# ----------------------------------------------------------------------------- tokenizers
def test_byte_tokenizer_round_trip_and_text_output(tiny):
    from dsv4_jax.tokenizer import ByteTokenizer
    tok = ByteTokenizer(1024)
    ids = tok.encode("héllo")
    assert ids[0] == 0 and tok.decode(ids) == "héllo"
    model, params = tiny
    result = generate(model, params, ["héllo"], 4)
    assert result.text[0] == tok.decode(result.tokens[0])


def test_hf_tokenizer_and_dsv4_chat_encoding(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from dsv4_jax.tokenizer import (ASSISTANT, BOS, EOS, THINK_END, THINK_START, USER,
                                    HFTokenizer, encode_chat, load_tokenizer)
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "hi": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens([BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END])
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = load_tokenizer(tmp_path, 10)
    assert isinstance(hf, HFTokenizer) and hf.has_chat_tokens
    text = encode_chat([{"role": "system", "content": "hi"},
                        {"role": "user", "content": "hello world"}])
    assert text == f"{BOS}hi{USER}hello world{ASSISTANT}{THINK_END}"
    ids = hf.encode(text)
    assert ids[0] == hf.bos_id and ids.count(hf.bos_id) == 1
    assert hf.decode(ids) == "hi hello world"
    thinking = encode_chat([{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "hello"},
                            {"role": "user", "content": "world"}], thinking=True)
    assert thinking == (f"{BOS}{USER}hi{ASSISTANT}{THINK_END}hello{EOS}"
                        f"{USER}world{ASSISTANT}{THINK_START}")


# ----------------------------------------------------------------------------- CLI
def test_main_command_rejects_bad_arguments(capsys, tmp_path):
    from dsv4_jax.__main__ import main
    assert main(["generate", "--prompt", "x", "--model", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens" in capsys.readouterr().err
