"""The target model: any HF causal LM, wrapped so drafters can read its features.

Drafter training (online) and the verify runtime both go through `TargetModel`. It exposes the pieces
drafters share with the target (input embedding, final norm, lm_head) and captures hidden states of
chosen decoder layers with forward hooks during one ordinary forward pass.

Aux-layer convention (the one this project stores everywhere):
    ``aux_layer_ids`` are 0-based decoder-layer indices and mean "the OUTPUT of decoder layer k"
    (the residual stream after layer k, before any later layer or the final norm). In HF terms that is
    ``output_hidden_states[k + 1]`` (index 0 is the embedding output), except for the last layer
    ``k = N - 1``: HF replaces ``hidden_states[N]`` with the final-norm output, whereas a captured
    aux id ``N - 1`` is the raw (pre-norm) layer output.
    EAGLE / vLLM / speculators configs name the same tensors "before layer k + 1"; use
    `to_before_layer_ids` / `from_before_layer_ids` when reading or writing their configs.

Why hooks rather than ``output_hidden_states=True``: the latter keeps all N + 1 hidden states alive until
the forward returns; hooks keep only the few layers asked for, which matters for long sequences on big
targets in online training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers.cache_utils import Cache

from models.logits_to_keep import last_positions
from models.precision import PrecisionChoice, choose, user_choice
from models.precision_curves import ServingPath
from models.reference import resolve_target

# Written into drafter checkpoints beside the ids so a reader never has to guess the ±1 convention.
AUX_LAYER_CONVENTION = "output_of_layer_0based"

DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": "auto",  # whatever the checkpoint's config says (HF `dtype="auto"`)
    "fastest": "fastest",  # the precision policy's choice for the workload (models/precision.py)
}
DEVICES = ("cpu", "cuda", "auto")
MODES = ("frozen", "joint")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
# Attention and MLP projections of Llama / Qwen2 / Qwen3 / Mistral decoder layers.
DEFAULT_LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# --------------------------------------------------------------------------------------------------
# Aux-layer ids
# --------------------------------------------------------------------------------------------------


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low / mid / high feature layers for a target with `num_layers` decoder layers.

    For N >= 4 this is SpecForge's ``[1, N//2 - 1, N - 4]`` ("output of layer k"), which is exactly
    EAGLE / vLLM's default ``[2, N//2, N - 3]`` ("before layer k"), so a drafter trained with the default
    also matches an engine that ignores the stored ids. For 4 <= N <= 6 that formula repeats or reorders
    layers (N = 4 gives [1, 1, 0]); harmless, but pass explicit ids for such tiny targets.
    For N < 4 the formula goes negative (vLLM would then read the embedding output), so we spread the
    three taps over the layers that exist instead: ``[0, (N - 1) // 2, N - 1]``.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if num_layers < 4:
        return [0, (num_layers - 1) // 2, num_layers - 1]
    return [1, num_layers // 2 - 1, num_layers - 4]


def to_before_layer_ids(aux_layer_ids: list[int]) -> list[int]:
    """Our "output of layer k" ids -> EAGLE / vLLM / speculators "before layer k" ids (k + 1).

    "Before layer j" is the input of decoder layer j, i.e. HF ``output_hidden_states[j]``.
    """
    return [k + 1 for k in aux_layer_ids]


def from_before_layer_ids(before_layer_ids: list[int]) -> list[int]:
    """EAGLE / vLLM / speculators "before layer j" ids -> our "output of layer k" ids (j - 1).

    "Before layer 0" is the embedding output, which is no layer's output and cannot be expressed here.
    """
    if any(j < 1 for j in before_layer_ids):
        raise ValueError(
            f"before-layer ids must be >= 1 (before layer 0 is the embedding output, not a layer output); "
            f"got {before_layer_ids}"
        )
    return [j - 1 for j in before_layer_ids]


def _check_aux_ids(aux_layer_ids: list[int]) -> None:
    if not isinstance(aux_layer_ids, (list, tuple)) or len(aux_layer_ids) == 0:
        raise ValueError(f"aux_layer_ids must be a non-empty list of ints or None, got {aux_layer_ids!r}")
    for k in aux_layer_ids:
        # bool is an int subclass; True as a layer id is surely a mistake.
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(
                f"aux_layer_ids must be non-negative 0-based decoder-layer indices "
                f"('output of layer k'), got {aux_layer_ids!r}"
            )


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


@dataclass
class TargetConfig:
    """How to load and treat the target model."""

    name_or_path: str
    """Local directory, hub id, or the short name of a reference target (`models.reference`, e.g.
    "smollm2-135m-instruct", built into a cache folder on first use)."""

    dtype: str = "fastest"
    """Weight dtype: "fastest" (the precision policy's choice for the work this entry point does, measured once per
    machine: models/precision.py), "float32", "bfloat16", "float16" (the user's choice, reported as such), or "auto"
    (the dtype recorded in the checkpoint)."""

    device: str = "auto"
    """"cpu", "cuda", or "auto" (cuda when available, else cpu)."""

    trust_remote_code: bool = False
    """Allow the checkpoint's own modelling code (needed by some hub models); off by default for safety."""

    attn_implementation: str = "sdpa"
    """HF attention backend: "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention",
    or a hub kernel id containing "/"."""

    mode: str = "frozen"
    """"frozen": eval mode, no parameter requires grad (standard drafter training).
    "joint": the target trains too (fully, or only LoRA adapters when lora_rank > 0)."""

    lora_rank: int = 0
    """LoRA rank for joint mode; 0 = train all target parameters. Requires mode="joint" when > 0."""

    lora_alpha: float | None = None
    """LoRA scaling numerator; None = 2 * lora_rank (a common choice, scale 2)."""

    lora_dropout: float = 0.0
    """Dropout on the LoRA branch input."""

    lora_target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGET_MODULES))
    """Module names that get LoRA adapters; defaults to the attention and MLP projections."""

    aux_layer_ids: list[int] | None = None
    """Decoder layers whose outputs are captured as drafter features, 0-based, convention
    "output of layer k" (= HF output_hidden_states[k + 1]). None = `default_aux_layer_ids(N)`."""

    def __post_init__(self) -> None:
        if not isinstance(self.name_or_path, str) or not self.name_or_path:
            raise ValueError(f"name_or_path must be a non-empty string, got {self.name_or_path!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {list(DEVICES)}, got {self.device!r}")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS and "/" not in self.attn_implementation:
            raise ValueError(
                f"attn_implementation must be one of {list(ATTN_IMPLEMENTATIONS)} or a hub kernel id "
                f"('org/name'), got {self.attn_implementation!r}"
            )
        _check_mode_and_lora(self.mode, self.lora_rank, self.lora_alpha, self.lora_dropout, self.lora_target_modules)
        if self.aux_layer_ids is not None:
            _check_aux_ids(self.aux_layer_ids)


