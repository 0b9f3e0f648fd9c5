"""Loading an official HF-format DSV4 directory (config.json + safetensors + index json).

Order of work, so that bad input fails before any tensor data is read:

1. ``config.json`` -> ``Config`` (``Config.from_hf``; unknown architectures raise); every
   safetensors header is read and validated; the index ``weight_map`` must agree with them.
2. The routed-expert storage (FP4 or FP8) is read off the headers when config.json does not
   say (the April configs omit ``expert_dtype``); overrides give the target config.
3. ``checkpoint_inventory`` (the declarative name table expanded over the config) is
   compared with the files: every missing, unexpected, wrongly shaped or typed tensor is
   listed in one ``CheckpointError``.
4. Only then are leaves read, tensor by tensor, converted on the host (``precision``) and
   placed with ``jax.make_array_from_callback`` on their sharding: a device that holds a
   slice of a plain tensor reads only that slice from the ``mmap``; routed experts are
   stacked as they are read, per device only the experts that device holds.

Host memory is therefore bounded by the largest single unit -- one projection of all
routed experts of one layer (``[E, out, in/2]`` FP4, or its dequantized form), or the
embedding -- never the model. ``prepare`` hands the tree out group by group (``embed``,
``layers_<i>``, ...), which ``convert`` saves before reading the next group.
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass

import jax
import numpy as np

from dsv4_jax.config import Config
from dsv4_jax.params import abstract_params
from . import precision
from .common import (checkpoint_precision, flat_leaves, group_of, group_subtree, leaf_shardings,
                     merge_groups, progress_bar, raise_if, summarize_names, target_config)
from .names import FileTensor, checkpoint_inventory, is_ignored
from .safetensors_io import CheckpointError, SafetensorsFile, TensorInfo, dtype_code

INDEX_FILE = "model.safetensors.index.json"
_EXPERT_PROBE = re.compile(r"(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w1\.weight\Z")
_EXPERT_DTYPES = {"I8": "fp4", "F8_E4M3": "fp8"}


# ----------------------------------------------------------------------------- the files
class HFDirectory:
    """The validated headers of an HF checkpoint directory: ``tensors[name] -> (file, info)``."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path!r} is not a directory")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path!r} has no config.json (not an HF checkpoint)")
        with open(os.path.join(path, "config.json")) as f:
            try:
                self.hf_config = json.load(f)
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{path}/config.json is not valid JSON: {e}") from None
        self.files: dict[str, SafetensorsFile] = {}
        self.tensors: dict[str, tuple[SafetensorsFile, TensorInfo]] = {}
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self):
        index_path = os.path.join(self.path, INDEX_FILE)
        weight_map = None
        if os.path.exists(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
                if not (isinstance(weight_map, dict) and all(
                        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())):
                    raise TypeError("weight_map must map tensor names to file names")
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"corrupt index {index_path}: {e!r}") from None
            names = sorted(set(weight_map.values()))
        else:
            names = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))
        if not names:
            raise FileNotFoundError(f"{self.path}: no *.safetensors files (and no {INDEX_FILE})")
        for name in names:
            file_path = os.path.join(self.path, name)
            if os.path.dirname(os.path.normpath(file_path)) != os.path.normpath(self.path):
                raise CheckpointError(f"{index_path}: file name {name!r} leaves the directory")
            if not os.path.isfile(file_path):
                raise FileNotFoundError(f"{file_path} (listed in {INDEX_FILE}) does not exist")
            st = self.files[name] = SafetensorsFile(file_path)
            for tname, info in st.tensors.items():
                if tname in self.tensors:
                    raise CheckpointError(f"tensor {tname!r} is in both "
                                          f"{self.tensors[tname][0].path} and {file_path}")
                self.tensors[tname] = (st, info)
        if weight_map is not None:
            wrong = [n for n, f in weight_map.items()
                     if n not in self.tensors or os.path.basename(self.tensors[n][0].path) != f]
            unlisted = [n for n in self.tensors if n not in weight_map]
            lines = []
            if wrong:
                lines.append(f"{len(wrong)} index entries not found in the named file: "
                             + summarize_names(wrong))
            if unlisted:
                lines.append(f"{len(unlisted)} tensors missing from the index: "
                             + summarize_names(unlisted))
            raise_if(lines, f"{index_path} disagrees with the safetensors headers:")

    def read(self, name: str, index=None) -> np.ndarray:
        return self.tensors[name][0].read(name, index)

    def dtype(self, name: str) -> str:
        return self.tensors[name][1].dtype

    def close(self):
        for f in self.files.values():
            f.close()


