"""The audit of self-distilled data (train/data/audit.py): answers that are the target's greedy text pass, an answer
whose tokens leave the argmax fails at the first such token, and --drop removes exactly the failing conversations so
the build answers them again. The target is a stand-in whose greedy choice is known exactly: every next token of
the text it reads, except where that token is one of ``BAD``, which it ranks 10 below another."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import torch

from tests.test_data import CONVERSATIONS, backend, tokenizers  # noqa: F401 (fixtures)
from train.data.audit import answer_positions, audit_row, main
from train.data.dataset import resolve_span_method, tokenize_conversation

BAD_WORD = " zebra"


class Agreeable:
    """Logits that put 10 on the token that follows in the text read, or, where that token is bad, on token 0."""

    def __init__(self, vocab: int, bad: set[int]) -> None:
        self.vocab, self.bad, self._ids = vocab, bad, None

    def eval(self) -> Agreeable:
        return self

    def to(self, device: str) -> Agreeable:
        return self

    def model(self, input_ids: torch.Tensor) -> SimpleNamespace:
        self._ids = input_ids[0]
        return SimpleNamespace(last_hidden_state=torch.arange(len(self._ids), dtype=torch.float)[None, :, None])

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = hidden[:, 0].long()
        nxt = self._ids[positions + 1]
        best = torch.where(torch.tensor([int(t) in self.bad for t in nxt]), torch.zeros_like(nxt), nxt)
        logits = torch.zeros(len(positions), self.vocab)
        logits[torch.arange(len(positions)), best] = 10.0
        return logits


def _stand_in(tok) -> Agreeable:
    """Bad: the tokens of ``BAD_WORD`` that no legitimate conversation holds."""
    span = resolve_span_method(tok)
    legit = {t for row in _rows() for t in tokenize_conversation(tok, row["messages"], span)[0]}
    bad = set(tok(BAD_WORD, add_special_tokens=False)["input_ids"]) - legit
    assert bad, f"every token of {BAD_WORD!r} is in the test conversations"
    return Agreeable(len(tok), bad)


def _rows() -> list[dict]:
    return [{"id": f"c{i}", "messages": m} for i, m in enumerate(CONVERSATIONS)]


def _spoiled(row: dict, new_id: str) -> dict:
    row = json.loads(json.dumps(row)) | {"id": new_id}
    last = max(i for i, m in enumerate(row["messages"]) if m["role"] == "assistant")
    row["messages"][last]["content"] = "It began well," + BAD_WORD * 3 + " and then it went on."
    return row


def test_answer_positions_skip_each_answers_last_token():
    # prompt, answer of 3 tokens, prompt, answer of 1 token: the last token of each answer is not checked
    assert answer_positions([0, 0, 1, 1, 1, 0, 0, 1]) == [1, 2]


def test_greedy_answers_pass_and_a_spoiled_answer_fails_where_it_leaves_the_argmax(tokenizers):  # noqa: F811
    tok = tokenizers["reference"]
    span = resolve_span_method(tok)
    model = _stand_in(tok)
    for row in _rows():
        result = audit_row(model, tok, row, span, threshold=1.0)
        assert result["checked"] > 0 and result["above"] == 0 and result["max_gap"] == 0.0, result
    spoiled = _spoiled(_rows()[0], "s")
    result = audit_row(model, tok, spoiled, span, threshold=1.0)
    ids, mask = tokenize_conversation(tok, spoiled["messages"], span)
    positions = answer_positions(mask)
    first_bad = next(k for k, p in enumerate(positions) if ids[p + 1] in model.bad)
    assert result["above"] == sum(ids[p + 1] in model.bad for p in positions) >= 3
    assert result["max_gap"] == 10.0 and result["first_above"] == first_bad


def test_drop_rewrites_the_shards_without_the_failing_conversations(tokenizers, tmp_path, monkeypatch):  # noqa: F811
    import transformers

    import models.reference
    import train.data.answerer as answerer

    tok = tokenizers["reference"]
    monkeypatch.setattr(models.reference, "resolve_target", lambda name: name)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: _stand_in(tok))
    good = _rows()
    shards = tmp_path / "answers"
    shards.mkdir()
    answerer._write_shard(shards, 0, 0, [good[0], _spoiled(good[1], "bad"), good[1]])
    answerer._write_shard(shards, 0, 1, [_spoiled(good[0], "bad2")])
    summary = main(["--target", "stand-in", "--data", str(shards), "--drop"])
    assert summary["conversations"] == 4 and summary["failing"] == summary["dropped"] == 2
    left = [json.loads(line) for f in sorted(shards.glob("*.jsonl.gz")) for line in gzip.open(f, "rt")]
    assert [r["id"] for r in left] == [good[0]["id"], good[1]["id"]]  # the all-failing second shard is gone
    report = [json.loads(line) for line in open(str(shards) + ".audit.jsonl")]
    assert sorted(r["id"] for r in report if r.get("above")) == ["bad", "bad2"]
    # a rerun finds every file closed in the report: nothing is audited (or dropped) twice
    again = main(["--target", "stand-in", "--data", str(shards), "--drop"])
    assert again == summary
    assert len(open(str(shards) + ".audit.jsonl").readlines()) == len(report)
    # the answerer numbers its next shard after the highest on disk, so a shard removed never means one overwritten
    answerer._write_shard(shards, 0, 5, [good[0]])
    run = answerer._Answering(tok, answerer.AnswerConfig(), shards, 0, True, (), None)
    assert run.shard_no == 6
