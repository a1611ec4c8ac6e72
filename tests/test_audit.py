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
from train.data.audit import answer_positions, audit_row, main, resplit
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


class Splitter(Agreeable):
    """Agreeable, except that it writes the text's token ``whole`` as ``piece`` (the first byte of its spelling) and
    then the rest: its greedy text re-encodes to ``whole``, as SmolLM2's "\\n\\n" re-encodes to "\\n", "\\n". With
    ``tie``, ``whole`` is within the threshold of ``piece`` there, and the error shows one token later instead: after
    a context holding ``whole``, one it never writes, it ranks token 0 first."""

    def __init__(self, vocab: int, bad: set[int], whole: int, piece: int, tie: bool) -> None:
        super().__init__(vocab, bad)
        self.whole, self.piece, self.tie = whole, piece, tie

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().lm_head(hidden)
        positions = hidden[:, 0].long()
        for row, p in enumerate(positions.tolist()):
            if self._ids[p + 1] == self.whole:
                logits[row, self.piece] = 10.5 if self.tie else 10.0
                logits[row, self.whole] = 10.0 if self.tie else 0.0
            if self.tie and self._ids[p] == self.whole:
                logits[row] = 0.0
                logits[row, 0] = 10.0
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
    run = answerer._Answering(tok, answerer.AnswerConfig(), shards, 0, True, (), None, probe=lambda: 0.0)
    assert run.shard_no == 6


def test_an_answer_the_target_split_otherwise_than_its_text_encodes_passes_and_a_wrong_one_still_fails(
    tokenizers,  # noqa: F811
    monkeypatch,
):
    """Stored text loses the target's own token split; the audit replays it (`resplit`) instead of failing the answer,
    whether the split shows at its own token or, after a near tie, one token later."""
    import train.data.audit as audit

    tok = tokenizers["reference"]
    span = resolve_span_method(tok)
    plain = _stand_in(tok)
    row = _rows()[1]
    ids, mask = tokenize_conversation(tok, row["messages"], span)
    found = None
    for p in answer_positions(mask):
        spelled = tok.convert_ids_to_tokens(ids[p + 1])
        piece = tok.convert_tokens_to_ids(spelled[0])
        if len(spelled) > 1 and ids[p + 1] not in ids[: p + 1] and resplit(tok, ids, mask, p, piece) is not None:
            found = ids[p + 1], piece
            break
    assert found, "no answer token of the test conversation can be split"
    for tie in (False, True):
        model = Splitter(len(tok), plain.bad, *found, tie=tie)
        result = audit_row(model, tok, row, span, threshold=1.0)
        assert result["above"] == 0 and result["resplits"] == ids.count(found[0]), result
        result = audit_row(model, tok, _spoiled(row, "s"), span, threshold=1.0)
        assert result["above"] >= 3 and result["max_gap"] == 10.0, result
    # without the replay the same answer fails: at the split token, or (near tie) at the token after it
    monkeypatch.setattr(audit, "RESPLITS", 0)
    for tie in (False, True):
        result = audit_row(Splitter(len(tok), plain.bad, *found, tie=tie), tok, row, span, threshold=1.0)
        assert result["above"] >= 1 and result["max_gap"] == 10.0 and result["resplits"] == 0, result
