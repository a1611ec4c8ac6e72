"""Medusa heads: model, checkpoint block and loader, exports, loss targets, tree choice, proposer, recipe."""

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file

from infer.families import load_drafter
from infer.generate import generate_speculative, generate_vanilla
from infer.medusa_proposer import MedusaProposer
from infer.sampling import SamplingParams
from infer.tree_search import best_rank_paths, expected_accepted
from models.checkpoint import read_checkpoint
from models.eagle3 import Eagle3Drafter
from models.eagle3_config import read_checkpoint_config
from models.medusa import MedusaConfig, MedusaDrafter
from models.medusa_export import (
    medusa_original_state_dict,
    medusa_vllm_config,
    medusa_vllm_state_dict,
    save_medusa_original,
    save_medusa_vllm,
)
from models.target import TargetModel
from tests.conftest import run_to_end, tiny_llama, tiny_run_args
from train.losses import position_targets, rank_matches


@pytest.mark.parametrize("shared", [False, True])
def test_fresh_heads_are_the_target_head_and_blocks_are_distinct(tiny_target, shared):
    heads = MedusaDrafter.from_target(tiny_target, num_heads=3, num_layers=2, shared_head=shared)
    h = torch.randn(5, tiny_target.hidden_size)
    want = tiny_target.lm_head(h)
    for k in range(3):  # zero-initialised ResBlocks: every head starts as exactly the target's head
        torch.testing.assert_close(heads.head_logits(k, h), want)
    torch.testing.assert_close(heads.predict(h), want.expand(3, -1, -1))
    # 3 heads x 2 layers of their own (the reference code's `[ResBlock] * L` would share one module per head)
    linears = [res.linear for block in heads.blocks for res in block]
    assert len({id(m.weight) for m in linears}) == 6
    with torch.no_grad():
        heads.blocks[0][0].linear.weight.fill_(0.1)
    assert not torch.equal(heads.head_logits(0, h), want) and torch.equal(heads.head_logits(1, h), want)
    trainable = sum(p.numel() for p in heads.parameters())
    H, V = tiny_target.hidden_size, tiny_target.vocab_size
    assert trainable == 6 * (H * H + H) + (0 if shared else 3 * V * H)


def _trained_like(heads: MedusaDrafter, seed: int = 0) -> MedusaDrafter:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return heads


@pytest.mark.parametrize("shared", [False, True])
def test_checkpoint_round_trips_bit_exactly_and_the_loader_picks_the_class(tiny_target, tmp_path, shared):
    heads = _trained_like(MedusaDrafter.from_target(tiny_target, num_heads=2, shared_head=shared))
    heads.config.tree_paths = [[0], [1], [0, 0]]
    heads.save_pretrained(tmp_path)
    raw, info = read_checkpoint(tmp_path)
    assert info.method == "medusa" and info.aux_layer_ids == [] and raw["tree_paths"] == [[0], [1], [0, 0]]
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert any(k.startswith("lm_heads.") for k in saved) != shared  # a shared head is the target's: not saved
    loaded = load_drafter(tmp_path, tiny_target)
    assert isinstance(loaded, MedusaDrafter) and loaded.config == heads.config
    for (k, a), (k2, b) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    h = torch.randn(3, tiny_target.hidden_size)
    assert torch.equal(heads.predict(h), loaded.predict(h))
    with pytest.raises(ValueError, match="not an eagle3 checkpoint"):
        read_checkpoint_config(tmp_path)
    with pytest.raises(ValueError, match="not a medusa checkpoint"):
        other = Eagle3Drafter.from_target(tiny_target, draft_vocab_size=16)
        other.save_pretrained(tmp_path / "e3")
        MedusaDrafter.from_pretrained(tmp_path / "e3", tiny_target)
    assert isinstance(load_drafter(tmp_path / "e3", tiny_target), Eagle3Drafter)


def test_a_mismatching_target_is_refused_before_weights_are_read(tiny_target, tmp_path):
    MedusaDrafter.from_target(tiny_target, num_heads=2).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")  # never read: the check comes first
    with pytest.raises(ValueError, match="hidden size: drafter trained for 32, target has 48"):
        load_drafter(tmp_path, TargetModel(tiny_llama(hidden=48)))


