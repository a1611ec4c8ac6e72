"""EAGLE-3 drafter (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test"): one Llama-style decoder layer that reads three target feature taps.

Data flow for one draft step (shapes: B batch, m tokens, H drafter hidden = target hidden, Ht target hidden,
Vd draft vocabulary)::

    features [B, m, 3Ht] ─ fc ─► h [B, m, H]                     (step 0; later steps feed back the layer output)
    embed_tokens(token) [B, m, H] ─ input_layernorm ─┐
    h ─ hidden_norm ─────────────────────────────────┴─ concat [B, m, 2H] ─ q/k/v ─ attention ─ o_proj ─► + h
      ─► post_attention_layernorm ─ SwiGLU MLP ─► + (residual)  = h'  (pre-norm output, fed back as next h)
    h' ─ norm ─ lm_head ─► logits [B, m, Vd]  (draft ids; target id = draft id + d2t[draft id])

Module names (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``) are the keys SGLang and vLLM load
(REFERENCE.md), so the engine export is a key filter (``models/eagle3_export.py``). ``embed_tokens`` is a frozen copy of the
target's input embedding: it is not saved (the target has it), and ``from_pretrained`` copies it back from the target.

Attention masks are boolean ``allowed[b, query, key]`` over ``[cached keys ‖ new keys]`` with explicit rope positions,
so the same layer serves training (the training-time-test unroll, ``forward``) and the runtime's ragged KV cache
with holes (``infer/eagle3_proposer.py``).

Checkpoint (DESIGN.md §6): ``config.json`` = the fields of :class:`Eagle3Config` (``models/eagle3_config.py``) plus a
``drafters`` block (method, version, target name / vocab size / hidden size / layer count, tokenizer fingerprint,
aux-layer ids and convention); ``model.safetensors`` = every trainable weight plus ``d2t`` / ``t2d``. Loading checks
the target before any compute.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from models.checkpoint import TargetInfo, read_weights, write_checkpoint
from models.eagle3_config import METHOD, Eagle3Config, read_checkpoint_config
from models.sizing import GB, DrafterSizes, RunSizes
from models.target import TargetModel
from models.ttt_attention import attention_bias, compute_dtype, resolve, ttt_attention

# --------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Llama RMSNorm (statistics in fp32, as HF does, so bf16 runs match the target's numerics)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused kernel instead of five elementwise ops: drafting at batch 1 is dispatch-bound on a CPU
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, m, d]; cos/sin [B, m, d] (HF layout, rotate-half convention)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def attend_cached(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    past_keys: torch.Tensor | None,
    past_values: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inference path's attention core, shared by ``Eagle3Drafter.step`` and ``FusedStep.step``: m new queries
    over [S cached keys ‖ m new keys].

    q [B, nh, m, d], k / v [B, nkv, m, d] (q, k rope'd), allowed [B, m, S + m] bool, past_keys / past_values
    [B, nkv, S, d] or None (S = 0) → attn [B, nh, m, d] and the grown cache keys / values [B, nkv, S + m, d].
    """
    keys = k if past_keys is None else torch.cat([past_keys, k], 2)
    values = v if past_values is None else torch.cat([past_values, v], 2)
    attn = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=allowed[:, None], enable_gqa=q.shape[1] != k.shape[1]
    )
    return attn, keys, values


class Eagle3Attention(nn.Module):
    """Attention whose q/k/v read the 2H concat (embedding ‖ hidden) and whose o_proj writes H."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, m, 2H] → rope'd q [B, nh, m, d], k [B, nkv, m, d], v [B, nkv, m, d]."""
        B, m, _ = x.shape
        q = self.q_proj(x).view(B, m, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, m, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, m, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, attn: torch.Tensor) -> torch.Tensor:
        """attn [B, nh, m, d] → [B, m, H]."""
        B, _, m, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(B, m, self.num_heads * self.head_dim))


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """The ``midlayer``: its parts in the order of the module docstring; the attention core is the caller's."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[B, m, H] each → [B, m, 2H]: embedding first, as EAGLE-3 / SpecForge / the engines concatenate."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual over the attention (residual = the hidden input h), then the MLP block → pre-norm h'."""
        h = hidden + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


