"""The report's rows, everything but timing, pinned: `eval.report.run_report` on the tiny chat target, compared
field by field with ``tests/data/report_rows.json``, which the report wrote before its steps were split into a plan
(reading, serving, sizing, candidates), the timing loop and the row building. Anything the split changes in what is
measured (a proposer, a setting, a prompt, a token count, an acceptance tally, the identity evidence) fails here.

Regenerate the file only when a change of the rows is meant::

    DRAFTERS_WRITE_GOLDEN=1 python -m pytest -q tests/test_report_rows.py -k golden

Timing decides nothing in these rows: the chain length and tree are fixed (``chain_from_cost_curve`` off), the target
is pinned to fp32 (greedy answers and T = 1 draws seeded per batch), and the HF rows at T > 0, which draw from torch's
global generator, keep only what does not depend on the draw.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from eval.report import run_report
from eval.report_config import ReportConfig
from models.eagle3 import Eagle3Drafter
from models.mtp import MTPDrafter
from models.target import TargetConfig, TargetModel
from models.tokenizer import load_tokenizer
from tests.conftest import ROOT

GOLDEN = ROOT / "tests" / "data" / "report_rows.json"
FIELDS = (
    "proposer",
    "setting",
    "category",
    "temperature",
    "batch_size",
    "tau",
    "alpha",
    "accepted_at_depth",
    "attempted_at_depth",
    "verify_steps",
    "new_tokens",
    "vanilla_new_tokens",
    "greedy_identical",
    "prompts",
    "lossy",
    "max_new_tokens",
    "explained_divergences",
    "unexplained_divergences",
)
"""What the golden file keeps of each row. The divergence counts were first kept as the row's evidence in words; the
words changed since (one wording for reports and boards), so the file holds the counts those words stated (every
T = 0 row "fp32 1.00": no divergence; every other row "–": nothing compared), read back mechanically."""
QUESTIONS = [
    {"question_id": "w1", "category": "writing", "turns": ["Write a short note about the sea."]},
    {"question_id": "w2", "category": "writing", "turns": ["Describe a quiet morning.", "Now make it shorter."]},
    {"question_id": "c1", "category": "coding", "turns": ["def add(a, b):\n    return a + b\nExplain this function."]},
]
"""Two categories (rows for all prompts and for each), one question with two turns."""
CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)


def tiny_report_setup(root: Path, out: Path) -> tuple[TargetModel, object, Eagle3Drafter]:
    """The tiny recipe's target in fp32, its tokenizer with a chat template, a seeded EAGLE-3 drafter, and
    `QUESTIONS` written to ``out / "questions.jsonl"``."""
    path = str(root / "target")
    target = TargetModel.from_config(TargetConfig(name_or_path=path, dtype="float32", device="cpu"))
    tokenizer = load_tokenizer(path)
    tokenizer.chat_template = CHAT_TEMPLATE  # the recipe fixture's tokenizer has none; the prompt file needs one
    (out / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    torch.manual_seed(0)
    return target, tokenizer, Eagle3Drafter.from_target(target, draft_vocab_size=32, tokenizer=tokenizer)


def report_rows(root: Path, out: Path) -> list[dict]:
    """The report of a seeded EAGLE-3 drafter (chain and EAGLE-2 tree) beside an MTP one, the undistilled cut as a
    draft model and HF's assisted peers, on `QUESTIONS` at T 0 and 1 (batch size 1): the rows' kept
    fields (`FIELDS`)."""
    target, tokenizer, drafter = tiny_report_setup(root, out)
    MTPDrafter.from_target(target, 1, tokenizer).save_pretrained(out / "mtp")
    cfg = ReportConfig(
        prompts_path=str(out / "questions.jsonl"),
        max_new_tokens=8,
        chain_k=2,
        chain_from_cost_curve=False,
        tree_top_k=2,
        tree_depth=2,
        tree_total_tokens=4,
        draft_model="cut",
        draft_model_layers=1,
        hf_assisted=True,
        compare=[str(out / "mtp")],
        batch_sizes=[1],
        temperatures=[0.0, 1.0],
    )
    torch.manual_seed(0)
    rows = run_report(target, drafter, tokenizer, cfg, out / "report", log=lambda msg: None)
    kept = []
    for r in rows:
        row = {k: r.get(k) for k in FIELDS}
        if r["tau"] is None and r["temperature"] > 0:  # HF sampling from torch's global generator
            row["new_tokens"] = None
        kept.append(row)
    return kept


def _same(got, want, where: str) -> None:
    if isinstance(want, float) and isinstance(got, float):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), where
    elif isinstance(want, list) and isinstance(got, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def test_report_rows_match_the_golden_file(tiny_recipe, tmp_path):
    rows = report_rows(tiny_recipe, tmp_path)
    if os.environ.get("DRAFTERS_WRITE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert [(r["proposer"], r["setting"], r["category"], r["temperature"], r["batch_size"]) for r in rows] == [
        (r["proposer"], r["setting"], r["category"], r["temperature"], r["batch_size"]) for r in golden
    ]
    for got, want in zip(rows, golden):
        where = f"{want['proposer']} / {want['setting']} [{want['category']}] T {want['temperature']} bs {want['batch_size']}"
        for key in FIELDS:
            _same(got[key], want[key], f"{where}: {key}")


# ------------------------------------------------------------------------- rows from hand-made tallies


def _context(**kw):
    from eval.rows import RowContext

    return RowContext(
        **{
            "served": "float32",
            "drafter_dtype": "float32",
            "other_dtype": None,
            "machine": "test machine",
            "max_new_tokens": 16,
            "vanilla_loop": "plain",
            "vanilla_loop_ms": {"plain": 1.0},
        }
        | kw
    )


def test_rows_from_hand_made_tallies_give_the_hand_computed_tau_alpha_and_speedup():
    """Vanilla: 20 tokens in 2 s (10 tok/s) over 20 one-token steps of 80 ms; HF generate 5 tok/s, so the baseline is
    ours. The method: 20 tokens in 1 s over 8 verify forwards (τ = 20 / 8 = 2.5), depth 1 accepted 6 of 8 and depth
    2 3 of 6 (α = 0.75, 0.5), draft 20 ms + verify 80 ms a round: speedup 20 / 10 = 2.0, predicted
    2.5 · 80 / (20 + 80) = 2.0; both prompts identical to vanilla."""
    from eval.measure import Candidate
    from eval.rows import CellTallies, rows_from_tallies
    from infer.stats import GenerationStats

    cell = CellTallies(temperature=0.0, batch_size=1, repeats=1, prompts={"chat": 2})
    vanilla = GenerationStats(new_tokens=20, row_forwards=20, rounds=20, verify_s=1.6, bookkeeping_s=0.2, prefill_s=0.1)
    cell.vanilla.add("chat", 20, 2.0, vanilla)
    cell.hf.add("chat", 20, 4.0)
    drafted = GenerationStats(
        new_tokens=20,
        row_forwards=8,
        rounds=8,
        draft_s=0.16,
        verify_s=0.64,
        accepted_at_depth=[6, 3],
        attempted_at_depth=[8, 6],
    )
    candidate = Candidate("draft", "chain 2", lambda: None)
    cell.methods[candidate.key] = tally = type(cell.vanilla)()
    tally.add("chat", 20, 1.0, drafted, same=2, compared=2, prompt_tokens=12.0)

    (row,) = rows_from_tallies(cell, [candidate], _context())
    assert (row["proposer"], row["setting"], row["category"], row["prompts"]) == ("draft", "chain 2", "all", 2)
    assert row["tau"] == pytest.approx(2.5) and row["alpha"] == pytest.approx([0.75, 0.5])
    assert row["accepted_at_depth"] == [6, 3] and row["attempted_at_depth"] == [8, 6] and row["verify_steps"] == 8
    assert row["tokens_per_s"] == pytest.approx(20.0) and row["vanilla_tokens_per_s"] == pytest.approx(10.0)
    assert row["hf_generate_tokens_per_s"] == pytest.approx(5.0) and row["vanilla_dtype"] == "float32"
    assert row["speedup"] == pytest.approx(2.0) and row["predicted_speedup"] == pytest.approx(2.0)
    assert row["step_ms"] == pytest.approx({"draft_s": 20.0, "verify_s": 80.0, "bookkeeping_s": 0.0, "vanilla": 80.0})
    assert row["vanilla_ms"]["forward"] == pytest.approx(80.0) and row["vanilla_mean_answer_tokens"] == 10.0
    assert row["greedy_identical"] == row["greedy_identical_fp32"] == 1.0 and row["unexplained_divergences"] == 0
    assert row["per_call"] == [[12.0, 20, 8]] and not row["lossy"]


def test_rows_per_category_at_a_batch_without_hf_generate():
    """Above batch 1 HF generate makes no call: rows for all prompts and each category still come, without its rate;
    the faster vanilla of the two dtypes is the baseline."""
    from eval.measure import Candidate
    from eval.rows import CellTallies, Tally, rows_from_tallies
    from infer.stats import GenerationStats

    cell = CellTallies(temperature=1.0, batch_size=2, repeats=1, prompts={"chat": 2, "code": 4})
    candidate = Candidate("draft", "chain 1", lambda: None)
    cell.methods[candidate.key] = Tally()
    for cat, tokens in (("chat", 8), ("code", 24)):
        step = GenerationStats(new_tokens=tokens, row_forwards=tokens, rounds=tokens // 2, verify_s=0.1)
        cell.vanilla.add(cat, tokens, 1.0, step)
        cell.vanilla_other.add(cat, tokens, 0.5, step)  # the other dtype is twice as fast
        cell.methods[candidate.key].add(cat, tokens, 0.5, GenerationStats(new_tokens=tokens, row_forwards=tokens // 2))
    rows = rows_from_tallies(cell, [candidate], _context(other_dtype="bfloat16"))
    assert [(r["category"], r["prompts"], r["new_tokens"]) for r in rows] == [
        ("all", 6, 32),
        ("chat", 2, 8),
        ("code", 4, 24),
    ]
    assert all(r["hf_generate_tokens_per_s"] is None and r["vanilla_dtype"] == "bfloat16" for r in rows)
    assert [r["speedup"] for r in rows] == pytest.approx([1.0, 1.0, 1.0]) and rows[0]["tau"] == pytest.approx(2.0)
    assert rows[0]["greedy_identical"] is None  # T > 0: nothing compared


def test_greedy_only_methods_run_at_t0_only():
    from eval.measure import MeasuredPrompt, MeasurePlan

    plan = MeasurePlan(None, [], [MeasuredPrompt([1, 2])], (0,), greedy_only=frozenset({"draft model / chain 1"}))
    assert plan.runs("draft model / chain 1", 0.0) and not plan.runs("draft model / chain 1", 1.0)
    assert plan.runs("eagle3 / chain 2", 1.0)


def sized_report_config(out: Path, **kw) -> ReportConfig:
    """A report on `QUESTIONS` (in ``out``) that sizes its chain (up to 2) and tree (from 4 nodes) on this machine,
    with the priced hybrid and without the draft model or the chain neighbours, at batch 1."""
    return ReportConfig(
        prompts_path=str(out / "questions.jsonl"),
        max_new_tokens=8,
        chain_k=2,
        chain_neighbours=False,
        tree_total_tokens=4,
        hybrid_lookup=4,
        hybrid_priced_lookup=5,
        batch_sizes=[1],
        **{"draft_model": None, **kw},
    )


def test_a_report_with_tree_grid_measures_every_setting_beside_its_prediction(tiny_recipe, tmp_path, monkeypatch):
    """With the tree sized on the machine and ``tree_grid`` on, the drafter runs every setting of the grid, not only
    the chosen one; the report's tree check gives each setting's pilot prediction, its prediction on each pilot
    prompt and its measured speedup (the drafter's row, not the draft model's or the hybrid's of the same tree)."""
    import functools

    import eval.report as report_module
    from eval.cost_curve import size_tree, tree_name
    from infer.tree_search import DynamicTreeConfig

    grid = (DynamicTreeConfig(2, 2, 4), DynamicTreeConfig(2, 3, 6))
    monkeypatch.setattr(report_module, "size_tree", functools.partial(size_tree, grid=grid))
    monkeypatch.setattr("eval.cost_curve.PILOT_TOKENS", 8)
    target, tokenizer, drafter = tiny_report_setup(tiny_recipe, tmp_path)
    cfg = sized_report_config(tmp_path, tree_grid=True, temperatures=[0.0])
    rows = run_report(target, drafter, tokenizer, cfg, tmp_path / "report", log=lambda msg: None)
    names = {tree_name(g) for g in grid}
    drafter_trees = {r["setting"] for r in rows if r["proposer"] == "eagle3" and r["category"] == "all"}
    assert names <= drafter_trees
    check = json.loads((tmp_path / "report" / "report.json").read_text())["tree_sizing"]
    assert set(check["measured_speedup"]) == names and all(v > 0 for v in check["measured_speedup"].values())
    assert set(check["predicted_speedup"]) == names
    # 4 prompts (the two-turn question is two), fewer than the pilot's 6: it takes every one
    assert all(len(v) == 4 for v in check["predicted_speedup_by_pilot_prompt"].values())
    # the hybrid wraps the sized tree a level shallower, priced on the sizing's costs, and stays the target's greedy
    # output
    assert set(check["draft_and_bookkeeping_ms"]) == names
    hybrid = [r for r in rows if r["proposer"] == "eagle3 + prompt lookup" and r["category"] == "all"]
    shallower = one_level_shallower(check["setting"])
    assert [r["setting"] for r in hybrid] == [f"{shallower} + lookup 5, alone at 3-gram matches, priced"]
    assert hybrid[0]["greedy_identical"] == 1.0


def test_a_report_with_a_datastore_adds_its_two_rows_token_identical(tiny_recipe, tmp_path):
    """``report.datastore``: prompt lookup and the hybrid drafting from the target's own earlier answers, as rows of
    their own beside the plain ones, greedy identical to vanilla; a folder without shards is an error."""
    target, tokenizer, drafter = tiny_report_setup(tiny_recipe, tmp_path)
    answers = tmp_path / "answers"
    answers.mkdir()
    # the target's own greedy answers to the questions, cut in half: the store matches and then runs out
    from infer.generate import generate_vanilla
    from infer.sampling import SamplingParams

    rows = []
    for q in QUESTIONS:
        messages = [{"role": "user", "content": q["turns"][0]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        out = generate_vanilla(target, [list(ids)], SamplingParams(max_new_tokens=8)).tokens[0]
        rows.append({"messages": [*messages, {"role": "assistant", "content": tokenizer.decode(out[:4])}]})
    (answers / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = ReportConfig(
        prompts_path=str(tmp_path / "questions.jsonl"),
        max_new_tokens=8,
        chain_k=2,
        chain_from_cost_curve=False,
        tree_top_k=2,
        tree_depth=2,
        tree_total_tokens=4,
        hybrid_lookup=4,
        datastore=[str(answers)],
        datastore_match=1,
        draft_model=None,
        batch_sizes=[1],
        temperatures=[0.0],
    )
    got = run_report(target, drafter, tokenizer, cfg, tmp_path / "report", log=lambda msg: None)
    overall = {r["proposer"]: r for r in got if r["category"] == "all"}
    assert {"prompt lookup + datastore", "eagle3 + prompt lookup + datastore", "eagle3 + prompt lookup"} <= set(overall)
    assert overall["prompt lookup + datastore"]["greedy_identical"] == 1.0
    assert overall["eagle3 + prompt lookup + datastore"]["greedy_identical"] == 1.0
    with pytest.raises(FileNotFoundError, match="no \\*.jsonl.gz or \\*.jsonl shards"):
        run_report(
            target,
            drafter,
            tokenizer,
            ReportConfig(**{**cfg.__dict__, "datastore": [str(tmp_path / "none")]}),
            tmp_path / "report2",
            log=lambda msg: None,
        )


def test_paired_speedup_resolves_a_steady_gain_and_not_a_coin_flip():
    """Calls as [new tokens, seconds]. Twice as fast on every call: 2x with a point interval. Faster on half the
    calls and slower by as much on the other half: the interval spans 1 (the file does not resolve it). A gain on
    every call, however uneven: the interval lies above 1 and holds the point figure."""
    from eval.rows import paired_speedup

    base = [[100, 1.0 + 0.1 * i] for i in range(12)]
    assert paired_speedup([[t, s / 2] for t, s in base], base) == pytest.approx((2.0, 2.0, 2.0))
    flip = [[t, s * (0.7 if i % 2 else 1.3)] for i, (t, s) in enumerate(base)]
    ratio, low, high = paired_speedup(flip, base)
    assert low < 1.0 < high
    uneven = [[t, s / (1.05 + 0.1 * (i % 3))] for i, (t, s) in enumerate(base)]
    ratio, low, high = paired_speedup(uneven, base)
    assert 1.0 < low < ratio < high < 1.3
    with pytest.raises(ValueError, match="same prompts"):
        paired_speedup(base, base[:5])


def test_a_row_states_its_speedup_interval_and_the_report_its_ratio_to_prompt_lookup(tmp_path):
    """Each row pairs its calls with the baseline's (vanilla here, faster than HF generate); the report's resolution
    table states every row's speedup interval and its ratio to prompt lookup's on the same calls."""
    from eval.measure import Candidate
    from eval.report_md import write_report
    from eval.rows import LOOKUP_ROW, CellTallies, Tally, paired_speedup, rows_from_tallies
    from infer.stats import GenerationStats

    cell = CellTallies(temperature=0.0, batch_size=1, repeats=1, prompts={"chat": 6})
    lookup, learned = Candidate(*LOOKUP_ROW, lambda: None), Candidate("draft", "chain 2", lambda: None)
    cell.methods = {lookup.key: Tally(), learned.key: Tally()}
    for i in range(6):
        cell.vanilla.add("chat", 50, 1.0 + 0.2 * i, GenerationStats(new_tokens=50, row_forwards=50, rounds=50))
        cell.hf.add("chat", 50, 2.0 + 0.2 * i)
        stats = GenerationStats(new_tokens=50, row_forwards=25, rounds=25)
        cell.methods[lookup.key].add("chat", 50, (1.0 + 0.2 * i) / (1.4 + 0.1 * (i % 2)), stats, 1, 1)
        cell.methods[learned.key].add("chat", 50, (1.0 + 0.2 * i) / (2.0 + 0.1 * (i % 3)), stats, 1, 1)
    rows = rows_from_tallies(cell, [lookup, learned], _context())
    base = [[50, 1.0 + 0.2 * i] for i in range(6)]
    for row in rows:
        low, high = row["speedup_interval"]
        assert low <= row["speedup"] <= high
        assert (row["speedup"], low, high) == pytest.approx(paired_speedup(row["timed"], base))
    assert 1.3 < rows[0]["speedup_interval"][0] and rows[1]["speedup_interval"][1] < 2.2
    write_report(tmp_path, "test", "tiny", rows)
    text = (tmp_path / "report.md").read_text()
    ratio, low, high = paired_speedup(rows[1]["timed"], rows[0]["timed"])
    assert 1.3 < low and f"| draft | chain 2 | {rows[1]['speedup']:.2f}x [" in text
    assert f"{ratio:.2f}x [{low:.2f}, {high:.2f}] |" in text


def one_level_shallower(tree: str) -> str:
    """The tree the hybrid wraps by default (``report.hybrid_shallower`` = 1): the sized one a level shallower, never
    below depth 2."""
    k, depth, total = map(int, re.fullmatch(r"EAGLE-2 k(\d+) d(\d+) n(\d+)", tree).groups())
    return f"EAGLE-2 k{k} d{max(2, depth - 1)} n{total}"


def test_each_temperature_measures_the_chains_and_tree_sized_at_it(tiny_recipe, tmp_path, monkeypatch):
    """With temperatures 0 and 1, each is sized by its own pilots (sampled at T = 1, without the checkpoint's greedy
    prior): a tree or chain chosen at one temperature and not the other is measured only where it was chosen, and
    the hybrid wraps each temperature's tree. The grid is one setting per temperature, so the choices differ. The
    draft model, measured greedily only, is sized at T = 0 alone."""
    import eval.report as report_module
    from eval.cost_curve import size_chain, size_tree, tree_name
    from infer.tree_search import DynamicTreeConfig

    grids = {0.0: (DynamicTreeConfig(2, 2, 4),), 1.0: (DynamicTreeConfig(2, 3, 6),)}
    chosen: dict[tuple[str, float], str] = {}

    def tree_at(*args, temperature=0.0, **kw):
        sized = size_tree(*args, grid=grids[temperature], temperature=temperature, **kw)
        chosen["tree", temperature] = tree_name(sized.tree)
        return sized

    def chain_at(target, make, ids, longest, eos, log, prior, samples, baseline=None, temperature=0.0):
        assert prior is None or temperature == 0.0  # held-out acceptance is a greedy figure
        sized = size_chain(target, make, ids, longest, eos, log, prior, samples, baseline, temperature)
        chosen.setdefault(("chain", temperature), f"chain {sized.k}")
        sizings.append(temperature)
        return sized

    sizings: list[float] = []

    monkeypatch.setattr(report_module, "size_tree", tree_at)
    monkeypatch.setattr(report_module, "size_chain", chain_at)
    monkeypatch.setattr("eval.cost_curve.PILOT_TOKENS", 8)
    target, tokenizer, drafter = tiny_report_setup(tiny_recipe, tmp_path)
    cfg = sized_report_config(
        tmp_path, temperatures=[0.0, 1.0], draft_model="cut", draft_model_layers=1, draft_model_sampled=False
    )
    rows = run_report(target, drafter, tokenizer, cfg, tmp_path / "report", log=lambda msg: None)
    for temp in (0.0, 1.0):
        mine = {r["setting"] for r in rows if r["proposer"] == "eagle3" and r["category"] == "all"
                and r["temperature"] == temp}  # fmt: skip
        assert mine == {chosen["chain", temp], chosen["tree", temp]}
        hybrid = [r["setting"] for r in rows if r["proposer"] == "eagle3 + prompt lookup" and r["category"] == "all"
                  and r["temperature"] == temp]  # fmt: skip
        assert len(hybrid) == 1 and hybrid[0].startswith(f"{one_level_shallower(chosen['tree', temp])} + lookup 5")
    assert chosen["tree", 0.0] != chosen["tree", 1.0]
    assert sizings == [0.0, 0.0, 1.0]  # the drafter's chain and the draft model's at T = 0; the drafter's at T = 1


def test_candidates_of_several_temperatures_merge_by_key_and_extras_run_at_every_temperature():
    """T = 0 chose chain 3 and a tree, T = 1 chain 2 and the same tree: the tree runs at both, each chain only where
    it was chosen; a T = 0 neighbour that is T = 1's choice (chain 2) is kept once and then runs at both."""
    from eval.measure import Candidate, MeasuredPrompt, MeasurePlan
    from eval.report import _per_temperature, _unique

    def cand(setting: str) -> Candidate:
        return Candidate("eagle3", setting, lambda: None)

    by_temperature = {0.0: [cand("chain 3"), cand("tree")], 1.0: [cand("chain 2"), cand("tree")]}
    measured, only_at = _per_temperature(by_temperature, [0.0, 1.0])
    assert [c.setting for c in measured] == ["chain 3", "tree", "chain 2"]
    assert only_at == {"eagle3 / chain 3": {0.0}, "eagle3 / chain 2": {1.0}}
    plan = MeasurePlan(None, measured, [MeasuredPrompt([1])], (), temperatures=(0.0, 1.0), only_at=dict(only_at))
    assert [plan.runs(c.key, t) for c in measured for t in (0.0, 1.0)] == [True, False, True, True, False, True]
    everything = _unique(measured, [cand("chain 2"), cand("chain 4")], only_at)
    assert [c.setting for c in everything] == ["chain 3", "tree", "chain 2", "chain 4"]
    assert only_at == {"eagle3 / chain 3": {0.0}}


def test_the_priced_hybrid_wraps_the_tree_it_is_given(tiny_recipe, tmp_path, monkeypatch):
    """``report.hybrid_tree``: the priced hybrid wraps that tree instead of the sized one (the tree row keeps the sized
    one) and stays the target's greedy output; a tree that is not [top_k, depth, total_tokens] is refused."""
    from eval.report_config import ReportConfig

    monkeypatch.setattr("eval.cost_curve.PILOT_TOKENS", 8)
    target, tokenizer, drafter = tiny_report_setup(tiny_recipe, tmp_path)
    cfg = sized_report_config(tmp_path, temperatures=[0.0], hybrid_tree=[2, 1, 3])
    rows = run_report(target, drafter, tokenizer, cfg, tmp_path / "report", log=lambda msg: None)
    sized = json.loads((tmp_path / "report" / "report.json").read_text())["tree_sizing"]["setting"]
    alone = {r["setting"] for r in rows if r["proposer"] == "eagle3" and r["category"] == "all"}
    hybrid = [r for r in rows if r["proposer"] == "eagle3 + prompt lookup" and r["category"] == "all"]
    assert sized in alone and sized != "EAGLE-2 k2 d1 n3"
    assert [r["setting"] for r in hybrid] == ["EAGLE-2 k2 d1 n3 + lookup 5, alone at 3-gram matches, priced"]
    assert hybrid[0]["greedy_identical"] == 1.0
    with pytest.raises(ValueError, match=r"hybrid_tree is \[top_k, depth, total_tokens\], got \[2, 3\]"):
        ReportConfig(hybrid_tree=[2, 3])
    with pytest.raises(ValueError, match="need top_k >= 1"):
        ReportConfig(hybrid_tree=[2, 0, 3])