def test_exports_follow_the_vllm_and_original_key_maps(tiny_target, tmp_path):
    heads = _trained_like(MedusaDrafter.from_target(tiny_target, num_heads=2, num_layers=2, shared_head=True))
    H, V = tiny_target.hidden_size, tiny_target.vocab_size
    vllm = medusa_vllm_state_dict(heads)
    want = {f"blocks.{h}.layers.{j}.{w}" for h in range(2) for j in range(2) for w in ("weight", "bias")}
    assert set(vllm) == want | {"lm_head.weight"}
    assert vllm["blocks.1.layers.0.weight"].shape == (H, H) and vllm["lm_head.weight"].shape == (V, H)
    assert torch.equal(vllm["lm_head.weight"], tiny_target.lm_head.weight)  # the shared head, written once
    cfg = medusa_vllm_config(heads)
    assert cfg["model_type"] == "medusa" and cfg["num_heads"] == 2 and cfg["num_hidden_layers"] == 2
    assert cfg["medusa_fc_bias"] is True and cfg["original_lm_head"] is True and cfg["vocab_size"] == V
    original = medusa_original_state_dict(heads)
    assert set(original) == {f"{h}.{j}.linear.{w}" for h in range(2) for j in range(2) for w in ("weight", "bias")} | {
        "0.2.weight",
        "1.2.weight",
    }
    assert torch.equal(original["1.0.linear.bias"], heads.blocks[1][0].linear.bias)
    save_medusa_vllm(heads, tmp_path / "vllm")
    assert set(load_file(str(tmp_path / "vllm" / "model.safetensors"))) == set(vllm)
    # FasterDecoding opens base_model_name_or_path and medusa_lm_head.pt (a torch pickle); this target has no name
    with pytest.raises(ValueError, match="base_model_name_or_path"):
        save_medusa_original(heads, tmp_path / "orig")
    # two ResBlocks per head: FasterDecoding builds one module repeated, so that layout is refused and nothing written
    with pytest.raises(ValueError, match="cannot build 2 ResBlocks per head"):
        save_medusa_original(heads, tmp_path / "orig", base_model_name_or_path="org/tiny")
    assert not (tmp_path / "orig").exists()
    one = _trained_like(MedusaDrafter.from_target(tiny_target, num_heads=2, num_layers=1, shared_head=True))
    save_medusa_original(one, tmp_path / "orig", base_model_name_or_path="org/tiny")
    written = torch.load(tmp_path / "orig" / "medusa_lm_head.pt", weights_only=True)
    want = {f"{h}.0.linear.{w}" for h in range(2) for w in ("weight", "bias")} | {"0.1.weight", "1.1.weight"}
    assert set(written) == set(medusa_original_state_dict(one)) == want
    meta = json.loads((tmp_path / "orig" / "config.json").read_text())
    assert (
        meta["medusa_num_heads"] == 2
        and meta["medusa_num_layers"] == 1
        and meta["base_model_name_or_path"] == "org/tiny"
    )
    assert "--num_medusa_heads 2 --num_medusa_layers 1" in (tmp_path / "orig" / "README.md").read_text()


def test_head_k_is_trained_on_token_t_plus_2_plus_k_where_that_token_is_a_loss_token():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1]])
    positions, labels = position_targets(ids, mask, position=0)
    assert positions.tolist() == [[False, True, True, True, False, False]]
    assert labels[positions].tolist() == [13, 14, 15]
    positions, labels = position_targets(ids, mask, position=2)
    assert positions.tolist() == [[True, True, False, False, False, False]] and labels[positions].tolist() == [14, 15]
    # packed rows: a label from the next sample is never a target
    sample_ids = torch.tensor([[0, 0, 0, 0, 1, 1]])
    positions, _ = position_targets(ids, mask, position=0, sample_ids=sample_ids)
    assert positions.tolist() == [[False, True, False, False, False, False]]
    logits = torch.tensor([[0.1, 0.9, 0.5], [0.8, 0.1, 0.5], [0.2, 0.3, 0.1]])
    assert rank_matches(logits, torch.tensor([1, 2, 0]), 3).sum(0).tolist() == [1, 2, 0]  # ranks 0, 1, 1


