"""The leaderboard (eval/leaderboard.py) end to end on a tiny chat target: cells of the shared report over a
Spec-Bench-format file at two temperatures, resumed without redoing finished cells, a failing cell reported while
the others go on, and md / csv / json / PNG outputs."""

import csv
import json
import re
import shutil

import pytest

import eval.report as report_module
from eval.leaderboard import Cell, LeaderboardConfig, cells_of, main, report_config
from models.eagle3 import Eagle3Drafter
from models.target import TargetConfig, TargetModel
from models.tokenizer import load_tokenizer
from tests.test_data import CHAT_TEMPLATE

QUESTIONS = [
    {"question_id": "a-1", "category": "writing", "turns": ["Write two lines about rain.", "Now make it shorter."]},
    {"question_id": "b-1", "category": "math", "turns": ["What is 12 plus 30? Explain step by step."]},
]


@pytest.fixture
def board_setup(tiny_recipe, tmp_path):
    target_dir = tmp_path / "target"
    shutil.copytree(tiny_recipe / "target", target_dir)
    tok = load_tokenizer(str(target_dir))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(target_dir)
    target = TargetModel.from_config(TargetConfig(name_or_path=str(target_dir), dtype="float32", device="cpu"))
    Eagle3Drafter.from_target(target, draft_vocab_size=16, tokenizer=tok).save_pretrained(tmp_path / "e3")
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return tmp_path, questions


def test_cells_cover_sources_and_batch_sizes_with_every_temperature_in_one_run():
    cfg = LeaderboardConfig(
        prompts_paths=["x/q.jsonl"], categories=["chat", "code"], temperatures=[1.0, 0.0], batch_sizes=[1, 4]
    )
    cells = cells_of(cfg)
    # a file and the built-in categories together, each at both batch sizes; both temperatures in each run
    assert len(cells) == 5 and cells[0] == Cell("x/q.jsonl", (0.0, 1.0), 1) and cells[0].key == "q__T0-1__bs1"
    assert cells[3] == Cell("builtin:chat,code", (0.0, 1.0), 4) and cells[3].key == "chat-code__T0-1__bs4"
    assert cells[3].categories == ["chat", "code"] and cells[0].categories == []
    board_cfg = report_config(cfg, cells[3])
    assert board_cfg.categories == ["chat", "code"] and board_cfg.temperatures == [0.0, 1.0]
    assert not board_cfg.chain_neighbours  # a board ranks what would be served; the sizing check is a report's
    assert not board_cfg.draft_model_tree  # the draft-model baseline in one row, its chain
    assert board_cfg.prompts == 3 and report_config(cfg, cells[0]).prompts is None  # a file is measured whole
    # the compared drafters give one row each (their chain); the draft-model baseline is measured at T = 0 only
    assert board_cfg.compare_settings == 1 and not board_cfg.draft_model_sampled
    # the batch-aware sweep: one more cell at T = 0 over every sweep batch size
    assert (
        cells[-1] == Cell("builtin:chat", (0.0,), 64, (1, 4, 16, 64)) and cells[-1].key == "chat__T0__sweep_bs1-4-16-64"
    )
    assert len(cells_of(LeaderboardConfig(categories=["chat"], temperatures=[0.0], batch_sweep=[]))) == 1
    with pytest.raises(ValueError):
        cells_of(LeaderboardConfig(categories=[]))
    with pytest.raises(ValueError):
        cells_of(LeaderboardConfig(temperatures=[]))