def _check_mode_and_lora(
    mode: str, lora_rank: int, lora_alpha: float | None, lora_dropout: float, lora_target_modules: list[str]
) -> None:
    # Shared by TargetConfig and TargetModel's constructor, which can be used without a config.
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if not isinstance(lora_rank, int) or isinstance(lora_rank, bool) or lora_rank < 0:
        raise ValueError(f"lora_rank must be an int >= 0, got {lora_rank!r}")
    if lora_rank > 0 and mode != "joint":
        raise ValueError(f"lora_rank={lora_rank} needs mode='joint' (a frozen target has nothing to adapt)")
    if lora_alpha is not None and lora_alpha <= 0:
        raise ValueError(f"lora_alpha must be > 0 or None, got {lora_alpha!r}")
    if not 0.0 <= lora_dropout < 1.0:
        raise ValueError(f"lora_dropout must be in [0, 1), got {lora_dropout!r}")
    if lora_rank > 0 and len(lora_target_modules) == 0:
        raise ValueError("lora_target_modules must not be empty when lora_rank > 0")


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


@dataclass
class TargetOutput:
    """One target forward. Shapes: B batch, T tokens, H hidden size, V vocab, A = len(aux_layer_ids)."""

    logits: torch.Tensor
    """[B, T, V] next-token logits, identical to the plain HF forward ([B, n, V] with logits_to_keep = n)."""

    last_hidden: torch.Tensor
    """[B, T, H] final-norm OUTPUT (= HF ``hidden_states[-1]`` / ``last_hidden_state``; what lm_head reads)."""

    pre_norm_last: torch.Tensor
    """[B, T, H] final-norm INPUT: the raw output of the last decoder layer."""

    aux_hidden: torch.Tensor | None
    """[B, T, A * H] captured layer outputs concatenated in aux_layer_ids order; None if capture_aux=False."""

    past_key_values: Cache | None
    """The KV cache after this forward (HF `Cache`), or None when use_cache=False and none was passed."""