def test_the_tree_is_the_most_valuable_set_of_rank_paths():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.05], [0.4, 0.1, 0.05]]
    paths = best_rank_paths(acc, 5)
    assert paths[0] == (0,) and all(p[:-1] in paths or len(p) == 1 for p in paths)  # prefix-closed
    # brute force over every prefix-closed set of 5 paths: none is worth more
    every = [p for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)]
    best = 0.0
    for subset in itertools.combinations(every, 5):
        if all(len(p) == 1 or p[:-1] in subset for p in subset):
            best = max(best, expected_accepted(acc, list(subset)))
    assert expected_accepted(acc, paths) == pytest.approx(best)
    assert expected_accepted(acc, [(0,), (0, 0)]) == pytest.approx(0.6 + 0.3)
    assert best_rank_paths(acc, 0) == [] and len(best_rank_paths(acc, 100)) == 3 + 9 + 27


class _OracleHeads(MedusaDrafter):
    """Stand-in heads with exactly known acceptance: head k proposes the token the target will emit k+1 steps after
    the root (read from a precomputed greedy answer), except every ``miss``-th call, where head 0 is wrong."""

    def __init__(self, target: TargetModel, answer: list[int], prompt_len: int, miss: int) -> None:
        super().__init__(MedusaConfig(target.hidden_size, target.vocab_size, num_heads=3, shared_head=True))
        self.answer, self.prompt_len, self.miss, self.calls = answer, prompt_len, miss, 0
        self.contexts: list[list[int]] = []

    def predict(self, last_hidden: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        self.calls += 1
        V, depth = self.config.vocab_size, depth or self.config.num_heads
        logits = torch.zeros(depth, last_hidden.shape[0], V)
        emitted = len(self.contexts[0]) - self.prompt_len  # tokens generated so far, the root included
        for k in range(depth):
            tok = self.answer[min(emitted + k, len(self.answer) - 1)]
            if k == 0 and self.calls % self.miss == 0:
                tok = (tok + 1) % V
            logits[k, 0, tok] = 1.0
        return logits


def test_medusa_chain_is_greedy_identical_and_accepts_what_the_oracle_gets_right(tiny_target):
    prompt, params = [5, 6, 7, 8, 9], SamplingParams(max_new_tokens=24)
    answer = generate_vanilla(tiny_target, [prompt], params).tokens[0]
    oracle = _OracleHeads(tiny_target, answer, len(prompt), miss=3)
    proposer = MedusaProposer(oracle, k=3)
    original = proposer.propose

    def propose(contexts, p, g):
        oracle.contexts = contexts
        return original(contexts, p, g)

    proposer.propose = propose
    res = generate_speculative(tiny_target, proposer, [prompt], params)
    assert res.tokens[0] == answer
    # every third round head 0 misses (the round emits the bonus only); the others accept all 3 drafts + the bonus
    emitted, rounds = 0, 0
    while emitted < len(answer):
        rounds += 1
        emitted += 1 if rounds % 3 == 0 else 4
    assert res.stats.rounds == rounds
    assert res.stats.attempted_at_depth[0] == rounds and res.stats.accepted_at_depth[0] == rounds - rounds // 3
    assert res.stats.accepted_at_depth[1] == res.stats.accepted_at_depth[2] == rounds - rounds // 3


def test_trained_like_heads_keep_greedy_and_sampled_decoding_lossless(tiny_target):
    heads = _trained_like(MedusaDrafter.from_target(tiny_target, num_heads=3, shared_head=False), seed=3)
    prompt, params = [3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_new_tokens=30)
    want = generate_vanilla(tiny_target, [prompt, prompt[:4]], params).tokens
    paths = best_rank_paths([[0.5, 0.2], [0.4, 0.2], [0.3, 0.1]], 6)
    for proposer in (MedusaProposer(heads, k=3), MedusaProposer(heads, paths=paths), MedusaProposer(heads, k=1)):
        got = generate_speculative(tiny_target, proposer, [prompt, prompt[:4]], params).tokens
        assert got == want
    # a one-token prompt has no cached token yet: the first round drafts nothing and still decodes correctly
    assert (
        generate_speculative(tiny_target, MedusaProposer(heads, k=2), [[7]], params).tokens
        == generate_vanilla(tiny_target, [[7]], params).tokens
    )


def medusa_args(root, out, *extra: str) -> list[str]:
    """The shipped Medusa-1 recipe on `tiny_recipe`'s target and data (raw text), sized to run in seconds."""
    return [
        *tiny_run_args("medusa1", root, out),
        "train.features=offline",
        f"train.features_dir={out / 'features'}",
        "train.epochs=1",
        "heads.tree_nodes=5",
        "heads.tree_ranks=2",
        "report.chain_from_cost_curve=false",
        "report.draft_model=null",
        "report.compare=[]",
        "report.temperatures=[0.0, 1.0]",
        *extra,
    ]


@pytest.mark.integration
def test_medusa1_recipe_trains_saves_exports_reports_and_resumes(tiny_recipe, tmp_path, capsys):
    import train.medusa as recipe

    out = tmp_path / "run"
    recipe.main(medusa_args(tiny_recipe, out, "train.max_steps=4"))
    printed = capsys.readouterr().out
    assert "heads: 3 x 1 ResBlock, shared lm_head" in printed and "offline cache" in printed
    for name in ("config.json", "model.safetensors", "report.json", "export-vllm/config.json", "state/step.json"):
        assert (out / name).exists(), name
    assert (out / "export-medusa" / "medusa_lm_head.pt").exists()
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "step" in r]
    assert [r["step"] for r in steps] == [2, 4] and len(steps[-1]["acc"]) == 3
    assert len(steps[-1]["eval/rank_acc"]) == 3 and len(steps[-1]["eval/rank_acc"][0]) == 2
    raw, info = read_checkpoint(out)
    assert info.method == "medusa" and 1 <= len(raw["tree_paths"]) <= 5
    report = json.loads((out / "report.json").read_text())
    rows = [r for r in report["results"] if r["proposer"] == "medusa"]
    greedy = [r for r in rows if r["temperature"] == 0.0]
    assert {r["setting"].split(" n")[0] for r in greedy} == {"chain 3", "static tree"}
    assert all(r["greedy_identical"] == 1.0 for r in greedy)
    first = load_file(str(out / "model.safetensors"))
    assert any(first[k].abs().sum() > 0 for k in first if k.endswith("linear.weight"))  # trained away from zero

    # resume with more steps; then the report mode on the checkpoint, beside an EAGLE-3 drafter of the same target
    recipe.main(medusa_args(tiny_recipe, out, "train.max_steps=6", "report.enabled=false"))
    assert "resumed at step 4" in capsys.readouterr().out
    target = TargetModel.from_config(recipe.TargetConfig(name_or_path=str(tiny_recipe / "target"), device="cpu"))
    Eagle3Drafter.from_target(target, draft_vocab_size=32).save_pretrained(tmp_path / "e3")
    recipe.main(
        [
            "report",
            "--drafter",
            str(out),
            "report.prompt_source=stdlib",
            "report.prompts=2",
            "report.max_new_tokens=8",
            "report.chain_k=2",
            "report.chain_from_cost_curve=false",
            "report.tree_total_tokens=0",
            "report.draft_model=null",
            f"report.compare=[{tmp_path / 'e3'}]",
            f"report.output_dir={tmp_path / 'rep'}",
            "report.typical_acceptance=true",
        ]
    )
    rows = json.loads((tmp_path / "rep" / "report.json").read_text())["results"]
    assert {r["proposer"] for r in rows} >= {"medusa", "eagle3", "prompt lookup"}
    exact = [r for r in rows if r["proposer"] in ("medusa", "eagle3") and not r["lossy"]]
    assert exact and all(r["greedy_identical"] == 1.0 for r in exact)
    typical = [r for r in rows if "typical" in r["setting"]]
    assert typical and all(r["lossy"] and r["proposer"] == "medusa" for r in typical)
    assert "(lossy)" in (tmp_path / "rep" / "report.md").read_text()


