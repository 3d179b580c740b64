"""The model configuration, read from a Hugging Face `config.json`: Bamba (`BambaConfig` fields and defaults) or
GraniteMoeHybrid (`GraniteMoeHybridConfig`'s), the `model_type` saying which.

Every field the model's arithmetic depends on is a typed attribute of `ModelConfig`; fields that do not change
what the model computes (generation defaults, bookkeeping written by transformers) are accepted and dropped.
Anything else is an error: a misspelt field silently taking its default is how an oracle goes quietly wrong, and so
is a field of the other family (a Bamba file with `embedding_multiplier` would otherwise be read as if it counted).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A config.json that the oracle cannot interpret unambiguously."""


# Fields that BambaConfig (transformers 5.x) or PreTrainedConfig writes but which do not change the forward pass.
_IGNORED_FIELDS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "num_logits_to_keep", "initializer_range", "z_loss_coefficient", "attention_dropout",
    "pad_token_id", "bos_token_id", "eos_token_id", "output_attentions", "output_hidden_states",
    "return_dict", "id2label", "label2id", "_name_or_path", "chunk_size_feed_forward", "is_encoder_decoder",
    "problem_type", "tokenizer_class", "auto_map", "use_return_dict", "_attn_implementation_autoset",
})

# GraniteMoeHybrid fields that only routing and training read.
_GRANITE_IGNORED_FIELDS = frozenset({"output_router_logits", "router_aux_loss_coef"})

FAMILIES = ("bamba", "granitemoehybrid")
# ModelConfig attributes that only one family's config.json may set; the other family's files leave them at the
# defaults, which are what that family computes (and `model_type` itself says which family a file is).
FAMILY_ONLY: dict[str, frozenset[str]] = {
    "bamba": frozenset({"mlp_bias", "head_dim"}),
    "granitemoehybrid": frozenset({"embedding_multiplier", "residual_multiplier", "attention_multiplier",
                                   "logits_scaling", "num_local_experts", "num_experts_per_tok",
                                   "shared_intermediate_size", "position_embedding_type"}),
}
# GraniteMoeHybridConfig's defaults where they differ from Bamba's (transformers 5.17): what a Granite file that
# leaves a field out means. Its RoPE, when on, rotates the whole head unless rope_parameters says otherwise.
_GRANITE_DEFAULTS: dict = dict(
    vocab_size=32000, intermediate_size=11008, rms_norm_eps=1e-6, max_position_embeddings=2048,
    mamba_d_state=256, partial_rotary_factor=1.0, num_local_experts=8, num_experts_per_tok=2,
    shared_intermediate_size=1024, position_embedding_type=None, num_key_value_heads=None, attention_multiplier=1.0,
)

_MAMBA_TYPES = {"mamba", "linear_attention"}
_ATTENTION_TYPES = {"attention", "full_attention"}


