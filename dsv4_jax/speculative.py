"""MTP speculative decoding: draft one token with the MTP block (docs/architecture.md §3.9),
verify two with the main model.

Invariant at each step, per row: the main cache holds x_0..x_{L-1}; x_L is sampled but not
consumed; the MTP cache holds the pairs (h_i, x_{i+1}) for i < L and has drafted d for x_{L+1}
(h_i: the main model's final residual streams at position i).

1. the main model consumes ``[x_L, d]`` (S = 2) and returns its logits, hidden states and a
   *pending* update instead of committing both tokens;
2. accept d when the main model's own draw at L agrees (greedy: ``argmax == d``; sampling: the
   standard rule -- accept with probability ``min(1, p(d)/q(d))``, else draw from
   ``normalize(max(p - q, 0))``); on acceptance x_{L+2} is drawn from the logits at L+1;
3. ``commit`` keeps 2 tokens (accepted) or 1 (rejected) -- the rejected token leaves no trace
   in any ring, compressor state or compressed table, exactly as if it had never been fed;
4. the MTP block consumes the 1 or 2 new pairs and drafts the next d.

With greedy sampling the output equals plain greedy decoding (up to floating-point
differences between an S = 2 and an S = 1 forward).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .decoding import Method, chunk_num_new, ends_in_chunk, token_logprob
from .sampling import Sampler
from dsv4_jax.models.transformer import commit

__all__ = ["speculative_method", "accept_draft"]


def accept_draft(sampler: Sampler, logits_l, logits_l1, draft, draft_logp, key):
    """Verification of one draft per row. Returns (accepted [B] bool, first token, second
    token (valid where accepted)). ``draft_logp``: log q of the draft distribution [B, V]."""
    k_accept, k_resid, k_next = jax.random.split(key, 3)
    if sampler.is_greedy:
        target = jnp.argmax(logits_l, axis=-1).astype(jnp.int32)
        accepted = target == draft
        first = jnp.where(accepted, draft, target)
    else:
        logp = sampler.log_probs(logits_l)
        p_d = jnp.take_along_axis(logp, draft[:, None], axis=-1)[:, 0]
        q_d = jnp.take_along_axis(draft_logp, draft[:, None], axis=-1)[:, 0]
        u = jax.random.uniform(k_accept, draft.shape)
        accepted = jnp.log(u) < (p_d - q_d)
        resid = jnp.maximum(jnp.exp(logp) - jnp.exp(draft_logp), 0.0)
        # a zero residual only happens when p == q, where acceptance is certain anyway
        resid = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, resid, jnp.exp(logp))
        fallback = jax.random.categorical(k_resid, jnp.log(resid), axis=-1).astype(jnp.int32)
        first = jnp.where(accepted, draft, fallback)
    second = sampler.sample(logits_l1, k_next)
    return accepted, first, second


def speculative_method(model, sampler: Sampler) -> Method:
    """The decoding method of the module docstring for ``decoding.build_programs``: up to two
    tokens per step; the state is (x_L, draft, draft log q, drafts made, drafts accepted)."""
    quiet = model.clone(runtime_checks=False)

    def main_apply(params, tokens, cache, num_new, **kw):
        return quiet.apply({"params": params}, tokens, cache, num_new=num_new, **kw)

    def draft(params, hidden, tokens, cache, num_new, key):
        logits, cache, _ = quiet.apply({"params": params}, hidden, tokens, cache,
                                       num_new=num_new, logits_at="last",
                                       method=type(quiet).mtp_forward)
        return sampler.sample(logits, key), sampler.log_probs(logits), cache

    def prefill(params, tokens, lengths, offset, following, cache, key, carry):
        b, width = tokens.shape
        num_new = chunk_num_new(lengths, offset, width)
        logits, cache, hidden = main_apply(params, tokens, cache, num_new, logits_at="last",
                                           return_hidden=True)
        first = sampler.sample(logits, jax.random.fold_in(key, 0))
        ends = ends_in_chunk(lengths, offset, width)
        # MTP pairs (h_i, x_{i+1}) of the chunk: the next chunk's first token after the last
        # position, the sampled token after the prompt's last one
        shifted = jnp.concatenate([tokens[:, 1:], following[:, None]], axis=1)
        last = jnp.arange(width)[None, :] == (lengths - 1 - offset)[:, None]
        shifted = jnp.where(last, first[:, None], shifted)
        d, d_logp, cache = draft(params, hidden, shifted, cache, num_new,
                                 jax.random.fold_in(key, 1 << 20))
        kept = (first, token_logprob(logits, first), d, d_logp)
        return tuple(jnp.where(ends.reshape((b,) + (1,) * (new.ndim - 1)), new, old)
                     for new, old in zip(kept, carry)), cache

    def init_carry(batch):
        return (jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.float32),
                jnp.zeros((batch,), jnp.int32),
                jnp.zeros((batch, model.config.vocab_size), jnp.float32))

    def start(carry):
        first, first_lp, d, d_logp = carry
        return first, first_lp, (first, d, d_logp, jnp.int32(0), jnp.int32(0))

    def step(params, state, cache, key, live):
        x, d, d_logp, n_draft, n_acc = state
        logits, _, hidden, pending = main_apply(params, jnp.stack([x, d], axis=1), cache,
                                                jnp.where(live, 2, 0),
                                                return_hidden=True, return_pending=True)
        accepted, e1, e2 = accept_draft(sampler, logits[:, 0], logits[:, 1], d, d_logp, key)
        tokens = jnp.stack([e1, e2], axis=1)
        lps = jnp.stack([token_logprob(logits[:, 0], e1), token_logprob(logits[:, 1], e2)],
                        axis=1)
        n_keep = jnp.where(live, jnp.where(accepted, 2, 1), 0)

        def advance(done):
            committed = commit(cache, pending, n_keep)
            # MTP consumes (h_L, x_{L+1}) and, if accepted, (h_{L+1}, x_{L+2}); then drafts
            pair_tok = jnp.stack([e1, jnp.where(accepted, e2, e1)], axis=1)
            d_next, d_logp_next, committed = draft(params, hidden, pair_tok, committed,
                                                   jnp.where(done, 0, n_keep),
                                                   jax.random.fold_in(key, 1 << 20))
            counts = (n_draft + jnp.sum(live), n_acc + jnp.sum(live & accepted))
            return (jnp.where(accepted, e2, e1), d_next, d_logp_next) + counts, committed

        return tokens, lps, jnp.where(accepted, 2, 1), advance

    def summary(state):
        drafts, accepted = int(state[3]), int(state[4])
        return dict(drafts=drafts, accepted=accepted,
                    acceptance_rate=accepted / max(drafts, 1))

    # the verify step feeds one token beyond the last one kept
    return Method(prefill, init_carry, start, step, width=2, extra_len=1, summary=summary)