def test_fp32_heads_beside_a_bf16_target_evaluate_and_serve(tiny_recipe, tmp_path):
    """The data-scaling curve holds a loaded checkpoint in fp32 beside the target in its served dtype (bf16 on a CPU
    with fast bf16), outside the training step's autocast: the evaluation reads the hidden state in the blocks'
    dtype, as the training step does, the shared head reads its input in its own (the target's) dtype, and both the
    held-out evaluation and the served chain run."""
    import train.medusa as recipe
    from models.config import parse_cli
    from train.distributed import make_accelerator
    from train.loop import load_target_and_data

    args = medusa_args(tiny_recipe, tmp_path / "run", "target.dtype=bfloat16", "train.mixed_precision=fp32")
    cfg = parse_cli(recipe.MedusaRecipeConfig, args)
    accelerator, _ = make_accelerator(cfg.train, target=cfg.target)
    loaded = load_target_and_data(cfg, accelerator, lambda msg: None, None)
    assert loaded.target.lm_head.weight.dtype == torch.bfloat16
    heads = MedusaDrafter.from_target(loaded.target, 3, 1, True, loaded.tokenizer).float()
    result = recipe.evaluate(accelerator, loaded.target, heads, loaded.eval_set, cfg, loaded.pad_id, per_sample=True)
    acc = result["eval/acc"]
    assert len(acc) == 3 and all(0.0 <= a <= 1.0 for a in acc)
    # each held-out sample's counts (what pairs two drafters' evaluations) add up to the evaluation's accuracy
    table = result["per_sample"]
    assert len(table) == min(len(loaded.eval_set), cfg.train.eval_samples) and all(len(s) == 3 for s in table)
    for k in range(3):
        assert round(sum(s[k][0] for s in table) / sum(s[k][1] for s in table), 4) == acc[k]
    # and the curve's served chain: fp32 blocks, the shared head in bf16, greedy decoding keeps the target's tokens
    params = SamplingParams(max_new_tokens=6)
    served = generate_speculative(loaded.target, MedusaProposer(heads, k=3), [[5, 9, 11]], params).tokens
    assert served == generate_vanilla(loaded.target, [[5, 9, 11]], params).tokens


