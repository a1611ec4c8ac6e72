"""MTP modules (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" §2.2): D sequential multi-token-prediction modules
on top of a target, used as a drafter for self-speculation.

Module k (1-based) at position i reads the previous depth's hidden state h^{k-1}_i and the embedding of token
t_{i+k}. h^0 is the target's signal ``MTPConfig.input_signal`` names: its final-norm output (new drafters: what vLLM,
SGLang and transformers feed their DeepSeek-V3 / Qwen3-Next MTP modules, docs/exports.md) or its last decoder layer's
output before that norm (checkpoints written before the field existed)::

    h'_i   = eh_proj [ enorm(emb(t_{i+k})) ; hnorm(h^{k-1}_i) ]      2H → H, no bias; embedding first (REFERENCE.md)
    h^k    = block_k(h')                                               one decoder layer of the target's own family,
                                                                       causal attention over positions ≤ i of depth k
    logits = lm_head(final_norm(h^k_i))                                predicts t_{i+k+1}

The embedding, the final norm and the output head are the target's (shared, not saved; a jointly trained target's
changes travel in ``<checkpoint>/target``). Module k therefore sees tokens up to t_{i+k} and nothing later (tested).
The block is an instance of the target's decoder-layer class built from the target's config (Llama, Qwen2, Qwen3,
Mistral …), so its parameter names are the target's own (``self_attn.q_proj`` …), which is what the DeepSeek-V3 /
GLM and Qwen3-Next layouts expect next to ``enorm`` / ``hnorm`` / ``eh_proj`` (models/mtp_export.py).

Checkpoint: ``config.json`` = `MTPConfig` + the ``drafters`` block (method "mtp"), ``model.safetensors`` =
``layers.{k}.{enorm,hnorm,eh_proj}.weight`` and ``layers.{k}.block.*`` (0-based k).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models.checkpoint import TargetInfo, read_checkpoint, read_weights, write_checkpoint
from models.config import from_dict
from models.eagle3 import RMSNorm
from models.sizing import GB, DrafterSizes, RunSizes
from models.target import TargetModel

METHOD = "mtp"
BLOCK_INITS = ("last_layer", "random")
INPUT_SIGNALS = ("last_hidden", "pre_norm")
"""MTPConfig.input_signal values; they are infer.proposer.TargetSignal's, which models/ cannot import."""


@dataclass
class MTPConfig:
    hidden_size: int
    """The target's hidden size."""
    vocab_size: int
    """The target's vocabulary (the shared head scores all of it)."""
    block_class: str
    """The target's decoder-layer class (e.g. "LlamaDecoderLayer"); checked on load."""
    num_modules: int = 1
    """D: module k predicts token t+k+1 (DeepSeek-V3: D = 1)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of enorm / hnorm (the target's)."""
    initializer_range: float = 0.02
    """Std of eh_proj's normal init (and of the block's when block_init is "random")."""
    block_init: str = "last_layer"
    """"last_layer": every module's block starts as a copy of the target's last decoder layer (a warm start that
    small budgets need); "random": normal init, as when pre-training with MTP."""
    input_signal: str = "last_hidden"
    """h^0, the target signal module 1 reads: "last_hidden", the final-norm output (what vLLM, SGLang and transformers
    feed an MTP module: the only setting the engine exports take); "pre_norm", the last decoder layer's output before
    the final norm (the meaning of a checkpoint saved without this field)."""

    def __post_init__(self) -> None:
        if self.num_modules < 1:
            raise ValueError(f"num_modules must be >= 1, got {self.num_modules}")
        if self.block_init not in BLOCK_INITS:
            raise ValueError(f"block_init must be one of {BLOCK_INITS}, got {self.block_init!r}")
        if self.input_signal not in INPUT_SIGNALS:
            raise ValueError(f"input_signal must be one of {INPUT_SIGNALS}, got {self.input_signal!r}")


class _KV:
    """Stands in for an HF Cache during one block call: the caller's past keys / values [B, nkv, S, d] in, the same
    with this call's appended out (the proposer keeps its own ragged cache and validity mask)."""

    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None) -> None:
        self.keys, self.values = keys, values

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, **kwargs) -> tuple[torch.Tensor, ...]:
        if self.keys is not None:
            keys, values = torch.cat([self.keys, keys], 2), torch.cat([self.values, values], 2)
        self.keys, self.values = keys, values
        return keys, values


