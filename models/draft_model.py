"""The small draft model baseline: a cut of the target itself (its embedding, first layers, final norm, tied head).

It needs no other checkpoint, shares the tokenizer by construction, and is a real small model of the same family;
`train/draft_model.py` distils its layers toward the target. Every default report measures it: distilled when that
run's folder exists, otherwise this cut as it is (labelled "not distilled").
"""

from __future__ import annotations

from transformers import LlamaForCausalLM

from models.target import TargetModel


def cut_target(target: TargetModel, layers: int) -> LlamaForCausalLM:
    """A Llama with the target's embedding, its first ``layers`` decoder layers, final norm and (tied) head."""
    if layers >= target.num_layers:
        raise ValueError(f"layers={layers} must be fewer than the target's {target.num_layers}")
    config = type(target.config).from_dict(target.config.to_dict())
    config.num_hidden_layers = layers
    draft = LlamaForCausalLM(config)
    keep = {
        k: v
        for k, v in target.hf_model.state_dict().items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    draft.load_state_dict(keep, strict=False)  # lm_head.weight is tied to the embedding
    draft.tie_weights()
    return draft