def test_the_leaderboard_runs_resumes_and_reports_a_failing_cell(board_setup, monkeypatch):
    root, questions = board_setup
    out = root / "board"
    args = [
        f"drafters=[{root / 'e3'}]",
        f"prompts_paths=[{questions},{root / 'missing.jsonl'}]",
        "categories=[]",
        "temperatures=[0.0,1.0]",
        "max_new_tokens=6",
        "draft_model=cut",
        "fp32_certificate=false",
        "batch_sweep=[1,2]",
        f"out={out}",
    ]
    calls = []
    real = report_module.run_report

    def counting(*a, **k):
        calls.append(a[4])
        return real(*a, **k)

    monkeypatch.setattr(report_module, "run_report", counting)
    board = main(args)
    status = {c["cell"]: c["status"] for c in board["cells"]}
    assert status == {
        "questions__T0-1__bs1": "done",
        "missing__T0-1__bs1": "failed",
        "chat__T0__sweep_bs1-2": "done",
    }
    methods = {(r["proposer"], r["setting"]) for r in board["results"]}
    assert ("prompt lookup", "chain 10") in methods and ("HF prompt lookup (10)", "HF generate") in methods
    assert any(p == "eagle3 + prompt lookup" for p, _ in methods)  # the hybrid row
    assert any(p.startswith("draft model") for p, _ in methods)
    assert {r["cell"] for r in board["results"]} == {"questions__T0-1__bs1", "chat__T0__sweep_bs1-2"}
    assert {r["temperature"] for r in board["results"] if r["cell"] == "questions__T0-1__bs1"} == {0.0, 1.0}
    # the sweep: vanilla's peers at both batch sizes, the batch-aware row among them, nothing but chains
    swept = [r for r in board["results"] if r["sweep"]]
    assert {r["batch_size"] for r in swept} == {1, 2}
    auto = [r for r in swept if r["setting"].startswith("auto (bs1:")]
    assert {r["batch_size"] for r in auto} == {1, 2} and all(r["unexplained_divergences"] == 0 for r in auto)
    assert not any("EAGLE-2" in r["setting"] or r["proposer"].startswith("draft model") for r in swept)
    # every sweep batch decoded 3 times per method in turn (sweep_repeats), vanilla's spread over them kept
    assert {(r["batch_size"], r["batch_repeats"]) for r in swept} == {(1, 3), (2, 3)}
    assert all(r["vanilla_repeat_spread"] is not None for r in swept)
    assert all(r["max_new_tokens"] == 32 for r in swept)
    greedy = [r for r in board["results"] if r["temperature"] == 0.0 and r.get("tau")]
    assert greedy and all(r["unexplained_divergences"] == 0 for r in greedy)  # bf16 near-ties may be explained
    assert all(r["per_call"] for r in greedy)

    md = (out / "leaderboard.md").read_text()
    assert "## T = 0, batch size 1" in md and "## T = 1, batch size 1" in md
    assert "| method | math | writing | mean τ | overall | lossless evidence |" in md
    # eval.leaderboard.evidence, in the dtype the precision policy served the tiny target in
    assert re.search(r"\| greedy identical 100 % in (bf16|fp32)", md) and "lossless rule (rejection sampling)" in md
    assert "`missing__T0-1__bs1`: failed" in md
    assert "## Speedup against batch size" in md and "| method | bs 1 | bs 2 | lossless evidence |" in md
    assert re.search(r"\| \*noise: vanilla's own spread over the repeats\* \| ±\d+% \| ±\d+% \|", md)
    assert "## T = 0, batch size 2" not in md  # the sweep's rows have their own table, not the per-category ones
    with open(out / "leaderboard.csv") as f:
        assert len(list(csv.DictReader(f))) == len(board["results"])
    for png in ("speedup_by_category", "acceptance_by_position", "speedup_by_batch", "tau_by_prompt_length"):
        assert (out / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    calls.clear()
    again = main(args)
    assert {c["cell"]: c["status"] for c in again["cells"]}["questions__T0-1__bs1"] == "reused"
    assert all("missing" in str(folder) for folder in calls)  # finished cells are not measured again
    assert len(again["results"]) == len(board["results"])


def test_the_readme_block_is_generated_from_the_leaderboard_json(tmp_path):
    from eval.leaderboard_tables import README_BEGIN, README_END, readme_table, update_readme

    row = {"proposer": "eagle3", "setting": "chain 3", "category": "all", "temperature": 0.0, "batch_size": 1,
           "speedup": 1.25, "tau": 2.0, "new_tokens": 100, "tokens_per_s": 25.0, "vanilla_new_tokens": 100,
           "vanilla_tokens_per_s": 20.0, "lossy": False, "greedy_identical": 1.0, "dtype": "float32",
           "divergences": [], "explained_divergences": 0, "cell": "q__T0__bs1", "source": "q.jsonl"}  # fmt: skip
    board = {"target": "t", "machine": "m", "created": "now", "results": [row],
             "cells": [{"cell": "q__T0__bs1", "source": "q.jsonl", "status": "done"}]}  # fmt: skip
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{README_BEGIN}\nold\n{README_END}\n\nmore\n")
    update_readme(board, readme)
    text = readme.read_text()
    assert "old" not in text and text.endswith(f"{README_END}\n\nmore\n")
    assert (
        "| eagle3 (chain 3) | 1.25x | 2.00 | greedy identical 100 % in fp32 |" in text and readme_table(board) in text
    )
    readme.write_text("no block")
    with pytest.raises(ValueError):
        update_readme(board, readme)


def test_the_readme_table_is_the_shipped_leaderboard_s():
    """The README's results block is `readme_table` of the committed docs/leaderboard/leaderboard.json, so a table
    edited by hand, or a leaderboard rerun without regenerating the README, fails here."""
    from pathlib import Path

    from eval.leaderboard_tables import README_BEGIN, README_END, readme_table

    root = Path(__file__).resolve().parents[1]
    board = json.loads((root / "docs" / "leaderboard" / "leaderboard.json").read_text())
    text = (root / "README.md").read_text()
    block = text.split(README_BEGIN, 1)[1].split(README_END, 1)[0].strip()
    assert block == readme_table(board)
    assert board["results"] and all(c["status"] in ("done", "reused") for c in board["cells"])


def test_a_cell_from_another_kind_of_machine_is_measured_again_unless_reuse_is_asked(tmp_path):
    from eval.leaderboard import collect, run_cells
    from eval.leaderboard_tables import machines_words

    here = {"device": "cpu", "name": "EPYC", "flags": ["avx2"], "threads": 2, "words": "EPYC (avx2), 2 threads"}
    there = here | {"flags": ["avx2", "avx512_bf16"], "words": "EPYC (avx2, avx512_bf16), 2 threads"}
    cfg = LeaderboardConfig(
        prompts_paths=["q/chat.jsonl", "q/code.jsonl"],
        categories=[],
        temperatures=[0.0],
        batch_sweep=[],
        out=str(tmp_path),
    )
    measured = []

    def run_cell(cell, folder, machine=here):
        measured.append(cell.key)
        (folder / "report.json").write_text(json.dumps({"target": "t", "machine": machine, "results": []}))

    run_cells(cfg, run_cell, here=here)
    assert measured == ["chat__T0__bs1", "code__T0__bs1"]
    measured.clear()
    run_cells(cfg, run_cell, here=here)
    assert measured == []  # same settings, same machine: reused
    measured.clear()
    statuses = run_cells(cfg, lambda c, f: run_cell(c, f, there), here=there)
    assert measured == ["chat__T0__bs1", "code__T0__bs1"]  # another kind: measured again, there
    # code measured here again; chat kept from the other machine on request, and the board names both
    cfg.reuse_other_machines = True
    measured.clear()
    (tmp_path / "cells" / "code__T0__bs1" / "report.json").unlink()
    statuses = run_cells(cfg, run_cell, here=here)
    assert measured == ["code__T0__bs1"] and [s["status"] for s in statuses] == ["reused", "done"]
    board = collect(cfg, statuses)
    assert board["machine"] == (
        "EPYC (avx2, avx512_bf16), 2 threads (cells chat__T0__bs1); EPYC (avx2), 2 threads (cells code__T0__bs1)"
    )
    assert machines_words([{"cell": "a", "machine": "m"}, {"cell": "b", "machine": "m"}]) == "m"


def test_a_drafter_trained_again_under_the_same_path_is_measured_again(tmp_path):
    from eval.leaderboard import run_cells

    here = {"device": "cpu", "name": "EPYC", "flags": ["avx2"], "threads": 2, "words": "EPYC (avx2), 2 threads"}
    drafter = tmp_path / "models" / "d"
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text("{}")
    (drafter / "model.safetensors").write_bytes(b"weights one")
    cfg = LeaderboardConfig(
        drafters=[str(drafter)], prompts_paths=["q/chat.jsonl"], categories=[], temperatures=[0.0], batch_sweep=[],
        out=str(tmp_path / "board"),
    )  # fmt: skip
    measured = []

    def run_cell(cell, folder):
        measured.append(cell.key)
        (folder / "report.json").write_text(json.dumps({"target": "t", "machine": here, "results": []}))

    run_cells(cfg, run_cell, here=here)
    run_cells(cfg, run_cell, here=here)
    assert measured == ["chat__T0__bs1"]  # the same weights: reused
    (drafter / "model.safetensors").write_bytes(b"weights two")
    statuses = run_cells(cfg, run_cell, here=here)
    assert measured == ["chat__T0__bs1"] * 2 and statuses[0]["status"] == "done"


def test_a_report_setting_added_later_keeps_finished_cells_only_while_it_is_off():
    """A cell measured before a setting existed ran without that feature: it still stands for a setting added off
    (the tree grid), not for one added on (the priced hybrid, which changes what the hybrid row verifies)."""
    from eval.leaderboard import _fingerprint, same_settings

    cfg = LeaderboardConfig(categories=["chat"], batch_sweep=[])
    now = _fingerprint(cfg, cells_of(cfg)[0])
    assert now["report"]["tree_grid"] is False and now["report"]["hybrid_priced"] is True

    def without(key: str) -> dict:
        return {**now, "report": {k: v for k, v in now["report"].items() if k != key}}

    assert same_settings(now, now) and same_settings(without("tree_grid"), now)
    assert not same_settings(without("tree_grid"), {**now, "report": {**now["report"], "tree_grid": True}})
    assert not same_settings(without("hybrid_priced"), now)
    assert same_settings(without("hybrid_priced"), {**now, "report": {**now["report"], "hybrid_priced": False}})
    assert not same_settings({**now, "report": {**now["report"], "prompts": 8}}, now)


ROW = {"proposer": "eagle3", "setting": "chain 3", "category": "all", "temperature": 0.0, "batch_size": 1,
       "speedup": 1.25, "tau": 2.0, "new_tokens": 100, "tokens_per_s": 25.0, "vanilla_new_tokens": 100,
       "vanilla_tokens_per_s": 20.0, "lossy": False, "prompts": 4, "dtype": "bfloat16", "greedy_identical": 0.25,
       "divergences": [{"explained": True}] * 3, "explained_divergences": 3, "greedy_identical_fp32": 1.0,
       "fp32_divergences": [], "alpha": [0.5, 0.5], "per_call": [[40, 50, 25]], "cell": "chat__T0__bs1",
       "source": "builtin:chat", "sweep": False}  # fmt: skip


def test_the_evidence_is_one_labelled_entry_per_method_pooled_over_categories():
    from eval.leaderboard_tables import tables
    from eval.report_md import evidence

    code = ROW | {"cell": "code__T0__bs1", "source": "builtin:code", "greedy_identical": 0.75,
                  "divergences": [{"explained": True}], "explained_divergences": 1}  # fmt: skip
    board = {"results": [ROW, code], "cells": []}
    ((_, _, cats, (entry,)),) = tables(board)
    assert cats == ["chat", "code"]  # each cell's "all" row named by its category
    assert entry["evidence"] == "greedy identical 50 % in bf16, all 4 divergences within bf16 rounding; fp32 100 %"
    bad = code | {"explained_divergences": 0, "greedy_identical_fp32": None}
    assert evidence([bad]) == (
        "greedy identical 75 % in bf16, 1 of 1 divergence NOT explained by bf16 rounding; fp32 replay not run"
    )
    assert evidence([ROW | {"temperature": 1.0, "greedy_identical": None}]) == "lossless rule (rejection sampling)"
    assert evidence([ROW | {"lossy": True}]).startswith("lossy")
    # rows whose certificate replayed only the divergences: counted over the replays
    replayed = {"fp32_replays": 3, "fp32_replays_identical": 3, "greedy_identical_fp32": 1.0}
    both = [ROW | replayed, code | {"fp32_replays": 1, "fp32_replays_identical": 0, "greedy_identical_fp32": 0.0,
                                    "fp32_divergences": [{"explained": False}]}]  # fmt: skip
    assert evidence(both) == (
        "greedy identical 50 % in bf16, all 4 divergences within bf16 rounding; "
        "fp32 replay from the first differing token: 3 of 4 identical (1 unexplained divergence in fp32)"
    )
    none_diverged = ROW | {"greedy_identical": 1.0, "divergences": [], "explained_divergences": 0, "fp32_replays": 0,
                           "fp32_replays_identical": 0, "greedy_identical_fp32": None}  # fmt: skip
    assert evidence([none_diverged]) == "greedy identical 100 % in bf16"


def test_plots_without_a_sweep_have_no_batch_plot_and_counted_acceptance_is_unconditional(tmp_path):
    from eval.leaderboard_plots import _plot_acceptance, write_plots
    from eval.leaderboard_tables import write_markdown

    stale = tmp_path / "speedup_by_batch.png"
    stale.write_bytes(b"old")
    board = {
        "target": "t",
        "machine": "m",
        "created": "now",
        "results": [ROW],
        "cells": [{"cell": "chat__T0__bs1", "status": "done"}],
    }
    names = sorted(p.name for p in write_plots(board, tmp_path))
    assert names == ["acceptance_by_position.png", "speedup_by_category.png", "tau_by_prompt_length.png"]
    assert not stale.exists()  # batch 1 alone is no sweep
    write_markdown(board, tmp_path / "leaderboard.md")
    assert "speedup_by_batch" not in (tmp_path / "leaderboard.md").read_text()

    import matplotlib.pyplot as plt

    saved = []
    real_savefig = plt.Figure.savefig
    plt.Figure.savefig = lambda fig, path, **kw: saved.append(fig) or real_savefig(fig, path, **kw)
    try:  # 10 verify steps, 4 accepted a first draft and 2 a second: 0.4 and 0.2 whatever α says
        counted = ROW | {"verify_steps": 10, "accepted_at_depth": [4, 2], "attempted_at_depth": [8, 4]}
        _plot_acceptance([counted], "head", tmp_path / "a.png")
        _plot_acceptance([ROW], "head", tmp_path / "b.png")
    finally:
        plt.Figure.savefig = real_savefig
    (line,) = saved[0].axes[0].get_lines()
    assert list(line.get_ydata()) == [0.4, 0.2] and "unconditional" in saved[0]._suptitle.get_text()
    (line,) = saved[1].axes[0].get_lines()
    assert list(line.get_ydata()) == [0.5, 0.5] and "conditional: α_k counts only" in saved[1]._suptitle.get_text()


def test_the_quick_start_table_says_its_evidence_in_words(capsys):
    from scripts.cli import print_closing_table

    row = ROW | {"proposer": "eagle3 (shipped)", "vanilla_dtype": "bfloat16"}
    print_closing_table([row])
    out = capsys.readouterr().out
    assert "lossless evidence" in out
    assert "greedy identical 25 % in bf16, all 3 divergences within bf16 rounding; fp32 100 %" in out
    assert " 0.25\n" not in out  # the bare share a newcomer read as "lossy"


def test_a_sweep_is_plotted_with_its_values_and_vanilla_s_spread(tmp_path):
    from eval.leaderboard_plots import write_plots
    from eval.leaderboard_tables import write_markdown

    swept = [
        ROW
        | {"cell": "chat__T0__sweep_bs1-4", "sweep": True, "batch_size": b, "speedup": s, "vanilla_repeat_spread": v}
        for b, s, v in ((1, 1.2, None), (4, 0.95, 0.1))
    ]
    cells = [{"cell": "chat__T0__bs1", "status": "done"},
             {"cell": "chat__T0__sweep_bs1-4", "status": "done", "sweep": [1, 4], "source": "builtin:chat"}]  # fmt: skip
    board = {"target": "t", "machine": "m", "created": "now", "results": [ROW, *swept], "cells": cells}
    assert (tmp_path / "speedup_by_batch.png") in write_plots(board, tmp_path)
    write_markdown(board, tmp_path / "leaderboard.md")
    md = (tmp_path / "leaderboard.md").read_text()
    assert "`speedup_by_batch.png`" in md and "| eagle3 (chain 3) | 1.20x | 0.95x |" in md and "±5%" in md