@dataclass(frozen=True)
class ModelConfig:
    """Bamba and GraniteMoeHybrid hyper-parameters with the glossary's letters (docs/design.md §2) beside them.
    Defaults are Bamba's; the Granite-only fields default to what Bamba computes (multipliers 1, no experts)."""

    model_type: str = "bamba"                     # the family: "bamba" or "granitemoehybrid"
    vocab_size: int = 128000                      # V
    hidden_size: int = 4096                       # D
    intermediate_size: int = 14336                # MLP width
    num_hidden_layers: int = 32
    num_attention_heads: int = 32                 # Hq
    num_key_value_heads: int = 8                  # Hkv
    head_dim: int | None = None                   # Dh (hidden_size // Hq when absent)
    attention_bias: bool = False
    mlp_bias: bool = False
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262144
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.5
    attn_layer_indices: tuple[int, ...] = ()
    mamba_n_heads: int = 128                      # H
    mamba_d_head: int | None = None               # P (expand·D / H when "auto")
    mamba_n_groups: int = 1                       # G
    mamba_d_state: int = 256                      # N
    mamba_d_conv: int = 4                         # W
    mamba_expand: int = 2
    mamba_chunk_size: int = 256                   # Q (the oracle ignores it; kernels and boundary scenarios use it)
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    # GraniteMoeHybrid only (FAMILY_ONLY): h0 = embed·m_e; h += m_r·mixer and h += m_r·ffn; attention scale m_a
    # (None: Dh^-½); logits / s; E routed experts (top-k of them per token) beside a shared SwiGLU of width S;
    # RoPE or none (NoPE) in the attention layers.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    num_local_experts: int = 0                    # E (0: the shared MLP alone)
    num_experts_per_tok: int = 0                  # top-k
    shared_intermediate_size: int | None = None   # S (Bamba: its MLP is intermediate_size wide)
    position_embedding_type: str | None = "rope"  # "rope" or None (NoPE)
    extra_ignored: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        self._validate()

    # ---- derived sizes -------------------------------------------------------------------------------------
    @property
    def attn_head_dim(self) -> int:                # Dh
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:                   # R: rotated dims of each attention head (NeoX rotate-half)
        return int(self.attn_head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:            # Dh^-½ unless the config sets attention_multiplier
        return self.attn_head_dim ** -0.5 if self.attention_multiplier is None else self.attention_multiplier

    @property
    def rope(self) -> bool:                        # False: NoPE (GraniteMoeHybrid with position_embedding_type None)
        return self.position_embedding_type == "rope"

    @property
    def granite(self) -> bool:
        return self.model_type == "granitemoehybrid"

    @property
    def mamba_head_dim(self) -> int:               # P
        if self.mamba_d_head is not None:
            return self.mamba_d_head
        return self.mamba_expand * self.hidden_size // self.mamba_n_heads

    @property
    def mamba_inner(self) -> int:                  # H·P
        return self.mamba_n_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:                     # channels of x|B|C: H·P + 2·G·N
        return self.mamba_inner + 2 * self.mamba_n_groups * self.mamba_d_state

    @property
    def in_proj_dim(self) -> int:                  # z | xBC | dt
        return self.mamba_inner + self.conv_dim + self.mamba_n_heads

    @property
    def gated_norm_group_size(self) -> int:        # H·P/G: the gated RMSNorm normalises each group separately
        return self.mamba_inner // self.mamba_n_groups

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple("attention" if i in self.attn_layer_indices else "mamba" for i in range(self.num_hidden_layers))

    @property
    def mamba_layer_indices(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if i not in self.attn_layer_indices)

    # ---- validation ----------------------------------------------------------------------------------------
    def _validate(self) -> None:
        if self.model_type not in FAMILIES:
            raise ConfigError(f"model_type: expected one of {list(FAMILIES)}, got {self.model_type!r}")
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "mamba_n_heads", "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
                    "mamba_expand", "mamba_chunk_size", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}: expected a positive integer, got {value!r}")
        if self.mamba_d_head is None and (self.mamba_expand * self.hidden_size) % self.mamba_n_heads:
            raise ConfigError(
                f"mamba_d_head is 'auto' but mamba_expand·hidden_size = {self.mamba_expand * self.hidden_size} "
                f"is not divisible by mamba_n_heads = {self.mamba_n_heads}")
        if self.mamba_head_dim * self.mamba_n_heads != self.mamba_expand * self.hidden_size:
            raise ConfigError(
                f"mamba heads·head_dim = {self.mamba_n_heads}·{self.mamba_head_dim} = "
                f"{self.mamba_n_heads * self.mamba_head_dim} must equal mamba_expand·hidden_size = "
                f"{self.mamba_expand}·{self.hidden_size} = {self.mamba_expand * self.hidden_size}")
        if self.mamba_n_heads % self.mamba_n_groups:
            raise ConfigError(f"mamba_n_heads = {self.mamba_n_heads} is not divisible by "
                              f"mamba_n_groups = {self.mamba_n_groups}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads = {self.num_attention_heads} is not divisible by "
                              f"num_key_value_heads = {self.num_key_value_heads}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"hidden_size = {self.hidden_size} is not divisible by "
                              f"num_attention_heads = {self.num_attention_heads} and head_dim is not given")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ConfigError(f"partial_rotary_factor: expected in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dim % 2:
            raise ConfigError(f"rotary dims = head_dim·partial_rotary_factor = {self.rotary_dim} must be even")
        bad = [i for i in self.attn_layer_indices if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ConfigError(f"attn_layer_indices: {bad} outside [0, {self.num_hidden_layers})")
        if len(set(self.attn_layer_indices)) != len(self.attn_layer_indices):
            raise ConfigError(f"attn_layer_indices: duplicates in {list(self.attn_layer_indices)}")
        lo, hi = self.time_step_limit
        if not 0.0 <= lo <= hi:
            raise ConfigError(f"time_step_limit: expected 0 <= low <= high, got {self.time_step_limit}")
        if self.rms_norm_eps <= 0:
            raise ConfigError(f"rms_norm_eps: expected > 0, got {self.rms_norm_eps}")
        self._validate_granite()

    def _validate_granite(self) -> None:
        E, k = self.num_local_experts, self.num_experts_per_tok
        for name in ("num_local_experts", "num_experts_per_tok"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name}: expected a non-negative integer, got {value!r}")
        if E and not 1 <= k <= E:
            raise ConfigError(f"num_experts_per_tok = {k}: expected 1..num_local_experts = {E}")
        if self.granite and (not isinstance(self.shared_intermediate_size, int)
                             or isinstance(self.shared_intermediate_size, bool) or self.shared_intermediate_size < 1):
            raise ConfigError(f"shared_intermediate_size: expected a positive integer, got "
                              f"{self.shared_intermediate_size!r}")
        if self.position_embedding_type not in ("rope", None):
            raise ConfigError(f"position_embedding_type: expected 'rope' or none (NoPE), got "
                              f"{self.position_embedding_type!r}")
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
            if not isinstance(getattr(self, name), (int, float)) or isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: expected a number, got {getattr(self, name)!r}")
        if self.logits_scaling == 0:
            raise ConfigError("logits_scaling: the logits are divided by it, got 0")
        if not self.granite:
            moved = [f for f in sorted(FAMILY_ONLY["granitemoehybrid"])
                     if getattr(self, f) != getattr(ModelConfig, f, None)]
            if moved:
                raise ConfigError(f"{moved}: GraniteMoeHybrid fields in a {self.model_type} config")

    # ---- reading -------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        """Build from the fields of a config.json; unknown or contradictory fields raise ConfigError."""
        raw = dict(raw)
        family = raw.pop("model_type", "bamba")
        if family not in FAMILIES:
            raise ConfigError(f"model_type: expected one of {list(FAMILIES)}, got {family!r}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act: only 'silu' is defined for {family}, got {raw['hidden_act']!r}")
        raw.pop("hidden_act", None)
        kwargs: dict = {"model_type": family}
        other = next(f for f in FAMILIES if f != family)
        known = {f for f in cls.__dataclass_fields__ if f not in ("extra_ignored", "model_type")} - FAMILY_ONLY[other]
        foreign = sorted(k for k in raw if k in FAMILY_ONLY[other] or (family == "granitemoehybrid"
                                                                       and k == "attn_layer_indices"))
        if foreign:
            why = ("GraniteMoeHybrid places attention by layer_types and derives the head dim as hidden_size // heads"
                   if family == "granitemoehybrid" else "BambaConfig has no multipliers, experts or NoPE")
            raise ConfigError(f"{foreign}: not {family} config fields ({why})")
        _check_types(raw)
        if family == "granitemoehybrid":
            raw = {**_GRANITE_DEFAULTS, **raw}
            if raw["position_embedding_type"] == "nope":        # Granite 4.0-H files spell NoPE so
                raw["position_embedding_type"] = None
            for name in _GRANITE_IGNORED_FIELDS & set(raw):
                raw.pop(name)

        # RoPE: transformers 5.x keeps it in rope_parameters; older files have top-level rope_theta.
        rope = raw.pop("rope_parameters", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_parameters.rope_type: only 'default' RoPE is defined here, got {rope_type!r}")
        unknown_rope = set(rope) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
        if unknown_rope:
            raise ConfigError(f"rope_parameters: unknown fields {sorted(unknown_rope)}")
        top_theta, top_partial = raw.pop("rope_theta", None), raw.pop("partial_rotary_factor", None)
        theta = rope.get("rope_theta", top_theta)
        if theta is not None:
            kwargs["rope_theta"] = float(theta)
        partial = rope.get("partial_rotary_factor", top_partial)
        if partial is not None:
            kwargs["partial_rotary_factor"] = float(partial)

        # Layer placement: attn_layer_indices, or a per-layer list (layer_types / layers_block_type).
        indices = raw.pop("attn_layer_indices", None)
        types = raw.pop("layer_types", None)
        block_types = raw.pop("layers_block_type", None)
        if types is not None and block_types is not None and list(types) != list(block_types):
            raise ConfigError("layer_types and layers_block_type disagree")
        types = types if types is not None else block_types
        if types is not None:
            unknown = sorted({t for t in types} - _MAMBA_TYPES - _ATTENTION_TYPES)
            if unknown:
                raise ConfigError(f"layer_types: unknown layer types {unknown}")
            n_layers = raw.get("num_hidden_layers", cls.num_hidden_layers)
            if len(types) != n_layers:
                raise ConfigError(f"layer_types has {len(types)} entries, num_hidden_layers is {n_layers}")
            from_types = [i for i, t in enumerate(types) if t in _ATTENTION_TYPES]
            if indices is not None and sorted(indices) != from_types:
                raise ConfigError(f"attn_layer_indices = {sorted(indices)} contradicts layer_types {from_types}")
            indices = from_types
        kwargs["attn_layer_indices"] = tuple(sorted(indices or ()))

        if "mamba_d_head" in raw:
            head = raw.pop("mamba_d_head")
            kwargs["mamba_d_head"] = None if head == "auto" else head
        if "head_dim" in raw:
            kwargs["head_dim"] = raw.pop("head_dim")
        if "num_key_value_heads" in raw and raw["num_key_value_heads"] is None:
            raw["num_key_value_heads"] = raw.get("num_attention_heads", cls.num_attention_heads)
        if "time_step_limit" in raw:
            limit = raw.pop("time_step_limit")
            kwargs["time_step_limit"] = (0.0, math.inf) if limit is None else tuple(_json_float(v) for v in limit)

        ignored = sorted(k for k in raw if k in _IGNORED_FIELDS)
        unknown = sorted(k for k in raw if k not in _IGNORED_FIELDS and k not in known)
        if unknown:
            kind = "BambaConfig" if family == "bamba" else "GraniteMoeHybridConfig"
            raise ConfigError(f"unknown config fields {unknown}: not {kind} fields (a typo would otherwise "
                              "silently take the default)")
        for key in known & set(raw):
            kwargs[key] = raw[key]
        return cls(**kwargs, extra_ignored=tuple(ignored))

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no such config file")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON ({err})") from err
        except (UnicodeDecodeError, RecursionError) as err:
            raise ConfigError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(raw, dict):
            text = json.dumps(raw)
            raise ConfigError(f"{path}: expected a JSON object of config fields, got "
                              f"{text if len(text) <= 40 else text[:37] + '...'}")
        try:
            return cls.from_dict(raw)
        except ConfigError as err:                  # every message names its field; this names the file
            raise ConfigError(f"{path}: {err}") from None
        except (TypeError, ValueError, AttributeError) as err:   # a shape no check above foresaw: still the file
            raise ConfigError(f"{path}: cannot be interpreted ({type(err).__name__}: {err})") from err


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value) -> bool:
    return _is_number(value) and math.isfinite(value)


def _is_float_json(value) -> bool:
    """What _json_float reads: a number, a numeric string, or transformers' {"__float__": "Infinity"}."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return False
        return True
    return _is_number(value)


_POSITIVE_INT = ("a positive integer", lambda v: _is_int(v) and v >= 1)
_NON_NEGATIVE_INT = ("a non-negative integer", lambda v: _is_int(v) and v >= 0)
_BOOL = ("true or false", lambda v: isinstance(v, bool))
_NUMBER = ("a finite number", _is_finite)            # JSON's NaN and Infinity are Python's, never meant here
_OR_NULL = lambda kind: (f"{kind[0]} or null", lambda v: v is None or kind[1](v))      # noqa: E731
_LIST_OF = lambda what, ok: (f"a list of {what}", lambda v: isinstance(v, (list, tuple))   # noqa: E731
                             and all(ok(x) for x in v))
# The JSON type of each config.json field the reader interprets: checked before anything computes with one, so that
# "hidden_size": "128" or "rms_norm_eps": "1e-5" is named as such rather than surfacing as a TypeError elsewhere.
# Value constraints beyond the type (ranges, divisibility) are ModelConfig._validate's.
_FIELD_TYPES: dict[str, tuple[str, object]] = {
    **{name: _POSITIVE_INT for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                        "num_attention_heads", "mamba_n_heads", "mamba_n_groups", "mamba_d_state",
                                        "mamba_d_conv", "mamba_expand", "mamba_chunk_size", "max_position_embeddings",
                                        "shared_intermediate_size")},
    **{name: _OR_NULL(_POSITIVE_INT) for name in ("num_key_value_heads", "head_dim")},
    "mamba_d_head": ("'auto' or a positive integer", lambda v: v in (None, "auto") or _POSITIVE_INT[1](v)),
    **{name: _NON_NEGATIVE_INT for name in ("num_local_experts", "num_experts_per_tok")},
    **{name: _BOOL for name in ("attention_bias", "mlp_bias", "tie_word_embeddings", "mamba_conv_bias",
                                "mamba_proj_bias")},
    **{name: _NUMBER for name in ("rms_norm_eps", "embedding_multiplier", "residual_multiplier", "logits_scaling")},
    **{name: _OR_NULL(_NUMBER) for name in ("rope_theta", "partial_rotary_factor", "attention_multiplier")},
    "position_embedding_type": _OR_NULL(("a string", lambda v: isinstance(v, str))),
    "attn_layer_indices": _OR_NULL(_LIST_OF("non-negative integers", lambda x: _is_int(x) and x >= 0)),
    **{name: _OR_NULL(_LIST_OF("strings", lambda x: isinstance(x, str))) for name in ("layer_types",
                                                                                       "layers_block_type")},
    "rope_parameters": _OR_NULL(("an object", lambda v: isinstance(v, dict))),
    "time_step_limit": _OR_NULL(("a list of two numbers", lambda v: isinstance(v, (list, tuple)) and len(v) == 2
                                 and all(_is_float_json(x) for x in v))),
}
_ROPE_FIELD_TYPES: dict[str, tuple[str, object]] = {
    "rope_type": ("a string", lambda v: isinstance(v, str)), "type": ("a string", lambda v: isinstance(v, str)),
    "rope_theta": _NUMBER, "partial_rotary_factor": _NUMBER,
}


def _check_types(raw: dict) -> None:
    """ConfigError `field: expected <type>, got <value>` for the first field of `raw` of the wrong JSON type."""
    for name, (what, ok) in _FIELD_TYPES.items():
        if name in raw and not ok(raw[name]):
            raise ConfigError(f"{name}: expected {what}, got {raw[name]!r}")
    for name, (what, ok) in _ROPE_FIELD_TYPES.items():
        rope = raw.get("rope_parameters") or {}
        if name in rope and not ok(rope[name]):
            raise ConfigError(f"rope_parameters.{name}: expected {what}, got {rope[name]!r}")


def _json_float(value) -> float:
    """transformers writes infinity as {"__float__": "Infinity"}; plain JSON numbers and strings are accepted too."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    return float(value)