# --------------------------------------------------------------------------------------------------
# Drafter
# --------------------------------------------------------------------------------------------------


@dataclass
class StepOutput:
    """One drafter step over m new tokens."""

    hidden: torch.Tensor
    """[B, m, H] pre-norm layer output (the next step's hidden input)."""
    logits: torch.Tensor | None
    """[B, m, Vd] draft-vocab logits (None when not asked for)."""
    keys: torch.Tensor
    """[B, nkv, S + m, d] rope'd keys: the cache passed in with the new tokens' appended (the caller's new cache)."""
    values: torch.Tensor
    """[B, nkv, S + m, d]."""


class FusedStep(nn.Module):
    """Inference-only snapshot of an `Eagle3Drafter` with the same math as ``Eagle3Drafter.step`` in fewer kernels.

    Drafting at batch 1 on a CPU is dispatch-bound (a 192-wide layer's matmuls take microseconds; each op costs
    ~5-10 µs of dispatch), so the module path's ~70 ops per step cost more than the arithmetic. Here q/k/v and
    gate/up are each one matmul, the RMSNorm weights are folded into the columns of the matmul that follows them
    (``(x·w) Wᵀ = x (W·diag w)ᵀ``), the embedding and the hidden state are normalised together, and q and k share
    one rope application. Results equal the module path up to float rounding order (tested). Build it after
    training: it copies the weights, so later updates to the drafter are not seen.
    """

    def __init__(self, drafter: Eagle3Drafter) -> None:
        super().__init__()
        cfg, layer = drafter.config, drafter.midlayer
        attn = layer.self_attn
        self.drafter = [drafter]  # a list: the snapshot must not register the drafter's parameters as its own
        self.eps = cfg.rms_norm_eps
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

        def linear(weight: torch.Tensor) -> nn.Linear:
            # nn.Linear modules (not bare tensors) so a runtime can route their small-row calls (infer/kernels); built
            # on the meta device, since a random init of weights replaced at once cost ~40 ms per proposer
            out = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
            out.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
            return out

        with torch.no_grad():
            in_scale = torch.cat([layer.input_layernorm.weight, layer.hidden_norm.weight])  # embedding first, as concat
            self.qkv = linear(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) * in_scale)
            self.o = linear(attn.o_proj.weight)
            mlp = layer.mlp
            self.gate_up = linear(
                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]) * layer.post_attention_layernorm.weight
            )
            self.down = linear(mlp.down_proj.weight)
            self.lm = linear(drafter.lm_head.weight * drafter.norm.weight)
            self.fc = linear(drafter.fc.weight)
        self.feature_norm = drafter.feature_norm

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """= ``Eagle3Drafter.project_features``."""
        return self.fc(features if self.feature_norm is None else self.feature_norm(features))

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        """RMS normalisation without the weight (folded into the next matmul); statistics in fp32 like RMSNorm."""
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """= ``Eagle3Drafter.compute_logits``."""
        return self.lm(self._normalize(hidden))

    def step(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        allowed: torch.Tensor,
        past_keys: torch.Tensor | None = None,
        past_values: torch.Tensor | None = None,
        with_logits: bool = True,
    ) -> StepOutput:
        """Same contract as ``Eagle3Drafter.step``."""
        B, m, H = hidden.shape
        nh, nkv, d = self.nh, self.nkv, self.d
        x = self._normalize(torch.stack([self.drafter[0].embed_tokens(input_ids), hidden], 2)).view(B, m, 2 * H)
        qkv = self.qkv(x).view(B, m, nh + 2 * nkv, d).transpose(1, 2)  # [B, heads, m, d]
        cos, sin = self.drafter[0].rope_by_position(x, positions)
        qk = apply_rope(qkv[:, : nh + nkv], cos, sin)
        q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :]
        a, keys, values = attend_cached(q, k, v, allowed, past_keys, past_values)
        h = hidden + self.o(a.transpose(1, 2).reshape(B, m, nh * d))
        gate, up = self.gate_up(self._normalize(h)).chunk(2, dim=-1)
        h = h + self.down(F.silu(gate) * up)
        return StepOutput(h, self.logits(h) if with_logits else None, keys, values)


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter. ``from_target`` for a fresh one, ``from_pretrained`` to load a checkpoint."""

    method: ClassVar[str] = METHOD
    """The family name its checkpoints carry (infer/eagle3_proposer.py declares the family)."""

    def __init__(self, cfg: Eagle3Config, target_info: TargetInfo | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.target_info = target_info
        # Frozen copy of the target's input embedding; filled by from_target / from_pretrained.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        features = cfg.num_aux_layers * cfg.target_hidden_size
        self.feature_norm = RMSNorm(features, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc = nn.Linear(features, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # Draft vocabulary maps (REFERENCE.md): target_id = draft_id + d2t[draft_id]; t2d[target_id] = in draft vocab.
        # Identity-prefix default so a fresh drafter is usable before build_draft_vocab runs.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.rotary = LlamaRotaryEmbedding(cfg.llama_config())
        # cos / sin by position for the inference path (grown on demand); rope types whose frequencies depend on
        # the sequence length ("dynamic") are recomputed every call instead
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in (self.fc, self.lm_head, *self.midlayer.self_attn.children(), *self.midlayer.mlp.children()):
            nn.init.normal_(module.weight, std=self.config.initializer_range)

    # --- construction / io ------------------------------------------------------------------------

    @classmethod
    def from_target(cls, target: TargetModel, draft_vocab_size: int, tokenizer=None, **overrides: Any) -> Eagle3Drafter:
        """A fresh drafter shaped after ``target``, with the target's embedding copied in and frozen."""
        cfg = Eagle3Config.from_target(
            target.config, draft_vocab_size, num_aux_layers=len(target.aux_layer_ids), **overrides
        )
        info = TargetInfo.of(target, tokenizer, method=cls.method, aux_layer_ids=target.aux_layer_ids)
        drafter = cls(cfg, info).to(device=target.device)
        drafter.copy_embedding(target.embed_tokens.weight)
        return drafter

    def copy_embedding(self, weight: torch.Tensor) -> None:
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(
                f"target embedding {tuple(weight.shape)} != drafter {tuple(self.embed_tokens.weight.shape)}"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight.to(self.embed_tokens.weight.dtype))

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocabulary maps (``train/draft_vocab.py`` builds them)."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not fit "
                f"{tuple(self.d2t.shape)} / {tuple(self.t2d.shape)}"
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @torch.no_grad()
    def init_head_from_target(self, target: TargetModel) -> None:
        """Opt-in warm start (not part of EAGLE-3): the target's final-norm weight into ``norm``, the draft-vocab rows
        of its lm_head into ``lm_head``, and ``fc`` = identity on the last feature tap, so training starts from a
        "logit lens" on the target's highest tapped layer instead of from noise. Call after ``set_draft_vocab``."""
        self.norm.weight.copy_(target.final_norm.weight.to(self.norm.weight.dtype))
        self.lm_head.weight.copy_(target.lm_head.weight[self.draft_to_target].to(self.lm_head.weight.dtype))
        H = self.config.target_hidden_size
        if self.config.hidden_size == H:
            self.fc.weight.zero_()
            self.fc.weight[:, -H:] = torch.eye(H, dtype=self.fc.weight.dtype, device=self.fc.weight.device)

    @torch.no_grad()
    def with_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor, target: TargetModel) -> Eagle3Drafter:
        """A copy of this trained drafter over another draft vocabulary (size ``d2t.shape[0]``).

        Every weight but ``lm_head`` is carried over. A token in both vocabularies keeps its trained row. A new
        token's row is the target's lm_head row for it sent through the least-squares linear map that takes the
        target's rows of the old vocabulary to their trained rows: a trained head is no longer the target's, and
        the target's own rows, scored against the drafter's hidden state, outbid the trained ones on tokens they
        should lose (first-draft accuracy on a tuning file 0.43 → 0.24 when in-context tokens outside the
        vocabulary were scored so; through the map, 0.43; docs/decisions.md, "The draft vocabulary rebuilt")."""
        cfg = dataclasses.replace(self.config, draft_vocab_size=int(d2t.shape[0]))
        weight = self.lm_head.weight
        new = type(self)(cfg, self.target_info).place(weight.device, weight.dtype)
        carried = {k: v for k, v in self.state_dict().items() if not k.startswith(("lm_head.", "d2t", "t2d"))}
        new.load_state_dict(carried, strict=False)  # the rest (lm_head, d2t, t2d) is set below
        new.set_draft_vocab(d2t.to(self.d2t.device), t2d.to(self.t2d.device))
        rows_of = target.lm_head.weight.detach().float().to(weight.device)
        old_ids, new_ids = self.draft_to_target, new.draft_to_target
        source, trained = rows_of[old_ids], weight.float()
        # ridge-regularised normal equations: H x H, solved once; the regulariser only guards a degenerate Gram
        gram = source.T @ source
        ridge = 1e-4 * gram.diagonal().mean() * torch.eye(gram.shape[0], device=gram.device)
        mapping = torch.linalg.solve(gram + ridge, source.T @ trained)
        rows = rows_of[new_ids] @ mapping
        old_row = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=weight.device)
        old_row[old_ids] = torch.arange(old_ids.shape[0], device=weight.device)
        kept = old_row[new_ids]
        rows[kept >= 0] = trained[kept[kept >= 0]]
        new.lm_head.weight.copy_(rows.to(weight.dtype))
        return new

    @torch.inference_mode()
    def first_drafts(self, target: TargetModel, sequence: list[int]) -> torch.Tensor:
        """[len(sequence)] target ids: at t >= 2 the first draft for token t that a served greedy round drafts after
        the target cached tokens < t-1 (the pair of their last feature and token t-1 predicts it), teacher-forced
        over the whole sequence in one step; -1 before (`scripts/copy_probe.py`)."""
        full = torch.tensor(sequence, device=target.device)[None]
        m = full.shape[1] - 1
        fused = FusedStep(self)
        aux = target(full).aux_hidden.to(self.fc.weight.dtype)
        causal = torch.ones(m, m, dtype=torch.bool, device=target.device).tril()[None]
        positions = torch.arange(m, device=target.device)[None]
        out = fused.step(fused.project_features(aux[:, :m]), full[:, 1:], positions, causal)
        drafts = torch.full((len(sequence),), -1, dtype=torch.long)
        drafts[2:] = self.draft_to_target[out.logits[0, :-1].argmax(-1)].cpu()  # pair i predicts token i+2
        return drafts

    @property
    def draft_to_target(self) -> torch.Tensor:
        """[Vd] int64 target id of every draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything saved: all weights except the frozen target embedding, plus d2t / t2d."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}

    def save_pretrained(self, path: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
        """config.json (Eagle3Config + ``drafters`` block) and model.safetensors; bit-exact on reload.
        ``state``: the weights to write instead of this module's own, by the same names (a sharded engine's gathered
        copy: `train.distributed.full_state`).
        """
        if self.target_info is None:
            raise ValueError(
                "target_info is unset: build the drafter with from_target so the checkpoint names its target"
            )
        own = self.trainable_state_dict()
        write_checkpoint(
            path,
            "Eagle3Drafter",
            dataclasses.asdict(self.config),
            self.target_info,
            own if state is None else {k: state[k] for k in own},
        )

    @classmethod
    def from_pretrained(cls, path: str | Path, target: TargetModel, tokenizer=None) -> Eagle3Drafter:
        """Load a checkpoint for ``target``, on its device and in its dtype, as the other families load and the
        engines serve a drafter (training continues from it in fp32: train/eagle3.py); refuses (ValueError) a
        mismatching target before reading weights."""
        cfg, info = read_checkpoint_config(path)
        info.check(target, tokenizer)
        state = read_weights(path)
        drafter = cls(cfg, info)
        missing, unexpected = drafter.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.startswith("embed_tokens.")]
        if missing or unexpected:
            raise ValueError(f"{path}: missing keys {missing}, unexpected keys {unexpected}")
        drafter.place(target.device, target.dtype)
        drafter.copy_embedding(target.embed_tokens.weight)
        return drafter

    def place(self, device: torch.device, dtype: torch.dtype) -> Eagle3Drafter:
        """The module on ``device`` in ``dtype``, but for the rotary frequencies, which stay fp32: rounded to bf16
        they would shift the angles by up to ~0.002 rad per position. A draft step in bf16 took 0.90 ms against
        2.14 ms in fp32 on a 2-core AVX-512-BF16 EPYC (docs/decisions.md, "Drafters serve in their target's
        dtype")."""
        self.to(device=device)
        for child in self.children():
            if child is not self.rotary:
                child.to(dtype=dtype)
        self._rope_table = None  # rebuilt on the new device
        return self

    # --- forward pieces ---------------------------------------------------------------------------

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target taps [.., A·Ht] → step-0 hidden [.., H]."""
        if self.feature_norm is not None:
            features = self.feature_norm(features)
        return self.fc(features)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-norm hidden [.., H] → draft-vocab logits [.., Vd]."""
        return self.lm_head(self.norm(hidden))

    def step(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        allowed: torch.Tensor,
        past_keys: torch.Tensor | None = None,
        past_values: torch.Tensor | None = None,
        with_logits: bool = True,
    ) -> StepOutput:
        """One drafter step over m new tokens against a KV cache of S slots (inference path).

        hidden [B, m, H] (fc(features) or a previous step's output), input_ids [B, m], positions [B, m] (rope),
        allowed [B, m, S + m] bool: query i may read cached slot s / new token j. past_keys/values [B, nkv, S, d].
        """
        attn_mod = self.midlayer.self_attn
        x = self.midlayer.attention_input(self.embed_tokens(input_ids), hidden)
        cos, sin = self.rope_by_position(x, positions)
        q, k, v = attn_mod.qkv(x, cos, sin)
        attn, keys, values = attend_cached(q, k, v, allowed, past_keys, past_values)
        h = self.midlayer.finish(hidden, attn_mod.out(attn))
        return StepOutput(h, self.compute_logits(h) if with_logits else None, keys, values)

    def rope_by_position(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, m, d] for explicit positions [B, m], from a table (same values as ``self.rotary``)."""
        if self.config.rope_parameters["rope_type"] == "dynamic":
            return self.rotary(x, positions)
        need = int(positions.max()) + 1
        if self._rope_table is None or self._rope_table[0].shape[0] < need or self._rope_table[0].device != x.device:
            grown = 2 * self._rope_table[0].shape[0] if self._rope_table is not None else 256
            size = max(need, min(grown, self.config.max_position_embeddings))
            probe = torch.zeros((), dtype=torch.float32, device=x.device)
            cos, sin = self.rotary(probe, torch.arange(size, device=x.device)[None])
            self._rope_table = (cos[0], sin[0])
        cos, sin = self._rope_table
        return cos[positions].to(x.dtype), sin[positions].to(x.dtype)

    def forward(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        allowed: torch.Tensor,
        ttt_steps: int,
        select: list[torch.Tensor] | None = None,
        attention: str = "auto",
    ) -> list[torch.Tensor]:
        """Training-time test unroll (EAGLE-3 §3.3): ``ttt_steps`` logits tensors, [B, T, Vd] each, or [N_i, Vd] at
        the positions ``select[i]`` ([B, T] bool) picks: the head and its softmax are most of a training step, and
        the loss reads the trained positions only (`train.losses.ttt_targets`). ``attention``: how the unroll's
        attention is computed (`models.ttt_attention.IMPLEMENTATIONS`; the results agree).

        This is ``forward`` so that DDP (accelerate's prepare) sees the training computation.

        features [B, T, A·Ht]: target taps at every position t. Step i at position t reads token t+1+i (teacher
        forcing; ids past the end are 0 and their outputs are masked by the loss) and, for i ≥ 1, the step-(i-1)
        output at t; it predicts token t+2+i. Attention: a step-i query at t sees the step-0 keys that ``allowed``
        [B, T, T] permits (causal, same sample) plus only the same-position key of steps 1..i — exactly the keys an
        inference-time node at depth i sees (its context pairs and its ancestors; `models.ttt_attention`). Rope
        position = position + i.
        """
        B, T, _ = features.shape
        attn_mod = self.midlayer.self_attn
        scale = 1.0 / math.sqrt(attn_mod.head_dim)
        hidden = self.project_features(features)
        path = resolve(attention, hidden.device)
        bias = attention_bias(allowed, compute_dtype(hidden), path)  # once per unroll, every step reads it
        keys0 = values0 = None
        diag_keys: list[torch.Tensor] = []
        diag_values: list[torch.Tensor] = []
        all_logits = []
        for i in range(ttt_steps):
            ids = F.pad(input_ids[:, 1 + i :], (0, min(1 + i, T)), value=0)[:, :T]
            x = self.midlayer.attention_input(self.embed_tokens(ids), hidden)
            cos, sin = self.rotary(x, position_ids + i)
            q, k, v = attn_mod.qkv(x, cos, sin)
            if i == 0:
                keys0, values0 = k, v
            else:
                diag_keys.append(k)
                diag_values.append(v)
            attn = ttt_attention(q, keys0, values0, diag_keys, diag_values, bias, scale, path)
            hidden = self.midlayer.finish(hidden, attn_mod.out(attn))
            all_logits.append(self.compute_logits(hidden if select is None else hidden[select[i]]))
        return all_logits


# --- sizing a training run (scripts/estimate.py) ---------------------------------------------------------------
def estimate_training(drafter: dict, run: RunSizes) -> DrafterSizes:
    """The drafter's share of a run from the recipe's ``drafter`` section: fc over the A = 3 taps, one decoder layer
    on [embedding; hidden] (2H wide), the draft-vocabulary head and two norms, unrolled ``ttt_steps`` times (each
    step attends over the context); offline, the target's head is recomputed from the cached final hidden state."""
    shape, H, V = run.shape, run.shape.H, run.shape.V
    n, Vd, A = drafter.get("ttt_steps", 7), drafter.get("draft_vocab_size", 32000), 3
    step = shape.layer(2 * H) + Vd * H + 2 * H  # layer on [emb; h], head, hidden + final norms
    flops = run.target_forward_flops + 6 * A * H * H + n * (6 * step + 12 * H * run.context)
    if not run.online:
        flops += 2 * V * H  # the target's head recomputed from the cached final hidden state
    memory = {
        "frozen embedding copy": V * H * run.weight_bytes * GB,
        "logits (target + draft steps, fp32)": run.tokens * (2 * V + n * 2 * Vd) * 4 * GB,
    }
    return DrafterSizes(A * H * H + step, flops, memory, (A * H + H) * run.feature_bytes)  # cache: taps + last hidden
