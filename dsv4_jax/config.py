"""Model configuration: the published DeepSeek-V4 variants, HF ``config.json`` and a tiny one."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

__all__ = ["Config", "CSA_RATIO", "HCA_RATIO", "compressor_overlap"]

# Compression ratio -> layer kind (docs/architecture.md §2.2): the one place that spells it.
CSA_RATIO, HCA_RATIO = 4, 128
_KINDS = {0: "swa", CSA_RATIO: "csa", HCA_RATIO: "hca"}
_RATIOS = tuple(_KINDS)
_DTYPES = ("bfloat16", "float32")
_EXPERT_DTYPES = ("fp4", "fp8")
_EXPERT_LAYOUTS = ("rows", "blocked")


def _doc(text: str, default: Any = dataclasses.MISSING, **kw):
    """A dataclass field carrying its own docstring in ``metadata['doc']``."""
    return dataclasses.field(default=default, metadata={"doc": text}, **kw)


@dataclasses.dataclass(frozen=True)
class Config:
    """DeepSeek-V4 hyper-parameters (names follow the official ``ModelArgs``;
    docs/architecture.md §2.1).

    Frozen and hashable (tuples only), so it can be a static argument of ``jax.jit``.
    Build it with ``Config.flash()``, ``Config.pro()``, ``Config.from_hf(dir)`` or
    ``Config.tiny()``; ``dataclasses.replace(cfg, field=value)`` derives variants and
    re-validates. Each field's docstring is in ``Config.field_doc(name)``.
    """

    vocab_size: int = _doc("Vocabulary size (rows of the embedding and of the LM head).", 129280)
    dim: int = _doc("Hidden size d of the residual stream (each of the hc_mult streams).", 4096)
    n_layers: int = _doc("Number of transformer blocks (MTP blocks not included).", 43)
    n_heads: int = _doc("Attention query heads; all share one 512-d KV entry (MQA).", 64)
    head_dim: int = _doc("Width c of a query head and of a KV entry (key = value).", 512)
    rope_head_dim: int = _doc("Trailing dims of each head / entry that get RoPE (interleaved pairs).", 64)
    q_lora_rank: int = _doc("Rank d_c of the low-rank query path (wq_a -> q_norm -> wq_b).", 1024)
    o_groups: int = _doc("Groups g of the grouped output projection (wo_a per group).", 8)
    o_lora_rank: int = _doc("Per-group rank d_g of the output projection.", 1024)
    window_size: int = _doc("Sliding window n_win of uncompressed entries (includes the current token).", 128)
    compress_ratios: tuple = _doc(
        "Per layer (then per MTP block) compression ratio: 0 SWA-only, 4 CSA, 128 HCA.",
        (0, 0) + (4, 128) * 20 + (4, 0))
    rope_theta: float = _doc("RoPE base of SWA-only layers and of the MTP block (no YaRN).", 10000.0)
    compress_rope_theta: float = _doc("RoPE base of CSA/HCA layers, their compressors and indexer.", 160000.0)
    rope_factor: float = _doc("YaRN frequency interpolation factor (compressed layers only).", 16.0)
    original_seq_len: int = _doc("YaRN original context; 0 disables YaRN everywhere.", 65536)
    beta_fast: int = _doc("YaRN beta_fast (rotations where interpolation starts).", 32)
    beta_slow: int = _doc("YaRN beta_slow (rotations where interpolation is complete).", 1)
    index_n_heads: int = _doc("Heads of the lightning indexer (CSA layers).", 64)
    index_head_dim: int = _doc("Head width of the indexer; a power of two (Hadamard rotation).", 128)
    index_topk: int = _doc("Compressed entries each query selects in CSA layers.", 512)
    n_routed_experts: int = _doc("Routed experts per MoE layer.", 256)
    n_activated_experts: int = _doc("Routed experts per token (top-k).", 6)
    n_shared_experts: int = _doc("Shared experts (always 1 in DSV4).", 1)
    moe_inter_dim: int = _doc("Intermediate width of each routed and shared SwiGLU expert.", 2048)
    n_hash_layers: int = _doc("The first n layers route by a fixed token-id -> experts table.", 3)
    score_func: str = _doc("Router affinity: 'sqrtsoftplus' (DSV4), 'sigmoid' or 'softmax'.", "sqrtsoftplus")
    route_scale: float = _doc("Routed-weight multiplier after normalisation.", 1.5)
    swiglu_limit: float = _doc("SwiGLU clamp: up to [-l, l], gate to <= l (0 disables).", 10.0)
    hc_mult: int = _doc("Residual streams of the manifold-constrained hyper-connections.", 4)
    hc_sinkhorn_iters: int = _doc("Sinkhorn iterations of the mHC residual mixing matrix.", 20)
    hc_eps: float = _doc("Epsilon of the mHC maps (pre weights and Sinkhorn).", 1e-6)
    norm_eps: float = _doc("Epsilon of every RMSNorm.", 1e-6)
    n_mtp_layers: int = _doc("Multi-token-prediction blocks (speculative drafting).", 1)
    dtype: str = _doc("Activation / compute dtype: 'bfloat16' (reference) or 'float32'.", "bfloat16")
    quantized: bool = _doc(
        "Keep weights in checkpoint precision: FP8 e4m3 + E8M0 128x128 scales for the FP8 "
        "families, routed experts per expert_dtype. False: plain weights in `dtype`.", False)
    expert_dtype: str = _doc("Routed-expert storage when quantized: 'fp4' (MXFP4, 1x32 E8M0) or 'fp8'.", "fp4")
    expert_layout: str = _doc(
        "How packed FP4 routed-expert weights lie in memory: 'rows' ([E, out, in/2], the "
        "checkpoints' layout) or 'blocked' ([E, out/64, in/128, 64, 64]: contiguous 64-row x "
        "128-code tiles, which the decode kernels read faster; the same values). "
        "`load` gives 'blocked' for FP4 experts unless told `expert_layout='rows'`; "
        "`dsv4_jax.block_expert_weights` converts a tree.",
        "rows")
    quant_simulation: bool = _doc(
        "Reproduce the official quantisation steps: FP8 activations before FP8/FP4 GEMMs, FP8 "
        "simulation of KV entries, FP4 simulation of indexer queries/keys. False skips them all "
        "(quantised weights are then dequantised exactly and multiplied in f32).", True)
    bos_token_id: int = _doc("Beginning-of-sequence token id.", 0)
    eos_token_id: int = _doc("End-of-sequence token id (default stop token).", 1)

    def __post_init__(self):
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        self.validate()

    # ---------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise ``ValueError`` naming the fields when the configuration is inconsistent."""
        def need(cond, msg):
            if not cond:
                raise ValueError(f"Config: {msg}")

        for name in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "q_lora_rank",
                     "o_groups", "o_lora_rank", "window_size", "index_n_heads", "index_head_dim",
                     "n_routed_experts", "n_activated_experts", "moe_inter_dim", "hc_mult",
                     "hc_sinkhorn_iters"):
            v = getattr(self, name)
            need(isinstance(v, int) and v > 0, f"{name} must be a positive int, got {v!r}")
        need(self.n_heads % self.o_groups == 0,
             f"n_heads ({self.n_heads}) % o_groups ({self.o_groups}) != 0")
        need(0 < self.rope_head_dim < self.head_dim and self.rope_head_dim % 2 == 0,
             f"rope_head_dim ({self.rope_head_dim}) must be even and in (0, head_dim={self.head_dim})")
        need(self.rope_head_dim < self.index_head_dim,
             f"rope_head_dim ({self.rope_head_dim}) must be < index_head_dim ({self.index_head_dim})")
        need(self.index_head_dim & (self.index_head_dim - 1) == 0,
             f"index_head_dim ({self.index_head_dim}) must be a power of two (Hadamard rotation)")
        n_total = self.n_layers + self.n_mtp_layers
        need(len(self.compress_ratios) == n_total,
             f"compress_ratios has {len(self.compress_ratios)} entries, expected n_layers + "
             f"n_mtp_layers = {self.n_layers} + {self.n_mtp_layers}")
        need(all(r in _RATIOS for r in self.compress_ratios),
             f"compress_ratios entries must be in {_RATIOS}, got {self.compress_ratios}")
        need(all(r == 0 for r in self.compress_ratios[self.n_layers:]),
             f"MTP blocks are SWA-only: compress_ratios[{self.n_layers}:] must be 0")
        need(self.n_activated_experts <= self.n_routed_experts,
             f"n_activated_experts ({self.n_activated_experts}) > n_routed_experts "
             f"({self.n_routed_experts})")
        need(self.n_shared_experts == 1, f"n_shared_experts must be 1, got {self.n_shared_experts}")
        need(0 <= self.n_hash_layers <= self.n_layers,
             f"n_hash_layers ({self.n_hash_layers}) must be in [0, n_layers={self.n_layers}]")
        need(self.n_mtp_layers >= 0, f"n_mtp_layers must be >= 0, got {self.n_mtp_layers}")
        need(self.score_func in ("sqrtsoftplus", "sigmoid", "softmax"),
             f"score_func must be sqrtsoftplus/sigmoid/softmax, got {self.score_func!r}")
        need(self.index_topk > 0, f"index_topk must be > 0, got {self.index_topk}")
        need(self.dtype in _DTYPES, f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        need(self.expert_dtype in _EXPERT_DTYPES,
             f"expert_dtype must be one of {_EXPERT_DTYPES}, got {self.expert_dtype!r}")
        need(self.expert_layout in _EXPERT_LAYOUTS,
             f"expert_layout must be one of {_EXPERT_LAYOUTS}, got {self.expert_layout!r}")
        need(self.expert_layout == "rows" or (self.quantized and self.expert_dtype == "fp4"),
             f"expert_layout 'blocked' is a layout of packed FP4 experts (quantized=True, "
             f"expert_dtype='fp4'); got quantized={self.quantized}, "
             f"expert_dtype={self.expert_dtype!r}")
        need(self.dim % 128 == 0 and self.q_lora_rank % 128 == 0 and self.moe_inter_dim % 128 == 0
             and self.o_lora_rank % 128 == 0,
             "dim, q_lora_rank, o_lora_rank and moe_inter_dim must be multiples of 128 "
             "(FP8 activation blocks)")
        need((self.head_dim - self.rope_head_dim) % 64 == 0,
             f"head_dim - rope_head_dim ({self.head_dim - self.rope_head_dim}) must be a multiple "
             "of 64 (FP8 KV simulation blocks)")
        need(self.index_head_dim % 32 == 0, "index_head_dim must be a multiple of 32 (FP4 blocks)")
        for name in ("quantized", "quant_simulation"):
            need(isinstance(getattr(self, name), bool), f"{name} must be a bool")

    # ---------------------------------------------------------------- derived
    @property
    def n_hc_mixes(self) -> int:
        """Rows of an mHC ``fn`` matrix: pre (n) + post (n) + comb (n*n)."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def max_positions(self) -> int | None:
        """Positions the model's RoPE is configured for: ``original_seq_len x rope_factor``
        with YaRN (the official context length), None without YaRN (no stated range).
        Generation refuses prompts + budgets beyond it."""
        if not self.original_seq_len:
            return None
        return int(self.original_seq_len * self.rope_factor)

    def layer_kind(self, layer_id: int) -> str:
        """``"swa"`` (ratio 0: window only), ``"csa"`` (ratio 4: overlapping compressor and
        lightning indexer) or ``"hca"`` (ratio 128: every compressed entry) of block
        ``layer_id`` (MTP blocks follow the main layers)."""
        return _KINDS[self.compress_ratios[layer_id]]

    @staticmethod
    def field_doc(name: str) -> str:
        """The docstring of field ``name``."""
        for f in dataclasses.fields(Config):
            if f.name == name:
                return f.metadata["doc"]
        raise KeyError(name)

    def replace(self, **changes) -> "Config":
        """``dataclasses.replace`` with a ``TypeError`` naming unknown or mistyped fields."""
        return dataclasses.replace(self, **_check_overrides(changes))

    # ---------------------------------------------------------------- presets
    @classmethod
    def flash(cls, **overrides) -> "Config":
        """DeepSeek-V4-Flash (284B total / 13B active), HF config of the April 2026 release."""
        base = dict(vocab_size=129280, dim=4096, n_layers=43, n_heads=64, q_lora_rank=1024,
                    o_groups=8, o_lora_rank=1024, compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0),
                    index_topk=512, n_routed_experts=256, moe_inter_dim=2048, route_scale=1.5)
        return cls(**{**base, **_check_overrides(overrides)})

    @classmethod
    def pro(cls, **overrides) -> "Config":
        """DeepSeek-V4-Pro (1.6T total / 49B active)."""
        base = dict(vocab_size=129280, dim=7168, n_layers=61, n_heads=128, q_lora_rank=1536,
                    o_groups=16, o_lora_rank=1024,
                    compress_ratios=(128, 128) + (4, 128) * 29 + (4, 0),
                    index_topk=1024, n_routed_experts=384, moe_inter_dim=3072, route_scale=2.5)
        return cls(**{**base, **_check_overrides(overrides)})

    @classmethod
    def tiny(cls, **overrides) -> "Config":
        """CPU-sized model with every structural feature of DSV4.

        Layers: 0 SWA-only + hash routing, 1 CSA (indexer) + hash routing, 2 HCA + biased
        routing, 3 CSA + biased routing, then one SWA-only MTP block. head_dim 512, rope 64,
        indexer head dim 128, window 128 and top-k 16 (so selection is sparse within a few
        hundred tokens), 8 experts with 2 active plus the shared expert.
        """
        base = dict(vocab_size=1024, dim=256, n_layers=4, n_heads=4, q_lora_rank=128,
                    o_groups=2, o_lora_rank=128, compress_ratios=(0, 4, 128, 4, 0),
                    index_n_heads=4, index_topk=16, n_routed_experts=8, n_activated_experts=2,
                    moe_inter_dim=128, n_hash_layers=2, route_scale=1.5)
        return cls(**{**base, **_check_overrides(overrides)})

    # ---------------------------------------------------------------- HF config.json
    @classmethod
    def from_hf(cls, path: str | os.PathLike, **overrides) -> "Config":
        """Read an HF ``config.json`` (file or directory holding one); ``overrides`` win."""
        path = os.fspath(path)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"Config.from_hf: no config.json at {path!r}")
        with open(file) as f:
            try:
                hf = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{file} is not valid JSON: {e}") from None
        return cls.from_hf_dict(hf, source=file, **overrides)

    @classmethod
    def from_hf_dict(cls, hf: dict, *, source: str = "config.json", **overrides) -> "Config":
        """Build from the parsed HF ``config.json`` dictionary (key names: docs/architecture.md
        §2.1). A missing or ill-typed key raises a one-line ValueError naming it and
        ``source``."""
        overrides = _check_overrides(overrides)
        if not isinstance(hf, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(hf).__name__}")
        hf = _HFKeys(hf, source)
        arch = hf.get("architectures") or []
        model_type = hf.get("model_type", "")
        if not (any("DeepseekV4" in a for a in arch) or model_type in ("deepseek_v4", "deepseek4")):
            raise ValueError(f"Config.from_hf: unsupported architecture {arch or model_type!r}; "
                             "expected DeepseekV4ForCausalLM / model_type 'deepseek_v4'")
        rs = hf.get("rope_scaling") or {}
        n_layers = hf["num_hidden_layers"]
        n_mtp = hf.get("num_nextn_predict_layers", 1)
        ratios = tuple(hf["compress_ratios"])
        if len(ratios) == n_layers:          # some dumps omit the MTP entry
            ratios = ratios + (0,) * n_mtp
        quant = hf.get("quantization_config") or {}
        fields = dict(
            vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=n_layers,
            n_heads=hf["num_attention_heads"], head_dim=hf.get("head_dim", 512),
            rope_head_dim=hf.get("qk_rope_head_dim", 64), q_lora_rank=hf["q_lora_rank"],
            o_groups=hf["o_groups"], o_lora_rank=hf["o_lora_rank"],
            window_size=hf.get("sliding_window", 128), compress_ratios=ratios,
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            compress_rope_theta=float(hf.get("compress_rope_theta", 160000.0)),
            rope_factor=float(rs.get("factor", 16.0)),
            original_seq_len=int(rs.get("original_max_position_embeddings", 65536)) if rs else 0,
            beta_fast=int(rs.get("beta_fast", 32)), beta_slow=int(rs.get("beta_slow", 1)),
            index_n_heads=hf.get("index_n_heads", 64), index_head_dim=hf.get("index_head_dim", 128),
            index_topk=hf.get("index_topk", 512), n_routed_experts=hf["n_routed_experts"],
            n_activated_experts=hf["num_experts_per_tok"],
            n_shared_experts=hf.get("n_shared_experts", 1),
            moe_inter_dim=hf["moe_intermediate_size"],
            n_hash_layers=hf.get("num_hash_layers", 0),
            score_func=hf.get("scoring_func", "sqrtsoftplus"),
            route_scale=float(hf.get("routed_scaling_factor", 1.0)),
            swiglu_limit=float(hf.get("swiglu_limit", 0.0)), hc_mult=hf.get("hc_mult", 4),
            hc_sinkhorn_iters=hf.get("hc_sinkhorn_iters", 20), hc_eps=hf.get("hc_eps", 1e-6),
            norm_eps=hf.get("rms_norm_eps", 1e-6), n_mtp_layers=n_mtp,
            quantized=bool(quant), expert_dtype=hf.get("expert_dtype", "fp4") if quant else "fp4",
            bos_token_id=hf.get("bos_token_id", 0), eos_token_id=_first(hf.get("eos_token_id", 1)),
        )
        return cls(**{**fields, **overrides})

    def to_hf_dict(self) -> dict:
        """The HF ``config.json`` dictionary of this configuration (inverse of from_hf_dict)."""
        d = dict(
            architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4",
            vocab_size=self.vocab_size, hidden_size=self.dim, num_hidden_layers=self.n_layers,
            num_attention_heads=self.n_heads, num_key_value_heads=1, head_dim=self.head_dim,
            qk_rope_head_dim=self.rope_head_dim, q_lora_rank=self.q_lora_rank,
            o_groups=self.o_groups, o_lora_rank=self.o_lora_rank, sliding_window=self.window_size,
            compress_ratios=list(self.compress_ratios), rope_theta=self.rope_theta,
            compress_rope_theta=self.compress_rope_theta, index_n_heads=self.index_n_heads,
            index_head_dim=self.index_head_dim, index_topk=self.index_topk,
            n_routed_experts=self.n_routed_experts, num_experts_per_tok=self.n_activated_experts,
            n_shared_experts=self.n_shared_experts, moe_intermediate_size=self.moe_inter_dim,
            num_hash_layers=self.n_hash_layers, scoring_func=self.score_func,
            topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=self.route_scale,
            swiglu_limit=self.swiglu_limit, hidden_act="silu", hc_mult=self.hc_mult,
            hc_sinkhorn_iters=self.hc_sinkhorn_iters, hc_eps=self.hc_eps,
            rms_norm_eps=self.norm_eps, num_nextn_predict_layers=self.n_mtp_layers,
            max_position_embeddings=1048576, bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id, tie_word_embeddings=False, torch_dtype="bfloat16",
        )
        if self.original_seq_len > 0:
            d["rope_scaling"] = dict(type="yarn", factor=self.rope_factor,
                                     original_max_position_embeddings=self.original_seq_len,
                                     beta_fast=self.beta_fast, beta_slow=self.beta_slow)
        if self.quantized:
            d["quantization_config"] = dict(quant_method="fp8", fmt="e4m3",
                                            activation_scheme="dynamic",
                                            weight_block_size=[128, 128], scale_fmt="ue8m0")
            d["expert_dtype"] = self.expert_dtype
        return d


def compressor_overlap(ratio: int) -> int:
    """``coff``: 2 for CSA's overlapping compressor (each entry pools two blocks), else 1."""
    return 2 if ratio == CSA_RATIO else 1


def _first(v):
    return v[0] if isinstance(v, (list, tuple)) else v


class _HFKeys:
    """``config.json`` read with type checks: a missing or ill-typed key is one ValueError
    naming the key and the file (not a KeyError traceback, nor a Config error under our
    field name)."""
    _TYPES = {"architectures": list, "model_type": str, "rope_scaling": dict,
              "quantization_config": dict, "compress_ratios": list, "scoring_func": str,
              "expert_dtype": str, "eos_token_id": (int, list)}
    _FLOATS = {"rope_theta", "compress_rope_theta", "routed_scaling_factor", "swiglu_limit",
               "hc_eps", "rms_norm_eps"}

    def __init__(self, hf: dict, source: str):
        self.hf, self.source = hf, source

    def __getitem__(self, key):
        if key not in self.hf:
            raise ValueError(f"{self.source}: required key {key!r} is missing")
        return self._checked(key, self.hf[key])

    def get(self, key, default=None):
        value = self.hf.get(key)
        return default if value is None else self._checked(key, value)

    def _checked(self, key, value):
        want = self._TYPES.get(key, float if key in self._FLOATS else int)
        ok = isinstance(value, want) and not isinstance(value, bool)
        if want is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key == "compress_ratios" and ok:
            ok = all(isinstance(r, int) and not isinstance(r, bool) for r in value)
        if not ok:
            kind = {list: "a list", dict: "an object", str: "a string", float: "a number",
                    int: "an integer"}.get(want, "an integer or a list of integers")
            what = "a list of integers" if key == "compress_ratios" else kind
            raise ValueError(f"{self.source}: key {key!r} must be {what}, got {value!r}")
        return value


_FIELD_TYPES = None


def _check_overrides(overrides: dict) -> dict:
    """``TypeError`` for overrides that are not Config fields or have the wrong type."""
    global _FIELD_TYPES
    if _FIELD_TYPES is None:
        _FIELD_TYPES = {f.name: type(f.default) for f in dataclasses.fields(Config)}
    for k, v in overrides.items():
        if k not in _FIELD_TYPES:
            raise TypeError(f"Config: unknown field {k!r} (fields: {', '.join(sorted(_FIELD_TYPES))})")
        want = _FIELD_TYPES[k]
        ok = isinstance(v, want) and not (want is int and isinstance(v, bool))
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            ok = True
        if want is tuple and isinstance(v, list):
            ok = True
        if not ok:
            raise TypeError(f"Config: field {k!r} expects {want.__name__}, got "
                            f"{type(v).__name__} {v!r}")
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in overrides.items()}
