"""DeepSeek-V4 inference in JAX: Flax model, functional cache, CuTe DSL kernels for Hopper.

    import jax, dsv4_jax as dj
    cfg = dj.Config.tiny()
    model = dj.DSV4(cfg)
    params = dj.init_params(cfg, jax.random.key(0))
    cache = dj.Cache.init(cfg, batch=2, max_len=1024)
    logits, cache = model.apply({"params": params}, tokens, cache)

Importing the package sets XLA's flags (``_xla_flags``: exact rounding, decode loops in CUDA
graphs, no per-call weight concatenation, concurrent commands in those graphs) and nothing
else: the names below import their modules (and JAX) on first use, so the command line's
``--help`` needs no JAX.
"""
import importlib

# first: before any backend
from ._xla_flags import (CONCURRENT_COMMAND_BUFFERS, DEVICE_LOOPS, EXACT_ROUNDING,  # noqa: F401
                         NO_WEIGHT_MERGING)

# public name -> (module, attribute; None for the module itself)
_EXPORTS = {
    "Config": (".config", "Config"),
    "Cache": (".cache", "Cache"),
    "LayerCache": (".cache", "LayerCache"),
    "DSV4": ("dsv4_jax.models.transformer", "DSV4"),
    "init_params": (".params", "init_params"),
    "abstract_params": (".params", "abstract_params"),
    "param_count": (".params", "param_count"),
    "block_expert_weights": (".params", "block_expert_weights"),
    "can_block_expert_weights": (".params", "can_block_expert_weights"),
    "sampling": (".sampling", None),
    "introspect": (".introspect", None),
    "Greedy": (".sampling", "Greedy"),
    "Temperature": (".sampling", "Temperature"),
    "TopK": (".sampling", "TopK"),
    "TopP": (".sampling", "TopP"),
    "MinP": (".sampling", "MinP"),
    "generate": (".generation", "generate"),
    "stream": (".generation", "stream"),
    "GenerationOptions": (".generation_options", "GenerationOptions"),
    "ChatOptions": (".generation_options", "ChatOptions"),
    "encode_chat": (".chat", "encode_chat"),
    "parse_completion": (".chat", "parse_completion"),
    "load": ("dsv4_jax.checkpoints", "load"),
    "KernelPolicy": ("dsv4_jax.ffi.policy", "KernelPolicy"),
    "GroupedGemmPolicy": ("dsv4_jax.ffi.policy", "GroupedGemmPolicy"),
    "save": ("dsv4_jax.checkpoints", "save"),
}

__all__ = ["Config", "Cache", "LayerCache", "DSV4", "init_params", "abstract_params", "load", "save",
           "param_count", "block_expert_weights", "can_block_expert_weights", "generate", "stream", "GenerationOptions", "ChatOptions", "Greedy",
           "Temperature", "TopK", "TopP", "MinP", "sampling", "introspect", "encode_chat",
           "parse_completion", "KernelPolicy", "GroupedGemmPolicy"]


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dsv4_jax' has no attribute {name!r}")
    module_name, attr = _EXPORTS[name]
    module = importlib.import_module(module_name, __name__)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))