def detect_config(ckpt: HFDirectory) -> Config:
    """``Config.from_hf`` plus the expert storage read off the headers when config.json
    omits ``expert_dtype`` (FP8 -Base checkpoints store FP8 experts)."""
    cfg = Config.from_hf_dict(ckpt.hf_config, source=os.path.join(ckpt.path, "config.json"))
    if not cfg.quantized:
        return cfg
    probe = next((n for n in sorted(ckpt.tensors) if _EXPERT_PROBE.match(n)), None)
    found = _EXPERT_DTYPES.get(ckpt.dtype(probe)) if probe else None
    if found is None:
        return cfg                  # the inventory check reports what is wrong
    declared = ckpt.hf_config.get("expert_dtype")
    if declared is not None and declared != found:
        raise CheckpointError(f"{ckpt.path}/config.json declares expert_dtype {declared!r} but "
                              f"{probe} is {ckpt.dtype(probe)} ({found} experts)")
    return cfg.replace(expert_dtype=found)


def check_inventory(ckpt: HFDirectory, inventory: list[FileTensor]) -> None:
    """Every expected tensor present with its shape and dtype, nothing else (ignoring only
    ``names.IGNORED_NAMES``); one error lists every problem."""
    expected = {t.name: t for t in inventory}
    present = {n for n in ckpt.tensors if not is_ignored(n)}
    lines = []
    missing = [n for n in expected if n not in present]
    extra = [n for n in present if n not in expected]
    if missing:
        lines.append(f"{len(missing)} missing tensors: {summarize_names(missing)}")
    if extra:
        lines.append(f"{len(extra)} unexpected tensors: {summarize_names(extra)}")
    wrong = []
    for name, t in expected.items():
        if name not in present:
            continue
        st, info = ckpt.tensors[name]
        # scales may be stored as F32 powers of two (FP8 -Base checkpoints)
        ok_dtypes = (t.dtype, "F32") if t.dtype == "F8_E8M0" else (t.dtype,)
        if info.shape != t.shape or info.dtype not in ok_dtypes:
            wrong.append((t.shape, info.shape))
            lines.append(f"{name}: expected {t.dtype}{list(t.shape)}, got "
                         f"{info.dtype}{list(info.shape)} in {os.path.basename(st.path)}")
    cause = _likely_cause(wrong, ckpt)
    raise_if(lines, f"checkpoint {ckpt.path} does not match its config.json"
                    + (f" ({cause})" if cause else "") + ":")


# config.json keys whose value sizes tensors, by Config field
_SIZE_KEYS = {"dim": "hidden_size", "vocab_size": "vocab_size", "q_lora_rank": "q_lora_rank",
              "o_lora_rank": "o_lora_rank", "head_dim": "head_dim",
              "moe_inter_dim": "moe_intermediate_size", "n_routed_experts": "n_routed_experts",
              "index_head_dim": "index_head_dim", "index_n_heads": "index_n_heads"}


def _likely_cause(wrong: list, ckpt: HFDirectory) -> str:
    """The config.json size key that most wrongly shaped tensors disagree with, e.g.
    ``hidden_size is 512 in config.json, but 40 tensors have 256 there``."""
    best = None
    for key in _SIZE_KEYS.values():
        want = ckpt.hf_config.get(key)
        found = Counter(g for w_shape, g_shape in wrong if len(w_shape) == len(g_shape)
                        for w, g in zip(w_shape, g_shape) if w == want and g != want)
        if found and (best is None or sum(found.values()) > best[2]):
            best = (key, want, sum(found.values()), found.most_common(1)[0][0])
    if best is None:
        return ""
    key, want, count, got = best
    return f"{key} is {want} in config.json, but {count} tensors have {got} there"


# ----------------------------------------------------------------------------- reading
@dataclass
class LeafPlan:
    """How one target leaf is built: its file tensors (one per expert when stacked) and, when
    a quantized weight is dequantized into a plain leaf, the matching scale tensors."""
    keys: tuple
    target: jax.ShapeDtypeStruct
    tensors: list
    scales: list | None
    stacked: bool

    @property
    def name(self) -> str:
        return "/".join(self.keys)


def plan_leaves(target_cfg: Config, inventory: list[FileTensor]) -> list[LeafPlan]:
    """One plan per leaf of ``target_cfg``'s tree; every inventory tensor is used once."""
    by_leaf: dict[tuple, list[FileTensor]] = {}
    for t in inventory:
        by_leaf.setdefault(t.leaf, []).append(t)
    target_leaves = flat_leaves(abstract_params(target_cfg))
    target_keys = {k for k, _ in target_leaves}
    plans, used = [], set()
    for keys, sds in target_leaves:
        scale_keys = keys[:-1] + ("scale",)
        dequant = keys[-1] == "weight" and scale_keys in by_leaf and scale_keys not in target_keys
        if keys not in by_leaf:     # target and files differ in more than precision
            raise CheckpointError(f"{'/'.join(keys)}: no checkpoint tensor for this parameter")
        tensors = by_leaf[keys]
        plans.append(LeafPlan(keys, sds, tensors, by_leaf[scale_keys] if dequant else None,
                              stacked=tensors[0].expert is not None))
        used |= {keys, scale_keys} if dequant else {keys}
    unused = ["/".join(k) for k in by_leaf if k not in used]
    if unused:
        raise CheckpointError(f"checkpoint leaves with no target parameter: "
                              f"{summarize_names(unused)}")
    return plans