def test_lambda0_schedules_start_after_the_heads_warm_up():
    # one config for both families, each with its paper's defaults: Medusa-2's are a subclass's field defaults, so
    # they hold also where `key=value` overrides build the section from its type
    from pathlib import Path

    from models.config import load_config
    from train.joint import JointConfig
    from train.medusa import MedusaRecipeConfig
    from train.mtp import MTPRecipeConfig

    recipes = Path(__file__).resolve().parents[1] / "recipes" / "smollm2-135m"
    medusa = load_config(
        MedusaRecipeConfig, recipes / "medusa1.yaml", ["target.mode=joint", "train.features=online"]
    ).joint
    mtp = load_config(MTPRecipeConfig, recipes / "mtp.yaml", ["joint.lm_loss=kl"]).joint
    assert isinstance(medusa, JointConfig) and type(mtp) is JointConfig
    assert (medusa.lambda0, medusa.drafter_lr_multiplier, mtp.lambda0, mtp.drafter_lr_multiplier) == (
        0.2,
        4.0,
        1.0,
        1.0,
    )

    const = JointConfig(lambda0=0.2, drafter_warmup_steps=3)
    assert [const.lambda0_at(s) for s in (0, 2, 3, 10)] == [0.0, 0.0, 0.2, 0.2]
    linear = JointConfig(lambda0=0.2, lambda0_schedule="linear", lambda0_warmup_steps=4)
    assert [round(linear.lambda0_at(s), 3) for s in (0, 1, 3, 9)] == [0.05, 0.1, 0.2, 0.2]
    sine = JointConfig(lambda0=0.2, lambda0_schedule="sine", lambda0_warmup_steps=2)
    assert sine.lambda0_at(0) == pytest.approx(0.2 * 2**-0.5) and sine.lambda0_at(5) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="lambda0_schedule"):
        JointConfig(lambda0_schedule="cosine")


