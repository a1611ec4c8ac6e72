import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# 2-core machines: one intra-op thread per test process keeps timings stable and avoids oversubscription
torch.set_num_threads(int(os.environ.get("DRAFTERS_TEST_THREADS", "2")))

REFERENCE_TARGET = ROOT / "models" / "reference_target"
REFERENCE_DRAFT = ROOT / "models" / "reference_draft"


def tiny_llama(vocab: int = 97, layers: int = 2, hidden: int = 32, seed: int = 0, **kw):
    """A random fp32 Llama small enough that every test can build its own."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        **kw,
    )
    model = LlamaForCausalLM(cfg).eval()
    # sharpen the random logits so greedy decisions are far from numerical ties
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="session")
def tiny_target():
    from models.target import TargetModel

    return TargetModel(tiny_llama(seed=0))


@pytest.fixture(scope="session")
def tiny_draft():
    return tiny_llama(layers=1, hidden=32, seed=1)
