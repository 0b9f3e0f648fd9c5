"""Loading official DeepSeek-V4 checkpoints natively, and orbax save/restore.

    import dsv4_jax as dj
    model, params = dj.load("DeepSeek-V4-Flash")            # HF dir: FP8/FP4 kept quantized
                                                             # (FP4 experts in decode tiles)
    model, params = dj.load(path, dequantize=True)           # plain BF16 weights instead
    model, params = dj.load(path, shardings=fn_or_tree)      # each leaf onto its sharding
    model, params = dj.load(path, expert_layout="rows")      # FP4 experts as the files hold them
    dj.save("flash-orbax", params, model.config)             # then dj.load("flash-orbax")

``python -m dsv4_jax convert SRC DST`` writes the orbax form of an HF directory.

Modules: ``safetensors_io`` (strict reader/writer), ``names`` (the declarative name table),
``precision`` (exact host-side conversions), ``hf`` (HF directories), ``orbax_io`` (our
layout), ``convert`` (CLI), ``testing`` (tiny official-format checkpoints).
"""
from __future__ import annotations

import os

from dsv4_jax.ffi.policy import KernelPolicy
from dsv4_jax.params import block_expert_weights, default_expert_layout
from dsv4_jax.models.transformer import DSV4
from .hf import load_hf
from .orbax_io import is_orbax_dir, load_orbax, save as _save
from .safetensors_io import CheckpointError

__all__ = ["load", "save", "CheckpointError"]


def load(path, *, dequantize: bool = False, shardings=None, mesh=None, dtype=None,
         progress=None, implementation=None, expert_layout: str | None = None,
         **config_overrides):
    """``(model, params)`` from an official HF directory or a ``save`` (orbax) directory.

    HF directories (``config.json`` + ``*.safetensors`` + ``model.safetensors.index.json``)
    are read tensor by tensor (host memory bounded by one stacked expert projection, see
    ``dsv4_jax.checkpoints.hf``); weights stay in checkpoint precision (FP8 e4m3 + E8M0
    128x128 scales, routed experts packed FP4 + E8M0 1x32, or FP8) unless ``dequantize``.

    Args:
      path: the checkpoint directory.
      dequantize: load FP8/FP4 weights as exact plain ``dtype`` arrays; the returned config
        has ``quantized=False``.
      shardings: where each leaf goes: a tree of ``jax.sharding.Sharding`` matching the
        params, one ``Sharding`` for every leaf, or a callable ``(path_tuple,
        ShapeDtypeStruct) -> Sharding``. Default: the default device. Each leaf is built
        with ``jax.make_array_from_callback``, so a device reads only its own slice.
      mesh: a ``("data", "expert")`` mesh (``dsv4_jax.sharding.make_mesh``): without
        ``shardings`` the rule table of ``dsv4_jax.sharding`` places every leaf (experts over
        ``expert``, vocabulary over all devices, the rest replicated) after checking that the
        parameters fit the devices' memory; the returned model runs on the mesh.
      dtype: ``"bfloat16"`` (checkpoint) or ``"float32"``: ``Config.dtype`` of the model;
        BF16 leaves become float32 (exact).
      progress: tqdm progress bar; ``None`` shows it when stderr is a terminal.
      implementation: the returned model's ``implementation`` (see ``DSV4``); None takes
        ``KernelPolicy.from_environment()`` -- ``DSV4_IMPLEMENTATION`` and the kernel
        variables, the defaults when none is set.
      expert_layout: ``Config.expert_layout`` of the returned model. None (the default):
        ``"blocked"`` for packed FP4 routed experts (the layout the decode kernels read
        fastest, docs/performance.md) whose shards are whole 64-row x 128-code tiles (the
        rule table's are), ``"rows"`` otherwise. ``"blocked"`` for other
        experts is a ``ValueError``. Blocked experts are read as the files hold them (rows)
        and converted leaf by leaf (``block_expert_weights``: one leaf of extra memory;
        ``shardings`` trees describe the files' row layout).
      **config_overrides: ``Config`` fields to change (e.g. ``quant_simulation=False``);
        unknown or mistyped fields raise ``TypeError``.

    Raises ``FileNotFoundError`` (no such path / files), ``CheckpointError`` (a
    ``ValueError``: missing, unexpected, mis-shaped or corrupt tensors; incompatible orbax
    checkpoint), ``ValueError`` (unsupported config.json architecture), ``TypeError``
    (bad overrides) -- always before a model is returned.
    """
    path = os.fspath(path)
    policy = (KernelPolicy.from_environment() if implementation is None
              else KernelPolicy.coerce(implementation))
    if not os.path.exists(path):
        raise FileNotFoundError(f"load: {path!r} does not exist")
    if not os.path.isdir(path):
        raise ValueError(f"load: {path!r} is a file; pass the checkpoint directory")
    if expert_layout not in (None, "rows", "blocked"):
        raise ValueError(f"load: expert_layout must be None, 'rows' or 'blocked', "
                         f"got {expert_layout!r}")
    kwargs = dict(dequantize=dequantize, shardings=shardings, mesh=mesh, dtype=dtype,
                  progress=progress, overrides=config_overrides)
    if is_orbax_dir(path):
        cfg, params = load_orbax(path, **kwargs)
    elif os.path.isfile(os.path.join(path, "config.json")):
        cfg, params = load_hf(path, **kwargs)
    else:
        raise FileNotFoundError(f"load: {path!r} has neither config.json (HF checkpoint) nor "
                                "dsv4_config.json (orbax checkpoint written by dsv4_jax.save)")
    if (expert_layout or default_expert_layout(cfg, params)) == "blocked":
        cfg = cfg.replace(expert_layout="blocked")        # ValueError unless FP4 experts
        params = block_expert_weights(params)
    return DSV4(cfg, mesh=mesh, implementation=policy), params


def save(path, params, config, *, overwrite: bool = False, progress=None) -> str:
    """Write ``params`` of ``DSV4(config)`` as an orbax checkpoint that ``load`` reads back
    bit for bit (dtypes included). ``FileExistsError`` for a non-empty ``path`` unless
    ``overwrite`` (only ever replaces a previous dsv4_jax checkpoint). Checkpoints hold the
    experts in the row layout: blocked experts (``config.expert_layout="blocked"``) are
    written as rows, one group at a time, and ``load`` blocks them again."""
    return _save(path, params, config, overwrite=overwrite, progress=progress)