class LeafReader:
    """``make_array_from_callback`` callback of one leaf: host array of ``leaf[index]``."""

    def __init__(self, ckpt: HFDirectory, plan: LeafPlan, n_experts: int):
        self.ckpt, self.plan, self.n_experts = ckpt, plan, n_experts
        self.dtype = np.dtype(plan.target.dtype)
        self._full = None

    def _one(self, i: int) -> np.ndarray:
        """File tensor ``i`` (one expert, or the whole leaf) in the target dtype."""
        t = self.plan.tensors[i]
        arr = self.ckpt.read(t.name)
        code = self.ckpt.dtype(t.name)
        if self.plan.scales is None:
            return precision.convert(arr, code, self.dtype, t.name, n_experts=self.n_experts)
        s = self.plan.scales[i]
        return precision.dequantize(arr, code, self.ckpt.read(s.name), self.ckpt.dtype(s.name),
                                    self.dtype, t.name)

    def _is_copy(self, i: int) -> bool:
        """File tensor ``i`` is stored exactly as the leaf holds it (no conversion)."""
        return (self.plan.scales is None
                and self.ckpt.dtype(self.plan.tensors[i].name) == _code(self.dtype))

    def __call__(self, index) -> np.ndarray:
        shape = self.plan.target.shape
        index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
        if self.plan.stacked:       # one file tensor per expert: read this shard's experts
            rows = range(*index[0].indices(shape[0]))
            out = np.empty([len(range(*sl.indices(n))) for sl, n in zip(index, shape)],
                           self.dtype)
            for j, e in enumerate(rows):
                out[j] = (self.ckpt.read(self.plan.tensors[e].name, index[1:])
                          if self._is_copy(e) else self._one(e)[index[1:]])
            return out
        if self._is_copy(0):        # plain copy: read just this shard's slice
            return self.ckpt.read(self.plan.tensors[0].name, index)
        if self._full is None:
            self._full = self._one(0)
        return self._full[index]


def _code(dtype) -> str | None:
    try:
        return dtype_code(dtype)
    except TypeError:
        return None


def _nbytes(ckpt: HFDirectory, plan: LeafPlan) -> int:
    return sum(ckpt.tensors[t.name][1].nbytes for t in plan.tensors + (plan.scales or []))


def prepare(path: str, *, dequantize=False, shardings=None, mesh=None, dtype=None,
            progress=None, overrides=None):
    """Validate everything, then return ``(config, groups)``: ``groups`` is a generator of
    ``(group name, params subtree)`` that reads the tensors (see module docstring)."""
    ckpt = HFDirectory(path)
    try:
        file_cfg = detect_config(ckpt)
        target = target_config(file_cfg, overrides or {}, dequantize=dequantize, dtype=dtype)
        stored = checkpoint_precision(target, file_cfg)
        inventory = checkpoint_inventory(stored)
        check_inventory(ckpt, inventory)
        plans = plan_leaves(target, inventory)
        sharding = leaf_shardings(abstract_params(target), shardings, mesh, target)
    except BaseException:
        ckpt.close()
        raise
    return target, _read_groups(ckpt, plans, sharding, target, progress)


def _read_groups(ckpt, plans, sharding, cfg: Config, progress):
    bar = progress_bar(progress, sum(_nbytes(ckpt, p) for p in plans),
                       f"Loading {os.path.basename(os.path.normpath(ckpt.path))}")
    groups: dict[str, list[LeafPlan]] = {}
    for p in plans:
        groups.setdefault(group_of(p.keys), []).append(p)
    try:
        for group, members in groups.items():
            leaves = {}
            for p in members:
                bar.set_postfix_str(p.name, refresh=False)
                reader = LeafReader(ckpt, p, cfg.n_routed_experts)
                leaves[p.keys] = jax.make_array_from_callback(
                    tuple(p.target.shape), sharding[p.keys], reader)
                bar.update(_nbytes(ckpt, p))
            yield group, group_subtree(group, leaves)
    finally:
        bar.close()
        ckpt.close()


def load_hf(path: str, **kwargs):
    """``(config, params)`` from an HF directory (all groups read; see ``prepare``)."""
    cfg, groups = prepare(path, **kwargs)
    return cfg, merge_groups(groups)