@pytest.mark.integration
def test_medusa2_trains_the_target_with_the_heads_and_the_checkpoint_loads_as_one(tiny_recipe, tmp_path, capsys):
    import train.medusa as recipe
    from models.loader import load_target
    from models.target import TargetConfig

    joint = ["target.mode=joint", "train.features=online", "joint.drafter_warmup_steps=2", "joint.lm_loss=kl"]
    out = tmp_path / "lora"
    recipe.main(
        medusa_args(tiny_recipe, out, *joint, "target.lora_rank=4", "train.max_steps=4", "report.temperatures=[0.0]")
    )
    printed = capsys.readouterr().out
    assert "joint with the target (LoRA r4)" in printed and "LM loss" in printed and "top-1 agreement" in printed
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    before = next(r for r in log if "before/lm_loss" in r)
    assert before["before/agreement"] == 1.0  # the original agrees with itself
    last = [r for r in log if "eval/agreement" in r][-1]
    assert 0.0 <= last["eval/agreement"] <= 1.0 and last["lm_loss"] >= 0.0
    assert [r["lambda0"] for r in log if "lambda0" in r] == [0.0, 0.2]  # steps 2 (heads warm-up) and 4
    assert (out / "target" / "adapter_config.json").exists() and read_checkpoint(out)[1].target_weights == "lora"
    # one pinned dtype: two "fastest" loads may each measure a different choice on a busy host
    base_cfg = TargetConfig(name_or_path=str(tiny_recipe / "target"), device="cpu", dtype="float32")
    base, changed = TargetModel.from_config(base_cfg), load_target(out, base_cfg)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    assert not torch.allclose(base(ids).logits, changed(ids).logits)  # the adapter trained and is applied
    rows = json.loads((out / "report.json").read_text())["results"]
    assert all(r["greedy_identical"] == 1.0 for r in rows if r["proposer"] == "medusa")
    # measured again later in report mode: the report still states the target's change (from the training log)
    again = [
        "report.prompts=1",
        "report.max_new_tokens=4",
        "report.temperatures=[0.0]",
        f"report.output_dir={out / 'again'}",
    ]
    recipe.main(["report", "--drafter", str(out), *medusa_args(tiny_recipe, out, *joint, "target.lora_rank=4", *again)])
    assert "top-1 agreement with the original 1.0000 → " in (out / "again" / "report.md").read_text()

    # full fine-tuning: the whole target is saved with the heads; during the heads warm-up it does not move
    out = tmp_path / "full"
    recipe.main(medusa_args(tiny_recipe, out, *joint, "train.max_steps=2", "report.enabled=false"))
    assert read_checkpoint(out)[1].target_weights == "full" and (out / "target" / "config.json").exists()
    assert torch.equal(load_target(out, base_cfg)(ids).logits, base(ids).logits)


@pytest.mark.integration
def test_medusa2_on_two_cpu_ranks_through_accelerate_launch(tiny_recipe, tmp_path):
    """Joint training under DDP (Medusa-1 under every engine: tests/test_engines.py)."""
    out = tmp_path / "medusa2"
    args = medusa_args(tiny_recipe, out, "train.max_steps=2", "report.enabled=false", "train.export=false")
    args += ["target.mode=joint", "target.lora_rank=4", "train.features=online", "joint.drafter_warmup_steps=1"]
    run_to_end("medusa.py", args, "ddp")
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    sharding = next(r["sharding"] for r in log if "sharding" in r)
    assert sharding["world"] == 2 and sharding["distinct_over_ranks"] == sharding["total_over_ranks"]
    assert read_checkpoint(out)[1].target_weights == "lora"
