"""Drafter families (infer/family.py, infer/families.py): a fourth family declared entirely in this file is saved,
loaded back by the shared loader and measured by the shared report without a shared file naming it; unknown methods
fail clearly; the shipped families' declarations agree with their proposers; no shared module names a family."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch import nn

from eval.report import candidates, run_report
from eval.report_config import ReportConfig, report_prompts
from infer.families import FAMILIES, family_of, load_drafter, lookup
from infer.family import ChainSizer, DrafterFamily, ProposerSetting, ReportSettings
from infer.generate import generate_vanilla
from infer.proposer import Proposer, TargetSignal
from infer.sampling import SamplingParams
from infer.tree import DraftTree, chain
from models.checkpoint import TargetInfo, read_checkpoint, read_weights, write_checkpoint
from models.eagle3 import Eagle3Drafter
from models.medusa import MedusaDrafter
from models.mtp import MTPDrafter
from models.target import TargetConfig, TargetModel
from models.tokenizer import load_tokenizer, stop_ids
from tests.conftest import ROOT

# ---------------------------------------------------------------------------------------- a toy family


class EchoHeads(nn.Module):
    """A toy fourth family: "heads" that draft the target's own greedy continuation (by running the target), a
    stand-in whose acceptance is known exactly: at T = 0 every draft is accepted. ``scale`` is there so that the
    checkpoint holds a weight to round-trip."""

    method: ClassVar[str] = "toy-echo"

    def __init__(self, num_drafts: int, target: TargetModel, target_info: TargetInfo) -> None:
        super().__init__()
        self.num_drafts, self.target_info, self._target = num_drafts, target_info, [target]
        self.scale = nn.Parameter(torch.ones(1))

    @property
    def target(self) -> TargetModel:
        return self._target[0]

    @classmethod
    def from_target(cls, target: TargetModel, num_drafts: int, tokenizer=None) -> EchoHeads:
        return cls(num_drafts, target, TargetInfo.of(target, tokenizer, method=cls.method))

    def save_pretrained(self, path: str | Path) -> None:
        write_checkpoint(path, "EchoHeads", {"num_drafts": self.num_drafts}, self.target_info, self.state_dict())

    @classmethod
    def from_pretrained(cls, path: str | Path, target: TargetModel, tokenizer=None) -> EchoHeads:
        raw, info = read_checkpoint(path)
        info.check(target, tokenizer)
        heads = cls(raw["num_drafts"], target, info)
        heads.load_state_dict(read_weights(path))
        return heads


class EchoProposer(Proposer):
    """``k`` drafts a round: the target's greedy tokens after the context (no cache: the toy is about plumbing)."""

    signal = TargetSignal.NONE

    def __init__(self, heads: EchoHeads, k: int) -> None:
        self.model, self.k = heads.target.model, k

    @torch.no_grad()
    def propose(self, contexts: list[list[int]], params: SamplingParams, generator: torch.Generator) -> DraftTree:
        rows = []
        for ctx in contexts:
            ids = torch.tensor([ctx], device=self.model.device)
            for _ in range(self.k):
                ids = torch.cat([ids, self.model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
            rows.append(ids[0, len(ctx) - 1 :])
        return chain(torch.stack(rows))


def echo_report_proposers(heads: EchoHeads, settings: ReportSettings, size: ChainSizer) -> list[ProposerSetting]:
    k = size(lambda n: EchoProposer(heads, n), min(settings.chain_k, heads.num_drafts))
    return [ProposerSetting(f"chain {k}", lambda: EchoProposer(heads, k))]


TOY = DrafterFamily(EchoHeads, lambda heads: EchoProposer.signal, echo_report_proposers)
"""The toy family's declaration; it is used by passing ``FAMILIES + (TOY,)`` (the shipped list stays as it is)."""
WITH_TOY = (*FAMILIES, TOY)


@pytest.fixture(scope="module")
def tiny_chat(tiny_recipe):
    """The recipe fixture's target (random tiny Llama) with its real BPE tokenizer."""
    path = str(tiny_recipe / "target")
    return TargetModel.from_config(TargetConfig(name_or_path=path, dtype="float32", device="cpu")), load_tokenizer(path)


# ------------------------------------------------------------------------------------------------ tests


def test_a_fourth_family_declared_in_a_test_is_loaded_and_reported_like_the_shipped_ones(tiny_chat, tmp_path):
    target, tokenizer = tiny_chat
    assert lookup("toy-echo", WITH_TOY) is TOY and TOY.method == "toy-echo"

    EchoHeads.from_target(target, num_drafts=3, tokenizer=tokenizer).save_pretrained(tmp_path / "echo")
    assert read_checkpoint(tmp_path / "echo")[1].method == "toy-echo"  # the name written comes from the class
    heads = load_drafter(tmp_path / "echo", target, tokenizer, WITH_TOY)
    assert isinstance(heads, EchoHeads) and heads.num_drafts == 3 and family_of(heads, WITH_TOY) is TOY

    Eagle3Drafter.from_target(target, draft_vocab_size=16, tokenizer=tokenizer).save_pretrained(tmp_path / "e3")
    cfg = ReportConfig(
        prompt_source="stdlib",
        prompts=2,
        max_new_tokens=12,
        chain_k=3,
        chain_from_cost_curve=False,
        tree_total_tokens=0,
        draft_model=None,
        compare=[str(tmp_path / "e3")],  # a shipped family beside the toy, in the same run
    )
    rows = run_report(target, heads, tokenizer, cfg, tmp_path / "report", log=lambda msg: None, families=WITH_TOY)

    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["method"] == "toy-echo"
    assert {(r["proposer"], r["setting"]) for r in rows} == {
        ("prompt lookup", "chain 10"),
        ("toy-echo", "chain 3"),
        (
            "toy-echo + prompt lookup",
            "chain 3 + lookup 10, alone at 3-gram matches",
        ),  # the hybrid row wraps the first drafter
        ("eagle3", "chain 3"),
    }
    echo = next(r for r in rows if r["proposer"] == "toy-echo")
    # every draft accepted: α = 1 at every depth, the target's own answers, and each round emits k + 1 = 4 tokens
    # until the answer ends (a stop token or the budget), so τ = Σ answer lengths / Σ ⌈length / 4⌉ exactly
    prompts, _ = report_prompts(cfg, tokenizer, target)
    eos = stop_ids(tokenizer, target.model)
    lengths = [
        len(generate_vanilla(target, [p.ids], SamplingParams(max_new_tokens=12), eos).tokens[0]) for p in prompts
    ]
    assert echo["alpha"] == [1.0, 1.0, 1.0] and echo["greedy_identical"] == 1.0
    assert echo["new_tokens"] == echo["vanilla_new_tokens"] == sum(lengths)
    assert echo["tau"] == pytest.approx(sum(lengths) / sum(-(-n // 4) for n in lengths))
    assert "| toy-echo | chain 3 | 0.0 | 1 | fp32 |" in (tmp_path / "report" / "report.md").read_text()
    # every row and the report say what precision and machine the numbers come from
    for r in rows:
        assert (
            r["dtype"] == r["drafter_dtype"] == "float32" and r["vanilla_dtype"] in r["vanilla_tokens_per_s_by_dtype"]
        )
        assert r["machine"] == report["machine"]["words"]
    assert set(report["machine"]) >= {"name", "flags", "threads", "torch", "kind", "words"}
    assert report["precision"]["dtype"] == "float32" and report["precision"]["source"] == "user"
    md = (tmp_path / "report" / "report.md").read_text()
    assert "**Precision**: target served in fp32, drafters in fp32" in md and report["machine"]["words"] in md


def test_an_unlisted_method_fails_at_load_time_naming_the_known_ones(tiny_target, tmp_path):
    EchoHeads.from_target(tiny_target, num_drafts=2).save_pretrained(tmp_path)  # its family is not in the list
    assert read_checkpoint(tmp_path)[1].method == "toy-echo"  # the block itself accepts any method name
    known = r"known: \['eagle3', 'medusa', 'mtp'\]"
    with pytest.raises(ValueError, match=rf"config.json: unknown drafter method 'toy-echo'; {known}"):
        load_drafter(tmp_path, tiny_target)
    with pytest.raises(ValueError, match=rf"no drafter family has the class EchoHeads; {known}"):
        family_of(EchoHeads.from_target(tiny_target, num_drafts=2))

    class Impostor(EchoHeads):
        method: ClassVar[str] = "eagle3"

    impostor = DrafterFamily(Impostor, lambda heads: TargetSignal.NONE, echo_report_proposers)
    with pytest.raises(ValueError, match="two families declare the method 'eagle3'"):
        lookup("eagle3", (*FAMILIES, impostor))


def test_a_block_without_a_method_is_refused_with_a_clear_error(tiny_target, tmp_path):
    MedusaDrafter.from_target(tiny_target, num_heads=2).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["drafters"]["method"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'drafters' block names no method"):
        load_drafter(tmp_path, tiny_target)


def test_the_shipped_drafter_still_names_its_family():
    _, info = read_checkpoint(ROOT / "models" / "smollm2_eagle3")
    assert lookup(info.method).drafter_class is Eagle3Drafter


def test_shipped_families_report_proposers_that_read_the_declared_signal(tiny_target):
    """Each family's report settings build proposers reading the signal its declaration names for that drafter (what
    the runtime computes for them; an MTP drafter's own setting), and the method the report labels them with is the
    drafter class's own."""
    medusa = MedusaDrafter.from_target(tiny_target, num_heads=2)
    medusa.config.tree_paths = [[0], [1], [0, 0]]
    drafters = [
        Eagle3Drafter.from_target(tiny_target, draft_vocab_size=16),
        medusa,
        MTPDrafter.from_target(tiny_target, 1),
        MTPDrafter.from_target(tiny_target, 1, input_signal="pre_norm"),
    ]
    cfg = ReportConfig(chain_k=2, typical_acceptance=True, tree_total_tokens=4, tree_top_k=2, tree_depth=2)
    settings, signals = {}, []
    for drafter in drafters:
        fam = family_of(drafter)
        assert fam.method == type(drafter).method and fam is lookup(fam.method)
        made = fam.report_proposers(drafter, cfg, lambda make, longest: longest)
        assert all(s.make().signal is fam.signal(drafter) for s in made)
        signals.append(fam.signal(drafter))
        settings[fam.method] = [s.setting for s in made]
    assert signals == [TargetSignal.AUX, TargetSignal.LAST_HIDDEN, TargetSignal.LAST_HIDDEN, TargetSignal.PRE_NORM]
    assert settings == {
        "eagle3": ["chain 2", "EAGLE-2 k2 d2 n4"],
        "medusa": ["chain 2", "chain 2, typical acceptance", "static tree n4"],
        "mtp": ["chain 1", "chain 2 (module 1 reused)", "top-2 tree n3"],
    }


def test_compare_settings_keeps_the_first_settings_of_compared_drafters_only(tiny_target):
    """``compare_settings=1``: each compared drafter contributes its family's first setting (its chain), while the
    measured drafter keeps every one of its own and the hybrid built from it; 0 keeps everything."""
    medusa = MedusaDrafter.from_target(tiny_target, num_heads=2)
    medusa.config.tree_paths = [[0], [1]]
    drafters = [
        Eagle3Drafter.from_target(tiny_target, draft_vocab_size=16),
        medusa,
        MTPDrafter.from_target(tiny_target, 1),
    ]
    base = dict(chain_k=2, tree_total_tokens=4, tree_top_k=2, tree_depth=2, draft_model=None, mtp_top_k=2)

    def rows(**over) -> list[tuple[str, str]]:
        cfg = ReportConfig(**base, **over)
        return [(c.proposer, c.setting) for c in candidates(drafters, cfg, None, tiny_target)]

    everything = rows()
    assert ("medusa", "static tree n3") in everything and ("mtp", "top-2 tree n3") in everything
    assert rows(compare_settings=1) == [
        ("eagle3", "chain 2"),
        ("eagle3", "EAGLE-2 k2 d2 n4"),
        ("eagle3 + prompt lookup", "EAGLE-2 k2 d2 n4 + lookup 10, alone at 3-gram matches"),
        ("medusa", "chain 2"),
        ("mtp", "chain 1"),
    ]
    assert rows(compare_settings=0) == everything
    with pytest.raises(ValueError, match="compare_settings"):
        ReportConfig(compare_settings=-1)
    # ``hybrid_tree``: the hybrid wraps that tree, priced or not; a family that drafts no EAGLE-2 tree is refused
    assert ("eagle3 + prompt lookup", "EAGLE-2 k2 d1 n3 + lookup 10, alone at 3-gram matches") in rows(
        hybrid_tree=[2, 1, 3]
    )
    with pytest.raises(ValueError, match="report.hybrid_tree is an EAGLE-2 tree: medusa drafts none"):
        candidates(drafters[1:], ReportConfig(**base, hybrid_tree=[2, 1, 3]), None, tiny_target)


def test_the_hybrid_wraps_the_sized_tree_a_level_shallower_and_prices_its_drafting_by_depth(tiny_target):
    """By default the hybrid's tree is the sized one ``hybrid_shallower`` levels shallower, never below depth 2; the
    price it is given (the sized tree's pilot) drafts one forward per level, so its drafting cost scales by depth."""
    from eval.cost_curve import TreeSizing
    from infer.tree_search import DynamicTreeConfig

    drafter = Eagle3Drafter.from_target(tiny_target, draft_vocab_size=16)
    sized = DynamicTreeConfig(top_k=2, depth=3, total_tokens=4)
    name = "EAGLE-2 k2 d3 n4"
    sizing = TreeSizing(sized, {name: 2.0}, {name: 1.0}, 0.02, {1: 0.02, 4: 0.024}, {name: [1.0]}, (sized,),
                        {name: (0.006, 0.001)})  # fmt: skip
    base = dict(chain_k=0, tree_total_tokens=4, tree_top_k=2, tree_depth=3, draft_model=None)

    def hybrid(**over):
        cfg = ReportConfig(**{**base, **over})
        (c,) = [c for c in candidates([drafter], cfg, None, tiny_target, tree_sizing=sizing) if "lookup" in c.proposer]
        return c.setting.split(" + ")[0], c.make().price

    setting, price = hybrid()
    assert setting == "EAGLE-2 k2 d2 n4" and price.draft_ms == pytest.approx(6.0 * 2 / 3)
    assert price.verify_ms == {1: 20.0, 4: 24.0} and price.overhead_ms == pytest.approx(1.0)
    setting, price = hybrid(hybrid_shallower=0)
    assert setting == name and price.draft_ms == pytest.approx(6.0)
    assert hybrid(hybrid_shallower=5)[0] == "EAGLE-2 k2 d2 n4"
    assert hybrid(tree_depth=2, hybrid_shallower=1)[0] == "EAGLE-2 k2 d2 n4"
    with pytest.raises(ValueError, match="hybrid_shallower must be >= 0"):
        ReportConfig(hybrid_shallower=-1)


def test_a_family_that_declares_its_draft_step_timings_is_timed_by_path(tiny_target):
    """`python -m eval.cost_curve_cli --drafter` prints the family's draft step by code path without naming the family:
    EAGLE-3 declares its module and fused steps; a family without the declaration is timed by none."""
    drafter = Eagle3Drafter.from_target(tiny_target, draft_vocab_size=16).eval()
    times = family_of(drafter).step_timings(drafter, tiny_target, 8, 2)
    assert set(times) == {"module", "fused"} and all(t > 0 for t in times.values())
    assert family_of(MTPDrafter.from_target(tiny_target, 1)).step_timings is None


def test_drafters_report_measures_any_checkpoint_without_a_recipe(tiny_chat, tmp_path):
    """``drafters report --drafter DIR`` (eval/report.py as a module): the target comes from the checkpoint's block,
    the rows from the family it names."""
    from scripts.cli import main

    target, tokenizer = tiny_chat
    MTPDrafter.from_target(target, 1, tokenizer).save_pretrained(tmp_path / "mtp")
    out = tmp_path / "out"
    settings = [
        "prompt_source=stdlib",
        "prompts=1",
        "max_new_tokens=6",
        "chain_k=1",
        "mtp_top_k=1",
        "draft_model=null",
        f"output_dir={out}",
    ]
    main(["report", "--drafter", str(tmp_path / "mtp"), *(f"report.{s}" for s in settings)])
    report = json.loads((out / "report.json").read_text())
    assert report["method"] == "mtp"
    assert [(r["proposer"], r["setting"]) for r in report["results"]] == [
        ("prompt lookup", "chain 10"),
        ("mtp", "chain 1"),
        ("mtp + prompt lookup", "chain 1 + lookup 10, alone at 3-gram matches"),
    ]


# ------------------------------------------------------------------------- shared code names no family

SHARED = ("eval/**/*.py", "scripts/*.py", "models/export.py", "models/sizing.py", "train/losses.py")
"""The shared modules: whatever they need of a family they read from its declaration."""


def _normal(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def family_names(source: str, families: tuple[DrafterFamily, ...] = FAMILIES) -> list[tuple[int, str]]:
    """Where ``source`` names a family: (line, what) for every identifier (a name, an attribute, a definition, an
    argument, a keyword), imported module or string literal whose letters and digits, lowercased, contain a family's
    method name ("Eagle3Drafter", "models.mtp", "mtp_top_k", "EAGLE-3 step" all name one; "EAGLE-2 tree" does not).
    Docstrings and comments are prose and may cite a family as an example; code may not."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):  # module / class / function docstrings, and the docstring under a field
            for before, stmt in zip([None, *body], body):
                prose = isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                if prose and (before is None or isinstance(before, (ast.Assign, ast.AnnAssign))):
                    docstrings.add(id(stmt.value))
    methods = [_normal(f.method) for f in families]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words = [node.id]
        elif isinstance(node, ast.Attribute):
            words = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            words = [node.name]
        elif isinstance(node, ast.arg):
            words = [node.arg]
        elif isinstance(node, ast.keyword):
            words = [node.arg or ""]
        elif isinstance(node, ast.alias):
            words = [node.name, node.asname or ""]
        elif isinstance(node, ast.ImportFrom):
            words = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words = [node.value]
        else:
            continue
        found += [(node.lineno, w) for w in words if any(m in _normal(w) for m in methods)]
    return sorted(set(found))


def test_the_family_name_finder_sees_code_and_not_prose():
    named = '''
"""A module docstring may cite EAGLE-3 and Medusa."""
import models.mtp
from infer.medusa_proposer import MedusaReportOptions
def size(cfg, eagle3_steps=1):  # a comment may say mtp
    """So may a function's."""
    label = "EAGLE-3 step"
    return cfg.mtp_top_k, tree(kind="EAGLE-2"), Eagle3Drafter, run(medusa=True)
'''
    assert sorted(w for _, w in family_names(named)) == [
        "EAGLE-3 step",
        "Eagle3Drafter",
        "MedusaReportOptions",
        "eagle3_steps",
        "infer.medusa_proposer",
        "medusa",
        "models.mtp",
        "mtp_top_k",
    ]
    assert family_names('"""Only prose: EAGLE-3, Medusa, MTP."""\nx = "EAGLE-2 tree"  # eagle3\n') == []
    # the method names come from the list passed: the toy's is a family name only where the toy is a family
    assert family_names("m = 'toy-echo'", WITH_TOY) == [(1, "toy-echo")] and family_names("m = 'toy-echo'") == []


def test_no_shared_module_names_a_family():
    """eval/, scripts/, the export and sizing machinery and the losses read what they need from the families'
    declarations."""
    naming = {}
    for pattern in SHARED:
        for path in sorted(ROOT.glob(pattern)):
            found = family_names(path.read_text())
            if found:
                naming[path.relative_to(ROOT).as_posix()] = found
    assert naming == {}


def test_the_hybrid_rounds_script_prints_the_split_of_a_drafters_rounds(tiny_chat, tmp_path, capsys, monkeypatch):
    """`scripts.hybrid_rounds` on a tiny EAGLE-3 checkpoint: one table row per kind of round, whose shares add up."""
    import scripts.hybrid_rounds
    from scripts.hybrid_rounds import main

    # the tiny tokenizer has no chat template: its prompts are the turns' plain tokens
    monkeypatch.setattr(
        scripts.hybrid_rounds, "chat_ids", lambda tok, messages: tok(messages[0]["content"])["input_ids"]
    )

    target, tokenizer = tiny_chat
    Eagle3Drafter.from_target(target, draft_vocab_size=16, tokenizer=tokenizer).save_pretrained(tmp_path / "e3")
    prompts = tmp_path / "p.jsonl"
    turns = ["say a a a a a a a a a", "count one two three one two three one two"]
    prompts.write_text("".join(json.dumps({"question_id": f"q{i}", "turns": [t]}) + "\n" for i, t in enumerate(turns)))
    main([str(tmp_path / "e3"), "--prompts", str(prompts), "--max-new-tokens", "8", "--tree", "2", "2", "3"])
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "%" in line]
    assert rows and {r[0].strip() for r in rows} <= {"none", "weak", "strong", "datastore", "lookup alone"}
    assert abs(sum(int(r[1].strip().rstrip("%")) for r in rows) - 100) <= len(rows)  # rounded shares
    assert "τ" in out and "tokens/s" in out
