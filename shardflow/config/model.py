"""Model configuration, read from a Hugging Face ``config.json``.

Only what the decoder needs is kept, under names a reader understands; anything the decoder does
not implement is refused here with an error that names the option, before any weight is read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardflow.config.files import read_json

# architecture name -> (family, has value head)
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "LlamaForCausalLM": ("llama", False),
    "MistralForCausalLM": ("mistral", False),
    "Qwen2ForCausalLM": ("qwen2", False),
    "Qwen3ForCausalLM": ("qwen3", False),
    "LlamaForSequenceClassification": ("llama", True),
    "MistralForSequenceClassification": ("mistral", True),
    "Qwen2ForSequenceClassification": ("qwen2", True),
    "Qwen3ForSequenceClassification": ("qwen3", True),
}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    theta: float
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    architecture: str
    family: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None = full attention
    value_head: bool = False  # *ForSequenceClassification with one label: a scalar per token
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    # The checkpoint's config.json as read, written back unchanged when saving.
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(
                f"sliding_windows has {len(self.sliding_windows)} entries for {self.num_layers} layers"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    def __hash__(self) -> int:
        # A key of many caches (sharding, planner): hash the compared fields once.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.compare))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        # string hashes differ between processes: never ship the cached one
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    # ----- sizes used by sharding, the cost model and benchmarks ---------------------------

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_params(self) -> int:
        h = self.hidden_size
        n = h * self.q_size + 2 * h * self.kv_size + self.q_size * h + 3 * h * self.intermediate_size
        n += 2 * h  # two RMSNorms
        if self.qkv_bias:
            n += self.q_size + 2 * self.kv_size
        if self.o_bias:
            n += h
        if self.mlp_bias:
            n += 2 * self.intermediate_size + h
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def head_params(self) -> int:
        """Output projection: the LM head (untied), or the value head."""
        if self.value_head:
            return self.hidden_size
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def num_params(self) -> int:
        return (
            self.embedding_params()
            + self.num_layers * self.layer_params()
            + self.hidden_size
            + self.head_params()
        )

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    # ----- reading --------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, *, key: str = "") -> "ModelConfig":
        """``path``'s config.json (or ``path`` itself, a JSON file); ``key``: the setting that
        named it, for the error when there is none."""
        path = Path(path)
        config_file = path / "config.json" if path.is_dir() else path
        if not config_file.is_file():
            raise FileNotFoundError(f"{key + ': ' if key else ''}no config.json at {config_file}")
        return cls.from_hf_dict(read_json(config_file, "model config"))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        arch_list = raw.get("architectures") or []
        if len(arch_list) != 1:
            raise ValueError(f"config.json must name exactly one architecture, got {arch_list!r}")
        arch = arch_list[0]
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        family, value_head = ARCHITECTURES[arch]

        def need(key: str) -> Any:
            if raw.get(key) is None:
                raise ValueError(f"config.json of {arch} lacks {key!r}")
            return raw[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        layers = int(need("num_hidden_layers"))
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r}; only 'silu' is implemented")
        if value_head and int(raw.get("num_labels", len(raw.get("id2label") or {0: 0}))) != 1:
            raise ValueError(f"{arch} must have num_labels=1 to serve as a value head")
        bias = bool(raw.get("attention_bias", False))
        qkv_bias = {"qwen2": True, "mistral": False}.get(family, bias)
        o_bias = {"qwen2": False, "mistral": False}.get(family, bias)
        mlp_bias = bool(raw.get("mlp_bias", False)) if family == "llama" else False

        return cls(
            architecture=arch,
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_read_rope(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)) and not value_head,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=family == "qwen3",
            sliding_windows=_read_sliding_windows(raw, family, layers),
            value_head=value_head,
            eos_token_ids=_as_id_tuple(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            hf_config=raw,
        )


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _read_rope(raw: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes "rope_parameters"; older checkpoints "rope_theta" + "rope_scaling".
    params = dict(raw.get("rope_parameters") or {})
    if "rope_theta" in raw and "rope_theta" not in params:
        params["rope_theta"] = raw["rope_theta"]
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params} if scaling else params
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor other than 1.0 is not supported")
    theta = float(params.get("rope_theta", 10000.0))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    factor = float(params["factor"])
    if rope_type == "linear":
        return RopeConfig(theta=theta, type="linear", factor=factor)
    return RopeConfig(
        theta=theta,
        type="llama3",
        factor=factor,
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _read_sliding_windows(raw: dict[str, Any], family: str, layers: int) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if family == "llama" or window is None:
        return (None,) * layers
    if family == "mistral":
        return (int(window),) * layers
    # Qwen2/Qwen3: the window applies only where layer_types (or use_sliding_window) says so.
    if not raw.get("use_sliding_window", False):
        return (None,) * layers
    types = raw.get("layer_types")
    if types is None:
        first = int(raw.get("max_window_layers", layers))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)