def _find_decoder_parts(model: PreTrainedModel) -> tuple[nn.ModuleList, nn.Module]:
    """The decoder-layer list and the final norm of a Llama / Qwen / Mistral-style causal LM."""
    decoder = model.get_decoder()
    # getattr with a default here is the feature: unknown layouts get a clear error, not an AttributeError.
    layers = getattr(decoder, "layers", None)
    norm = getattr(decoder, "norm", None)
    found = isinstance(layers, nn.ModuleList) and isinstance(norm, nn.Module)
    if not found:  # a wrong architecture is a bad value for this API, hence ValueError
        raise ValueError(
            f"unsupported target architecture {type(model).__name__}: expected the decoder "
            f"({type(decoder).__name__}, from get_decoder()) to have `.layers` (nn.ModuleList of decoder "
            f"layers) and `.norm` (final norm) like Llama / Qwen2 / Qwen3 / Mistral; "
            f"found layers={type(layers).__name__}, norm={type(norm).__name__}"
        )
    return layers, norm


def _first_tensor(output: torch.Tensor | tuple) -> torch.Tensor:
    # transformers 5 decoder layers return a tensor; older ones and some remote-code models a tuple whose
    # first element is the hidden state.
    return output[0] if isinstance(output, tuple) else output


class TargetModel(nn.Module):
    """An HF causal LM plus feature capture. Build with `from_config` or from an already-built model."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        mode: str = "frozen",
        aux_layer_ids: list[int] | None = None,
        lora_rank: int = 0,
        lora_alpha: float | None = None,
        lora_dropout: float = 0.0,
        lora_target_modules: list[str] | None = None,
        name_or_path: str | None = None,
    ) -> None:
        """Wrap a plain (not PEFT-wrapped) HF causal LM; `mode` and the LoRA settings mean as in TargetConfig."""
        super().__init__()
        lora_target_modules = list(DEFAULT_LORA_TARGET_MODULES if lora_target_modules is None else lora_target_modules)
        _check_mode_and_lora(mode, lora_rank, lora_alpha, lora_dropout, lora_target_modules)
        layers, _ = _find_decoder_parts(model)  # fail early on an unsupported layout
        num_layers = len(layers)
        if aux_layer_ids is None:
            aux_layer_ids = default_aux_layer_ids(num_layers)
        _check_aux_ids(aux_layer_ids)
        if max(aux_layer_ids) >= num_layers:
            raise ValueError(
                f"aux_layer_ids {aux_layer_ids} out of range for a target with {num_layers} decoder layers "
                f"(0-based 'output of layer k', so k <= {num_layers - 1})"
            )

        self.mode = mode
        self.lora_rank = lora_rank
        self.precision: PrecisionChoice = user_choice(
            "serve", str(model.dtype).removeprefix("torch."), "the model given"
        )
        self.name_or_path = name_or_path or model.config.name_or_path
        self._aux_layer_ids = list(aux_layer_ids)
        self.vanilla_loop = "plain"
        """The batch-1 vanilla loop (`infer.generate.generate_vanilla`): "plain" or "masked"."""
        self.vanilla_loop_ms: dict[str, float] = {}
        """What `infer.serving.choose_vanilla_loop` timed for that choice (ms by loop; empty until it runs)."""

        if mode == "frozen":
            model.requires_grad_(False)
        elif lora_rank > 0:
            from peft import LoraConfig, get_peft_model  # only LoRA runs pay peft's import time

            lora = LoraConfig(
                r=lora_rank,
                lora_alpha=2 * lora_rank if lora_alpha is None else lora_alpha,
                lora_dropout=lora_dropout,
                target_modules=lora_target_modules,
                bias="none",
                task_type="CAUSAL_LM",
            )
            model = get_peft_model(model, lora)  # freezes the base weights, adds trainable adapters
        else:
            model.requires_grad_(True)
        self.model = model
        self.train(mode == "joint")

    @classmethod
    def from_config(
        cls,
        cfg: TargetConfig,
        workload: str = "serve",
        prepare: ServingPath | None = None,
        acceptance: Sequence[float] | None = None,
    ) -> TargetModel:
        """Load `cfg.name_or_path` with `AutoModelForCausalLM` and wrap it. ``dtype="fastest"`` asks the precision
        policy for ``workload`` ("serve", "distill", "train"; ``prepare`` and ``acceptance`` as in
        `models.precision.choose`); the choice, with where it came from, is kept as ``.precision``."""
        device = cfg.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("TargetConfig.device='cuda' but CUDA is not available on this machine")
        path = resolve_target(cfg.name_or_path)
        dtype = DTYPES[cfg.dtype]
        if dtype == "fastest":
            config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
            choice = choose(workload, config, device, acceptance=acceptance, prepare=prepare)
            dtype = getattr(torch, choice.dtype)
        elif dtype == "auto":
            choice = None
        else:
            choice = user_choice(workload, cfg.dtype, f"target.dtype={cfg.dtype}")
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=dtype,
            trust_remote_code=cfg.trust_remote_code,
            attn_implementation=cfg.attn_implementation,
        )
        model.to(device)
        if choice is None:
            loaded = str(model.dtype).removeprefix("torch.")
            choice = user_choice(workload, loaded, "target.dtype=auto (the dtype recorded in the checkpoint)")
        target = cls(
            model,
            mode=cfg.mode,
            aux_layer_ids=cfg.aux_layer_ids,
            lora_rank=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            lora_target_modules=cfg.lora_target_modules,
            name_or_path=cfg.name_or_path,
        )
        target.precision = choice
        return target

    def train(self, mode: bool = True) -> TargetModel:
        super().train(mode)
        if self.mode == "frozen":
            # A frozen target must behave identically whatever the surrounding training loop toggles
            # (dropout in the target would make its features and logits noisy labels).
            self.model.eval()
        return self

    # --- structure ---------------------------------------------------------------------------------

    @property
    def hf_model(self) -> PreTrainedModel:
        """The underlying HF model (with LoRA layers injected when lora_rank > 0), never the PEFT wrapper."""
        return self.model.get_base_model() if self.lora_rank > 0 else self.model

    @property
    def config(self) -> PreTrainedConfig:
        """The HF model config."""
        return self.hf_model.config

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return _find_decoder_parts(self.hf_model)[0]

    @property
    def num_layers(self) -> int:
        return len(self.decoder_layers)

    @property
    def hidden_size(self) -> int:
        return self.config.get_text_config().hidden_size

    @property
    def vocab_size(self) -> int:
        """Width of the logits (lm_head rows), which is what draft-vocab maps index into."""
        return self.lm_head.weight.shape[0]

    @property
    def aux_layer_ids(self) -> list[int]:
        """Captured layers, 0-based, "output of layer k" (see module docstring)."""
        return list(self._aux_layer_ids)

    @property
    def embed_tokens(self) -> nn.Module:
        return self.hf_model.get_input_embeddings()

    @property
    def final_norm(self) -> nn.Module:
        return _find_decoder_parts(self.hf_model)[1]

    @property
    def lm_head(self) -> nn.Module:
        return self.hf_model.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    # --- forward -----------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool = False,
        capture_aux: bool = True,
        logits_to_keep: int = 0,
    ) -> TargetOutput:
        """One HF forward; `attention_mask` may be a 2D padding mask or a 4D additive (tree) mask.

        ``logits_to_keep`` = n > 0: logits of the last n positions only (prefill needs none of the others; the
        head costs V·H per position, 28 M multiply-adds for SmolLM2). Hidden states and taps are always complete."""
        layers, norm = _find_decoder_parts(self.hf_model)
        captured: dict[int, torch.Tensor] = {}
        final: dict[str, torch.Tensor] = {}

        def capture_layer(k: int):
            def hook(module: nn.Module, args: tuple, output: torch.Tensor | tuple) -> None:
                captured[k] = _first_tensor(output)

            return hook

        def capture_norm(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            final["pre"] = args[0]
            final["post"] = _first_tensor(output)

        # Hooks live only for this call: no stale state between forwards, and a gradient-checkpointing
        # recomputation in backward does not re-fire them.
        handles = [norm.register_forward_hook(capture_norm)]
        if capture_aux:
            handles += [layers[k].register_forward_hook(capture_layer(k)) for k in sorted(set(self._aux_layer_ids))]
        try:
            # transformers 5 names the KV cache argument `cache` (`past_key_values` is deprecated).
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=past_key_values,
                use_cache=use_cache,
                logits_to_keep=last_positions(logits_to_keep, input_ids.shape[1], input_ids.device)
                if logits_to_keep
                else 0,
            )
        finally:
            for h in handles:
                h.remove()

        aux = torch.cat([captured[k] for k in self._aux_layer_ids], dim=-1) if capture_aux else None
        return TargetOutput(
            logits=out.logits,
            last_hidden=final["post"],
            pre_norm_last=final["pre"],
            aux_hidden=aux,
            past_key_values=out.cache,
        )
