"""The target's tokenizer: loading it, the fingerprint drafter checkpoints store, and the ids that end an answer."""

from __future__ import annotations

import hashlib
import json

from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from models.reference import resolve_target


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The target's tokenizer via `AutoTokenizer` (local directory, hub id, or a reference target's short name)."""
    return AutoTokenizer.from_pretrained(resolve_target(name_or_path), trust_remote_code=trust_remote_code)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Stable 16-hex-char id of a tokenizer's vocabulary (added tokens included) and special tokens.

    Drafter checkpoints store it so loading can refuse a target whose token ids mean something else
    before any compute. Only the id <-> token mapping and the named/extra special tokens enter the hash
    (not normalizers or merges): that mapping is what draft and target ids must agree on.
    """
    vocab = sorted((i, t) for t, i in tokenizer.get_vocab().items())
    named = {name: [tok, tokenizer.convert_tokens_to_ids(tok)] for name, tok in tokenizer.special_tokens_map.items()}
    special = sorted(tokenizer.all_special_tokens)
    payload = json.dumps(
        {"vocab": vocab, "named_special": named, "special": special},
        ensure_ascii=False,
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


def stop_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> tuple[int, ...]:
    """EOS of the tokenizer and of the model's generation config (a list for chat models such as Llama-3)."""
    eos = model.generation_config.eos_token_id
    ids = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])}
    return tuple(sorted(i for i in ids if i is not None))