class MTPModule(nn.Module):
    """One depth: enorm, hnorm, eh_proj and a decoder layer of the target's class."""

    def __init__(self, cfg: MTPConfig, block: nn.Module) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = block

    def combine(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[.., H] each → [.., H]: the embedding first, as DeepSeek-V3 / GLM / Qwen3-Next concatenate."""
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))


def _block_config(target: TargetModel):
    """The target's text config with SDPA attention (the boolean masks below need it)."""
    config = copy.deepcopy(target.config.get_text_config())
    config._attn_implementation = "sdpa"
    return config


@torch.no_grad()
def merged_state(layer: nn.Module) -> dict[str, torch.Tensor]:
    """A decoder layer's weights under their plain names, any LoRA adapter merged in (a jointly trained target is
    wrapped by peft: ``q_proj.base_layer.weight`` + ``q_proj.lora_{A,B}``)."""
    from peft.tuners.lora import LoraLayer

    state = {k.replace(".base_layer.", "."): v for k, v in layer.state_dict().items() if ".lora_" not in k}
    for name, module in layer.named_modules():
        if isinstance(module, LoraLayer):
            for adapter in module.active_adapters:
                state[f"{name}.weight"] = state[f"{name}.weight"] + module.get_delta_weight(adapter)
    return state


class MTPDrafter(nn.Module):
    """D MTP modules over a target. ``from_target`` for fresh modules, ``from_pretrained`` to load a checkpoint."""

    method: ClassVar[str] = METHOD
    """The family name its checkpoints carry (infer/mtp_proposer.py declares the family)."""

    def __init__(self, cfg: MTPConfig, target: TargetModel, target_info: TargetInfo | None = None) -> None:
        super().__init__()
        layer_cls = type(target.decoder_layers[-1])
        if layer_cls.__name__ != cfg.block_class:
            raise ValueError(f"MTP blocks are {cfg.block_class}, the target's decoder layers are {layer_cls.__name__}")
        self.config, self.target_info = cfg, target_info
        block_config = _block_config(target)
        last = target.num_layers - 1  # layer_idx: some families read per-layer settings (e.g. sliding windows) by it
        self.layers = nn.ModuleList(MTPModule(cfg, layer_cls(block_config, last)) for _ in range(cfg.num_modules))
        self.rotary = type(target.hf_model.get_decoder().rotary_emb)(config=block_config)
        self._target: list[TargetModel] = []  # shared embedding / final norm / head (a list: not our parameters)
        self.reset_parameters()
        self.place(target)
        self.attach_target(target)

    def place(self, target: TargetModel) -> None:
        """The modules on the target's device and dtype; the rotary table stays fp32 (bf16 frequencies would shift
        the angles at long positions)."""
        self.layers.to(device=target.device, dtype=target.dtype)
        self.rotary.to(device=target.device)

    def reset_parameters(self) -> None:
        for module in self.layers:
            nn.init.normal_(module.eh_proj.weight, std=self.config.initializer_range)
            for sub in module.block.modules():
                if isinstance(sub, nn.Linear):
                    nn.init.normal_(sub.weight, std=self.config.initializer_range)
                    if sub.bias is not None:
                        nn.init.zeros_(sub.bias)

    # --- construction / io ------------------------------------------------------------------------

    @classmethod
    def from_target(
        cls,
        target: TargetModel,
        num_modules: int = 1,
        tokenizer=None,
        block_init: str = "last_layer",
        input_signal: str = MTPConfig.input_signal,
    ) -> MTPDrafter:
        """Fresh modules for ``target`` (blocks copied from its last layer unless block_init is "random") reading h^0
        as ``input_signal`` says."""
        text = target.config.get_text_config()
        cfg = MTPConfig(
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            block_class=type(target.decoder_layers[-1]).__name__,
            num_modules=num_modules,
            rms_norm_eps=text.rms_norm_eps,
            block_init=block_init,
            input_signal=input_signal,
        )
        drafter = cls(cfg, target, TargetInfo.of(target, tokenizer, method=cls.method))
        if block_init == "last_layer":
            state = merged_state(target.decoder_layers[-1])
            with torch.no_grad():
                for module in drafter.layers:
                    module.block.load_state_dict({k: v.to(target.dtype) for k, v in state.items()})
        return drafter

    def attach_target(self, target: TargetModel) -> None:
        """Use ``target``'s embedding, final norm and head (a jointly trained target's current ones)."""
        self._target = [target]

    def save_pretrained(self, path: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
        """config.json (MTPConfig + ``drafters`` block) and model.safetensors; bit-exact on reload.
        ``state``: the weights to write instead of this module's own, by the same names (a sharded engine's gathered
        copy: `train.distributed.full_state`).
        """
        if self.target_info is None:
            raise ValueError(
                "target_info is unset: build the modules with from_target so the checkpoint names its target"
            )
        own = self.state_dict()
        write_checkpoint(
            path,
            "MTPDrafter",
            dataclasses.asdict(self.config),
            self.target_info,
            own if state is None else {k: state[k] for k in own},
        )

    @classmethod
    def from_pretrained(cls, path: str | Path, target: TargetModel, tokenizer=None) -> MTPDrafter:
        """Load a checkpoint for ``target``; refuses (ValueError) a mismatching target before reading weights."""
        raw, info = read_checkpoint(path)
        if info.method != METHOD:
            raise ValueError(f"{path}: not an {METHOD} checkpoint (method={info.method!r})")
        info.check(target, tokenizer)
        # a config without input_signal predates the field: those modules were trained on the pre-norm output
        drafter = cls(from_dict(MTPConfig, {"input_signal": "pre_norm", **raw}), target, info)
        state = read_weights(path)
        missing, unexpected = drafter.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{path}: missing keys {missing}, unexpected keys {unexpected}")
        drafter.place(target)
        return drafter

    # --- forward pieces ---------------------------------------------------------------------------

    @property
    def target(self) -> TargetModel:
        if not self._target:
            raise RuntimeError("MTPDrafter needs attach_target(target) first")
        return self._target[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Module output [.., H] → logits [.., V] through the target's final norm and head, in the target's dtype
        (modules held in fp32 beside a bf16 target, as the data-scaling curve holds them, feed them a cast)."""
        head = self.target.lm_head
        return head(self.target.final_norm(hidden.to(head.weight.dtype)))

    def module_step(
        self,
        k: int,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        allowed: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Module ``k`` (0-based) on m entries: hidden [B, m, H] (the previous depth's outputs at these positions),
        input_ids [B, m] (token position + k + 1 each), positions [B, m] (rope), allowed [B, m, S + m] bool over
        [past keys ‖ new keys], past (keys, values) [B, nkv, S, d] or None → (outputs [B, m, H], keys, values with the
        new entries appended)."""
        module = self.layers[k]
        x = module.combine(self.target.embed_tokens(input_ids), hidden)
        cache = _KV(*(past or (None, None)))
        out = module.block(
            x, attention_mask=allowed[:, None], position_embeddings=self.rotary(x, positions), cache=cache
        )
        return out, cache.keys, cache.values

    def hidden_states(
        self, target_hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor, allowed: torch.Tensor
    ) -> list[torch.Tensor]:
        """Teacher-forced outputs of every depth [B, T, H] each. target_hidden [B, T, H]: h^0, the target signal
        ``config.input_signal`` names; input_ids / position_ids [B, T]; allowed [B, T, T] (causal, same sample). Depth
        k at position t reads token t+k+1 (ids past the end are 0: those positions are masked by the loss)."""
        hidden, out = target_hidden, []
        for k in range(self.config.num_modules):
            ids = F.pad(input_ids[:, k + 1 :], (0, k + 1), value=0)[:, : input_ids.shape[1]]
            hidden = self.module_step(k, hidden, ids, position_ids, allowed)[0]
            out.append(hidden)
        return out

    def forward(
        self,
        target_hidden: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        allowed: torch.Tensor,
        positions: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        """Training: depth k's logits [N_k, V] at the positions selected by ``positions[k]`` [B, T] bool (the head
        runs only where there is a label: a 49k-wide head over every token of every depth would dominate)."""
        hidden = self.hidden_states(target_hidden, input_ids, position_ids, allowed)
        return [self.logits(h[p]) for h, p in zip(hidden, positions)]


# --- sizing a training run (scripts/estimate.py) ---------------------------------------------------------------
def estimate_training(mtp: dict, run: RunSizes) -> DrafterSizes:
    """The modules' share of a run from the recipe's ``mtp`` section: D modules of one target-shaped block plus
    eh_proj and two norms, each through the target's head on the answer tokens; MTP trains online only (no cache)."""
    shape, H, V = run.shape, run.shape.H, run.shape.V
    D = mtp.get("num_modules", 1)
    module = shape.layer() + 2 * H * H + 2 * H  # block + eh_proj + enorm / hnorm
    attention = 12 * shape.heads * shape.head_dim * run.context
    flops = run.target_forward_flops + D * (6 * module + 4 * V * H * run.loss_share + attention)
    memory = {"logits (depths, fp32)": run.tokens * run.loss_share * D * V * 4 * 2 * GB}
    return DrafterSizes(D * module, flops, memory, None)
