"""The model's decode step lowered for a Hopper GPU on any host (CPU CI included): the text
the lowering tests search for the kernels' custom calls and their operand types."""
import jax
import jax.numpy as jnp

from dsv4_jax.ffi import dispatch
from dsv4_jax.params import abstract_params

CUTE_CALL = "custom_call @CuteDSLRT"


def lower_decode_step(model, cfg, cache, batch: int = 2) -> str:
    """StableHLO text of one decode token per row of ``cache`` (abstract parameters)."""
    return lower_step(model, cfg, cache, batch)


def lower_step(model, cfg, cache, batch: int = 2, tokens: int = 1) -> str:
    """StableHLO text of ``tokens`` tokens per row of ``cache`` (abstract parameters)."""
    tok = jax.ShapeDtypeStruct((batch, tokens), jnp.int32)
    step = jax.jit(lambda p, t, c: model.apply({"params": p}, t, c, logits_at="last"))
    with dispatch.cuda_target():
        return step.trace(abstract_params(cfg), tok, cache).lower(
            lowering_platforms=("cuda",)).as_text()


def cute_calls(text: str) -> list[str]:
    """The lines of ``text`` that launch a CuTe DSL kernel."""
    return [line for line in text.splitlines() if CUTE_CALL in line]
