"""DeepSeek-V4 inference in JAX: Flax model, functional cache, CuTe DSL kernels for Hopper.

    import jax, dsv4_jax as dj
    cfg = dj.Config.tiny()
    model = dj.DSV4(cfg)
    params = dj.init_params(cfg, jax.random.key(0))
    cache = dj.Cache.init(cfg, batch=2, max_len=1024)
    logits, cache = model.apply({"params": params}, tokens, cache)
"""
from ._xla_flags import EXACT_ROUNDING  # noqa: F401  first: XLA_FLAGS must precede backend creation
from .config import Config
from .cache import Cache, LayerCache
from .models.transformer import DSV4
from .params import init_params, abstract_params, param_count
from .checkpoints import load, save
from . import sampling, introspect
from .sampling import Greedy, Temperature, TopK, TopP, MinP
from .generation import generate, stream

__all__ = ["Config", "Cache", "LayerCache", "DSV4", "init_params", "abstract_params", "load", "save",
           "param_count", "generate", "stream", "Greedy", "Temperature", "TopK", "TopP", "MinP",
           "sampling", "introspect"]

