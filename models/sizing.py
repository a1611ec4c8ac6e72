"""Sizing a training run from configs alone (no weights): the target's shape and what every family's estimate reads.

`scripts/estimate.py` (``drafters estimate``) computes the target's and the run's shares here and asks the recipe's
family for its own (`infer.family.DrafterFamily.estimate`, written beside each drafter module). Parameter counts
are exact for the layouts this project builds (Llama-style decoder layers: q/k/v/o, gate/up/down; tests check them
against the built modules); FLOPs count matmuls (2 per multiply-add; forward + backward = 3x forward for trained
weights); memory is in GB per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.target import DEFAULT_LORA_TARGET_MODULES

BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fastest": 2, "auto": 2}
"""Bytes per element of a dtype setting ("fastest" / "auto" size as bf16, what a GPU serves and trains in)."""
ADAM_BYTES = 16
"""Per trained parameter: fp32 master weight + fp32 gradient + AdamW m and v."""
GB = 1e-9


@dataclass
class Shape:
    """The target's shape from its config.json (text part of a multimodal config)."""

    H: int
    I: int  # noqa: E741 (the paper's name for the MLP width)
    L: int
    heads: int
    kv_heads: int
    head_dim: int
    V: int
    tied: bool

    @classmethod
    def of(cls, config: dict) -> Shape:
        c = config.get("text_config", config)
        heads = c["num_attention_heads"]
        return cls(
            H=c["hidden_size"],
            I=c["intermediate_size"],
            L=c["num_hidden_layers"],
            heads=heads,
            kv_heads=c.get("num_key_value_heads", heads),
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            V=c["vocab_size"],
            tied=bool(c.get("tie_word_embeddings", False)),
        )

    def layer(self, input_width: int | None = None) -> int:
        """Weights of one decoder layer (q/k/v read ``input_width``, default H; two RMSNorms)."""
        x = input_width or self.H
        attn = (
            x * self.heads * self.head_dim + 2 * x * self.kv_heads * self.head_dim + self.heads * self.head_dim * self.H
        )
        return attn + 3 * self.H * self.I + 2 * self.H

    def lora_width(self, modules: list[str] | None = None) -> int:
        """Σ (in + out) over one layer's LoRA-wrapped projections: rank r adds r · this per layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        dims = {"q_proj": (self.H, q), "k_proj": (self.H, kv), "v_proj": (self.H, kv), "o_proj": (q, self.H)}
        dims.update(gate_proj=(self.H, self.I), up_proj=(self.H, self.I), down_proj=(self.I, self.H))
        modules = list(modules or DEFAULT_LORA_TARGET_MODULES)
        if set(modules) - dims.keys():
            raise SystemExit(f"LoRA modules {sorted(set(modules) - dims.keys())}: the estimator knows {sorted(dims)}")
        return sum(sum(dims[m]) for m in modules)

    @property
    def params(self) -> int:
        """All target parameters (embedding, layers, final norm, head unless tied)."""
        return self.V * self.H * (1 if self.tied else 2) + self.L * self.layer() + self.H

    def forward_flops(self, context: float) -> float:
        """Forward FLOPs per token: every matmul weight once, the head, causal attention over ``context`` keys."""
        return 2 * (self.L * self.layer() + self.V * self.H) + 4 * self.L * self.heads * self.head_dim * context


@dataclass(frozen=True)
class RunSizes:
    """What a family's estimate reads of the run beyond its own recipe section."""

    shape: Shape
    """The target's shape."""
    tokens: int
    """Tokens of one micro-batch (data.max_length x train.batch_size): the rows whose logits are held at once."""
    context: float
    """Keys the average query attends to (causal: half of data.max_length)."""
    loss_share: float
    """Share of a chat row that is answer tokens (the positions a head or depth is trained on)."""
    weight_bytes: int
    """Bytes per element of the target's weights (target.dtype)."""
    feature_bytes: int
    """Bytes per element of an offline feature cache (train.feature_dtype)."""
    online: bool
    """Features come from a target forward every step (train.features online), not from the cache."""
    target_forward_flops: float
    """FLOPs per token of the target's forward in the loop (0 when features come from the cache)."""


@dataclass
class DrafterSizes:
    """A family's share of a run: what its drafter trains, costs and holds."""

    trainable: int
    """Trained parameters of the drafter (the target's adapters or weights in joint mode are added by the caller)."""
    flops_per_token: float
    """FLOPs per training token, the target's forward (`RunSizes.target_forward_flops`) included."""
    memory: dict[str, float]
    """GB per GPU by part, beyond the target's weights and the optimizer state (e.g. the logits)."""
    cache_bytes_per_token: int | None
    """Offline feature cache per token; None: the family trains online only."""
