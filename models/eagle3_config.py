"""Shape of an EAGLE-3 drafter (`models.eagle3`): its config dataclass, built from the target's HF config, and the
reading of a checkpoint's config.json before any weights (so the matching target can be built first)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import LlamaConfig, PreTrainedConfig

from models.checkpoint import TargetInfo, read_checkpoint
from models.config import from_dict

METHOD = "eagle3"


@dataclass
class Eagle3Config:
    """Shape of an EAGLE-3 drafter. Build it with `from_target` so rope and sizes follow the target."""

    hidden_size: int
    """Drafter width H; equals the target's hidden size (the frozen target embedding is H wide)."""

    intermediate_size: int
    """SwiGLU MLP width (the target's by default)."""

    num_attention_heads: int
    """Query heads of the drafter's attention."""

    num_key_value_heads: int
    """Key/value heads (grouped-query attention when smaller than num_attention_heads)."""

    head_dim: int
    """Per-head width; q_proj maps 2H → num_attention_heads * head_dim."""

    vocab_size: int
    """Target vocabulary (logit width of the target); t2d has this many entries."""

    draft_vocab_size: int
    """Rows of the drafter's lm_head (REFERENCE.md: 32000 for 128k-vocab targets)."""

    target_hidden_size: int
    """Width of one target feature tap; fc reads num_aux_layers * target_hidden_size."""

    num_aux_layers: int = 3
    """Target layers whose outputs are concatenated into the features (EAGLE-3: low, mid, high)."""

    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (the target's)."""

    max_position_embeddings: int = 2048
    """Copied from the target: a smaller value than the target's destroyed τ in one report (REFERENCE.md)."""

    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    """HF rope settings (rope_type, rope_theta, scaling fields), copied from the target."""

    norm_before_fc: bool = False
    """Opt-in variant: RMSNorm over the 3·Ht features before fc (off in EAGLE-3 / SpecForge)."""

    initializer_range: float = 0.02
    """Std of the normal init of the trainable linear layers."""

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "draft_vocab_size",
            "target_hidden_size",
            "num_aux_layers",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} exceeds the target vocab {self.vocab_size}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if "rope_type" not in self.rope_parameters or "rope_theta" not in self.rope_parameters:
            raise ValueError(f"rope_parameters needs rope_type and rope_theta, got {self.rope_parameters}")

    @classmethod
    def from_target(
        cls, target_config: PreTrainedConfig, draft_vocab_size: int, num_aux_layers: int = 3, **overrides: Any
    ) -> Eagle3Config:
        """Copy width, heads, norm eps, max positions and rope from an HF Llama / Qwen2 / Qwen3 / Mistral config."""
        c = target_config.get_text_config()
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # Qwen2 has no head_dim
        values = dict(
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads or c.num_attention_heads,
            head_dim=head_dim,
            vocab_size=c.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=c.hidden_size,
            num_aux_layers=num_aux_layers,
            rms_norm_eps=c.rms_norm_eps,
            max_position_embeddings=c.max_position_embeddings,
            rope_parameters=dict(c.rope_parameters),
        )
        values.update(overrides)
        return cls(**values)

    def llama_config(self) -> LlamaConfig:
        """The one-layer LlamaConfig these shapes correspond to (it initialises the rotary embedding)."""
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=1,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters),
            hidden_act="silu",
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
        )


def read_checkpoint_config(path: str | Path) -> tuple[Eagle3Config, TargetInfo]:
    """Parse an EAGLE-3 checkpoint's config.json (no weights read): use it to build the matching target first."""
    raw, info = read_checkpoint(path)
    if info.method != METHOD:
        raise ValueError(
            f"{path}: not an {METHOD} checkpoint (method={info.method!r}); infer.families.load_drafter reads any"
        )
    return from_dict(Eagle3Config, raw), info
