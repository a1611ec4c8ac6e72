"""train/data/ (dataset, stdlib samples, regeneration): formats, exact assistant masks (both span methods), skips,
truncation, packing, caching, stdlib samples and self-distillation, on a tiny byte-level BPE tokenizer trained here."""

from __future__ import annotations

import gzip
import json
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eval.stdlib_corpus import SourceFile  # noqa: E402
from train.data.chat_render import end_of_turn_token_ids  # noqa: E402
from train.data.dataset import (  # noqa: E402
    SKIP_REASONS,
    DataConfig,
    build_dataset,
    collate,
    detect_format,
    load_raw,
    packed_attention_mask,
)
from train.data.loops import LoopWatch, loop_tail, trim_loop_tails  # noqa: E402
from train.data.regenerate import regenerate_dataset  # noqa: E402
from train.data.stdlib_samples import build_stdlib_samples  # noqa: E402

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# A template with {% generation %} markers (the span method "generation"); the newline after an assistant turn is an
# expression because transformers renders with trim_blocks, which would eat a literal newline after the end tag.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>\n{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{{ '\\n' }}"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
EXTRA_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
QWEN_LIKE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}{{ raise_exception('system must come first') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_LIKE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# earlier assistant turns are rendered differently once later turns exist: the diff method must refuse
HISTORY_DROPPING = (
    "{% for message in messages %}{% if message['role'] == 'assistant' and not loop.last %}"
    "<|assistant|>\n(earlier answer)<|end|>\n"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# transformers renders with trim_blocks, which eats the newline right after {% endgeneration %}: drop it too
NO_MARKERS_REFERENCE = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
END_TOKEN = {"reference": "<|end|>", "qwen": "<|im_end|>", "llama3": "<|eot_id|>"}


def _corpus() -> list[str]:
    rng = random.Random(0)
    words = "the model data token train loss value return self def class import for if else while list dict".split()
    lines = []
    for i in range(300):
        name = "_".join(rng.sample(words, 2))
        lines.append(f"def {name}(x, y={i}):\n    return x + {name}(y)\n\n")
        lines.append(" ".join(rng.choices(words, k=8)).capitalize() + ".\n")
    return lines


@pytest.fixture(scope="session")
def backend():
    return backend_json()


def backend_json() -> str:
    """A 600-token byte-level BPE with the special tokens of every template below (serialised)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL_TOKENS + EXTRA_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok.to_str()


def make_tokenizer(backend: str, template: str):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(backend),
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[3:] + EXTRA_SPECIAL,
        chat_template=template,
    )


@pytest.fixture(scope="session")
def tokenizers(backend):
    return {
        "reference": make_tokenizer(backend, CHAT_TEMPLATE),
        "reference_no_markers": make_tokenizer(backend, NO_MARKERS_REFERENCE),
        "qwen": make_tokenizer(backend, QWEN_LIKE),
        "llama3": make_tokenizer(backend, LLAMA3_LIKE),
        "history_dropping": make_tokenizer(backend, HISTORY_DROPPING),
    }


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def decode(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def masked_runs(ids, mask) -> list[list[int]]:
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def assert_masks_exact(tokenizer, dataset, conversations, end_token, strip=False):
    """Each masked run decodes to exactly one assistant content followed by the end-of-turn token."""
    assert len(dataset) == len(conversations)
    for row, messages in zip(dataset, conversations):
        expected = [m["content"].strip() if strip else m["content"] for m in messages if m["role"] == "assistant"]
        got = [decode(tokenizer, run) for run in masked_runs(row["input_ids"], row["loss_mask"])]
        assert got == [content + end_token for content in expected]


CONVERSATIONS = [
    [{"role": "user", "content": "def f(x):"}, {"role": "assistant", "content": "    return x + 1"}],
    [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "A loop please."},
        {"role": "assistant", "content": "for i in range(3):\n    print(i)"},
        {"role": "user", "content": "And a class?"},
        {"role": "assistant", "content": "class Model:\n    pass\n"},
    ],
    # contents that open with newlines: byte-level BPE merges them with the template's newline
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "\n\ndef g():\n    return 2"}],
    [{"role": "user", "content": "the data"}, {"role": "assistant", "content": " value"}],
]
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


def as_sharegpt(messages: list[dict]) -> dict:
    return {"conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in messages]}


# --------------------------------------------------------------------------- config and formats
def test_config_validation():
    with pytest.raises(ValueError):
        DataConfig(path="x", format="alpaca")
    with pytest.raises(ValueError):
        DataConfig(path="x", max_length=1)
    with pytest.raises(ValueError):
        DataConfig(path="x", span_method="regex")
    with pytest.raises(ValueError):
        DataConfig(path="")
    assert DataConfig(path="x").max_length == 2048


def test_detect_format():
    assert detect_format(["conversations", "id"]) == "sharegpt"
    assert detect_format(["messages"]) == "messages"
    assert detect_format(["text", "meta"]) == "text"
    with pytest.raises(ValueError):
        detect_format(["prompt"])
    with pytest.raises(ValueError):
        detect_format(["text"], "messages")


# --------------------------------------------------------------------------- masks
@pytest.mark.parametrize("fmt", ["sharegpt", "messages"])
def test_masks_exact_with_generation_markers(tokenizers, tmp_path, fmt):
    rows = [as_sharegpt(c) if fmt == "sharegpt" else {"messages": c} for c in CONVERSATIONS]
    cfg = DataConfig(path=write_jsonl(tmp_path / "d.jsonl", rows), cache_dir=str(tmp_path / "cache"))
    ds, summary = build_dataset(cfg, tokenizers["reference"])
    assert summary["format"] == fmt and summary["span_method"] == "generation"
    assert summary["kept"] == len(CONVERSATIONS) and sum(summary["skipped"].values()) == 0
    assert_masks_exact(tokenizers["reference"], ds, CONVERSATIONS, "<|end|>")
    assert summary["loss_tokens"] == sum(sum(r["loss_mask"]) for r in ds)
    # the whole sequence is the rendered conversation, and nothing but assistant text is masked
    for row, messages in zip(ds, CONVERSATIONS):
        assert decode(tokenizers["reference"], row["input_ids"]) == tokenizers["reference"].apply_chat_template(
            messages, tokenize=False
        )


@pytest.mark.parametrize("name", ["qwen", "llama3", "reference_no_markers"])
def test_masks_exact_with_diff_method(tokenizers, tmp_path, name):
    cfg = DataConfig(
        path=write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVERSATIONS]),
        cache_dir=str(tmp_path / "cache"),
    )
    ds, summary = build_dataset(cfg, tokenizers[name])
    assert summary["span_method"] == "diff" and summary["kept"] == len(CONVERSATIONS)
    end = END_TOKEN["reference" if name == "reference_no_markers" else name]
    assert_masks_exact(tokenizers[name], ds, CONVERSATIONS, end, strip=name == "llama3")


def test_span_methods_agree(tokenizers, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVERSATIONS])
    results = []
    for name, method in (("reference", "generation"), ("reference", "diff"), ("reference_no_markers", "auto")):
        cfg = DataConfig(path=path, span_method=method, cache_dir=str(tmp_path / "cache"))
        ds, _ = build_dataset(cfg, tokenizers[name])
        results.append([(r["input_ids"], r["loss_mask"]) for r in ds])
    assert results[0] == results[1] == results[2]
    with pytest.raises(ValueError):
        build_dataset(DataConfig(path=path, span_method="generation"), tokenizers["qwen"])


def test_matches_transformers_assistant_mask_and_fixes_boundary_merge(tokenizers, tmp_path):
    """Where whole-text tokenisation has no token across a span edge, ids and mask equal apply_chat_template's
    (return_assistant_tokens_mask). Where BPE glues the template's newline to the content's leading newline
    or indentation, transformers' overlap rule masks that template character too; ours stays exact."""
    tok = tokenizers["reference"]
    cfg = DataConfig(path=write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVERSATIONS]))
    ds, _ = build_dataset(cfg, tok)
    kinds = set()
    for row, messages in zip(ds, CONVERSATIONS):
        hf = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        if row["input_ids"] == hf["input_ids"]:
            kinds.add("same")
            assert row["loss_mask"] == hf["assistant_masks"]
        else:
            kinds.add("merged")
            expected = [m["content"] + "<|end|>" for m in messages if m["role"] == "assistant"]
            hf_text = [decode(tok, run) for run in masked_runs(hf["input_ids"], hf["assistant_masks"])]
            assert hf_text != expected and all(h.endswith(e) for h, e in zip(hf_text, expected))
    assert kinds == {"same", "merged"}


def test_raw_text_mask(tokenizers, tmp_path):
    texts = ["import os\nprint(os.sep)\n", "def f():\n    return 1\n"]
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    tok = tokenizers["reference"]
    ds, summary = build_dataset(DataConfig(path=path, cache_dir=str(tmp_path / "c")), tok)
    assert summary["format"] == "text" and summary["kept"] == 2
    for row, text in zip(ds, texts):
        assert all(m == 1 for m in row["loss_mask"])
        assert row["input_ids"][0] == tok.bos_token_id and row["input_ids"][-1] == tok.eos_token_id
        assert decode(tok, row["input_ids"][1:-1]) == text
    ds, _ = build_dataset(DataConfig(path=path, loss_on_all_tokens_for_text=False, cache_dir=str(tmp_path / "c")), tok)
    assert all(r["loss_mask"][0] == 0 and r["loss_mask"][-1] == 0 and all(r["loss_mask"][1:-1]) for r in ds)


# --------------------------------------------------------------------------- skips and truncation
def test_bad_rows_counted_and_absent(tokenizers, tmp_path):
    good = [CONVERSATIONS[0], CONVERSATIONS[1]]
    long_user = "the model data token " * 200
    bad = {
        "missing_field": [
            {"conversations": None},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt"}]},
        ],
        "unknown_role": [{"conversations": [{"from": "robot", "value": "hi"}, {"from": "gpt", "value": "yo"}]}],
        "empty_conversation": [{"conversations": []}],
        "empty_assistant_turn": [
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": " \n"}]}
        ],
        "no_assistant_turn": [{"conversations": [{"from": "human", "value": "hi"}]}],
        "template_error": [
            {
                "conversations": [
                    {"from": "human", "value": "hi"},
                    {"from": "system", "value": "late"},
                    {"from": "gpt", "value": "yo"},
                ]
            }
        ],
        "over_length": [{"conversations": [{"from": "human", "value": long_user}, {"from": "gpt", "value": "ok"}]}],
    }
    rows = [as_sharegpt(good[0]), *[r for reason in bad for r in bad[reason]], as_sharegpt(good[1])]
    cfg = DataConfig(path=write_jsonl(tmp_path / "d.jsonl", rows), max_length=128, cache_dir=str(tmp_path / "c"))
    ds, summary = build_dataset(cfg, tokenizers["qwen"])
    assert summary["rows"] == len(rows) and summary["kept"] == 2
    assert summary["skipped"] == {reason: len(bad.get(reason, [])) for reason in SKIP_REASONS}
    assert_masks_exact(tokenizers["qwen"], ds, good, "<|im_end|>")


def test_span_not_found_counted(tokenizers, tmp_path):
    rows = [{"messages": c} for c in CONVERSATIONS]
    ds, summary = build_dataset(
        DataConfig(path=write_jsonl(tmp_path / "d.jsonl", rows)), tokenizers["history_dropping"]
    )
    assert summary["skipped"]["span_not_found"] == 1  # the one multi-turn conversation
    assert_masks_exact(tokenizers["history_dropping"], ds, [c for c in CONVERSATIONS if len(c) == 2], "<|end|>")


def test_truncation(tokenizers, tmp_path):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the model data token " * 40}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": messages}])
    full, _ = build_dataset(DataConfig(path=path), tokenizers["reference"])
    n = len(full[0]["input_ids"])
    cut, summary = build_dataset(DataConfig(path=path, max_length=n - 10), tokenizers["reference"])
    assert summary["truncated"] == 1 and summary["kept"] == 1
    assert cut[0]["input_ids"] == full[0]["input_ids"][: n - 10]
    assert cut[0]["loss_mask"] == full[0]["loss_mask"][: n - 10]


# --------------------------------------------------------------------------- loop tails
def test_loop_tail_counts_the_repetition_at_the_end_only():
    period = list(range(100, 120))  # a 20-token sentence said again and again
    looped = [1, 2, 3] + period * 4  # 3 + 80 tokens: from the 16th token of the 2nd period on, every 16-gram recurs
    assert loop_tail(looped) == 80 - 20 - 15
    assert loop_tail(looped + [7]) == 0  # ends on something new: not a loop tail
    assert loop_tail(list(range(60))) == 0
    assert loop_tail(period * 2, ngram=4) == 20 - 3  # a shorter n-gram starts the tail earlier
    assert loop_tail([5] * 10, ngram=16) == 0  # shorter than one n-gram
    watch, grown = LoopWatch(), [1, 2, 3]
    for piece in [[], period[:10], period[10:], period * 2, [7], period * 2]:  # the same tail token by token
        grown += piece
        assert watch.update(grown) == loop_tail(grown)


def test_trim_loop_tails_cuts_each_span_and_keeps_the_rest():
    period = list(range(100, 120))
    answer = [9] + period * 4  # its loop tail: 45 tokens
    ids = [1, 2] + answer + [3] + [4] + answer + [3]  # prompt, answer, end of turn, user, answer, end of turn
    mask = [0, 0] + [1] * len(answer) + [0, 0] + [1] * len(answer) + [0]
    out_ids, out_mask, dropped = trim_loop_tails(ids, mask, keep=5)
    kept_answer = answer[: len(answer) - 40]
    assert dropped == 80
    assert out_ids == [1, 2] + kept_answer + [3, 4] + kept_answer + [3]
    assert out_mask == [0, 0] + [1] * len(kept_answer) + [0, 0] + [1] * len(kept_answer) + [0]
    assert trim_loop_tails(ids, mask, keep=45) == (ids, mask, 0)  # a keep past the tail changes nothing
    closed = [1, 2] + answer + [8] + [3]  # the loss span closes with an end-of-turn mark the loop never held
    closed_mask = [0, 0] + [1] * (len(answer) + 1) + [0]
    assert trim_loop_tails(closed, closed_mask, keep=5) == ([1, 2] + kept_answer + [8, 3], [0, 0] + [1] * 42 + [0], 40)
    plain = [0, 0] + [1] * 30
    assert trim_loop_tails(list(range(32)), plain, keep=0) == (list(range(32)), plain, 0)


def test_loop_tail_keep_in_the_dataset(tokenizers, tmp_path):
    """``loop_tail_keep`` drops a looping answer's repetition past its first ``keep`` tokens and counts them; the
    answer's start, the end of turn and a loop-free sample are untouched; a negative keep is refused."""
    loop = "the model data token train loss value return. " * 12
    loop = loop.rstrip()  # an answer does not end on a space
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure: " + loop}]},
        {"messages": CONVERSATIONS[1]},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    full, summary_full = build_dataset(DataConfig(path=path), tokenizers["reference"])
    cut, summary = build_dataset(DataConfig(path=path, loop_tail_keep=4), tokenizers["reference"])
    assert summary_full["loop_tokens_dropped"] == 0
    ids, mask = full[0]["input_ids"], full[0]["loss_mask"]
    span = [t for t, m in zip(ids, mask) if m]
    assert loop_tail(span) == 0 < loop_tail(span[:-1])  # the loss span closes with the turn's end mark
    kept = [t for t, m in zip(cut[0]["input_ids"], cut[0]["loss_mask"]) if m]
    assert kept == span[: len(span) - 1 - loop_tail(span[:-1]) + 4] + span[-1:]
    assert summary["loop_tokens_dropped"] == len(ids) - len(cut[0]["input_ids"]) > 0
    assert cut[1]["input_ids"] == full[1]["input_ids"]
    assert cut[0]["input_ids"][:10] == ids[:10] and cut[0]["input_ids"][-2:] == ids[-2:]
    with pytest.raises(ValueError, match="loop_tail_keep"):
        DataConfig(path=path, loop_tail_keep=-1)


# --------------------------------------------------------------------------- packing, collate, cache
def test_packing_keeps_boundaries(tokenizers, tmp_path):
    rows = [{"messages": c} for c in CONVERSATIONS * 5]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    plain, _ = build_dataset(DataConfig(path=path, max_length=64), tokenizers["reference"])
    packed, summary = build_dataset(DataConfig(path=path, max_length=64, packing=True), tokenizers["reference"])
    assert summary["packed_rows"] == len(packed) < len(plain)
    assert all(len(r["input_ids"]) <= 64 for r in packed)
    # cutting every packed row where position_ids restart gives back the samples, in order
    samples = []
    for r in packed:
        assert len(r["position_ids"]) == len(r["input_ids"]) == len(r["loss_mask"])
        starts = [i for i, p in enumerate(r["position_ids"]) if p == 0] + [len(r["input_ids"])]
        for a, b in zip(starts, starts[1:]):
            assert r["position_ids"][a:b] == list(range(b - a))
            samples.append((r["input_ids"][a:b], r["loss_mask"][a:b]))
    assert [s[0] for s in samples] == [r["input_ids"] for r in plain]
    assert [s[1] for s in samples] == [[0, *r["loss_mask"][1:]] for r in plain]

    multi = next(r for r in packed if r["position_ids"].count(0) > 1)
    batch = collate([packed[-1], multi], pad_id=tokenizers["reference"].pad_token_id)
    mask = packed_attention_mask(batch["position_ids"])
    assert mask.shape == (2, 1, batch["input_ids"].shape[1], batch["input_ids"].shape[1])
    second = multi["position_ids"].index(0, 1)  # start of the second sample in that row
    assert mask[1, 0, second, second] and mask[1, 0, second + 1, second]
    assert not mask[1, 0, second, second - 1] and not mask[1, 0, second - 1, second]


def test_collate_pads():
    batch = collate([{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}], pad_id=0)
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask"}
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["input_ids"].dtype == torch.long


def test_second_run_reads_the_cache(tokenizers, tmp_path):
    rows = [{"messages": c} for c in CONVERSATIONS * 50]
    cfg = DataConfig(path=write_jsonl(tmp_path / "d.jsonl", rows), cache_dir=str(tmp_path / "cache"))
    first, s1 = build_dataset(cfg, tokenizers["reference"])
    files = [f["filename"] for f in first.cache_files]
    written = {f: Path(f).stat().st_mtime_ns for f in files}
    second, s2 = build_dataset(cfg, tokenizers["reference"])
    assert s1 == s2 and first._fingerprint == second._fingerprint
    assert files and [f["filename"] for f in second.cache_files] == files
    assert {f: Path(f).stat().st_mtime_ns for f in files} == written  # read back, not recomputed


# --------------------------------------------------------------------------- stdlib samples
def test_build_stdlib_samples(tokenizers, tmp_path):
    tok = tokenizers["reference"]
    lines = [f"def function_{i}(x):\n    return x * {i}\n\n" for i in range(120)]
    files = [SourceFile("pkg/a.py", "".join(lines)), SourceFile("b.py", "".join(lines[:40]))]
    info = build_stdlib_samples(
        tok, "train", out_dir=tmp_path, files=files, chunk_tokens=100, prompt_tokens=32, continuation_tokens=48
    )
    assert info["files"] == 2 and info["text_rows"] > 2 and info["chat_rows"] == 4
    text_rows = [json.loads(line) for line in Path(info["text_path"]).read_text().splitlines()]
    for f in files:  # chunks cut at line starts rebuild each file exactly
        assert "".join(r["text"] for r in text_rows if r["source"] == f.relpath) == f.text
    assert all(len(tok(r["text"])["input_ids"]) <= 102 for r in text_rows)

    ds, summary = build_dataset(DataConfig(path=info["text_path"], max_length=128), tok)
    assert summary["kept"] == info["text_rows"] and all(all(r["loss_mask"]) for r in ds)
    chat_rows = [json.loads(line)["messages"] for line in Path(info["chat_path"]).read_text().splitlines()]
    for messages in chat_rows:
        prompt, continuation = messages[0]["content"], messages[1]["content"]
        assert prompt.endswith("\n") and continuation.endswith("\n") and (prompt + continuation) in files[0].text
    ds, summary = build_dataset(DataConfig(path=info["chat_path"], max_length=256), tok)
    assert_masks_exact(tok, ds, chat_rows, "<|end|>")


def test_build_stdlib_samples_real_heldout(tokenizers, tmp_path):
    info = build_stdlib_samples(tokenizers["reference"], "heldout", out_dir=tmp_path, max_files=2)
    assert info["files"] == 2 and info["text_rows"] >= 2


# --------------------------------------------------------------------------- self-distillation
@pytest.fixture(scope="module")
def tiny_target(tokenizers):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizers["reference"]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return LlamaForCausalLM(config).eval()


REGEN_ROWS = [
    {"messages": CONVERSATIONS[0]},
    {"messages": CONVERSATIONS[1]},
    {
        "messages": [
            {"role": "user", "content": "hello there, a much longer prompt than the others"},
            {"role": "assistant", "content": "old"},
        ]
    },
    {"messages": [{"role": "user", "content": "no answer"}]},
]


def test_regenerate_dataset(tokenizers, tiny_target, tmp_path):
    tok = tokenizers["reference"]
    assert end_of_turn_token_ids(tok) == [tok.convert_tokens_to_ids("<|end|>")]
    cfg = DataConfig(path=write_jsonl(tmp_path / "d.jsonl", REGEN_ROWS), max_length=256)
    counts = regenerate_dataset(
        tiny_target, tok, cfg, tmp_path / "out.jsonl", max_new_tokens=6, batch_size=3, show_progress=False
    )
    # the prompt-only row is answered, not skipped
    assert counts["rows_read"] == 4 and sum(counts["skipped"].values()) == 0
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert not (tmp_path / "out.jsonl.tmp").exists() and not (tmp_path / "out.jsonl.shards").exists()
    assert len(out) == counts["rows_written"] == 4
    assert counts["turns_regenerated"] == 5
    assert [m["role"] for m in out[3]["messages"]] == ["user", "assistant"]
    for row, source in zip(out, REGEN_ROWS):
        new, old = row["messages"], source["messages"]
        assert [m["role"] for m in new][: len(old)] == [m["role"] for m in old]
        assert [m["content"] for m in new if m["role"] != "assistant"] == [
            m["content"] for m in old if m["role"] != "assistant"
        ]
        assert all(m["content"].strip() for m in new if m["role"] == "assistant")

    # turn 2 of the multi-turn row was generated from the *regenerated* turn 1 (unpadded, single prompt)
    multi = out[1]["messages"]
    assert [m["role"] for m in multi] == ["system", "user", "assistant", "user", "assistant"]
    prompt = tok.apply_chat_template(multi[:4], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    stop = [tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")]
    gen = tiny_target.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=stop, pad_token_id=tok.pad_token_id)
    gen = [t for t in gen[0, ids.shape[1] :].tolist()]
    gen = gen[: next((k for k, t in enumerate(gen) if t in stop), len(gen))]
    assert tok.decode(gen, skip_special_tokens=True) == multi[4]["content"]

    # left padding does not change greedy output; the file loads back through build_dataset
    regenerate_dataset(
        tiny_target, tok, cfg, tmp_path / "one.jsonl", max_new_tokens=6, batch_size=1, show_progress=False
    )
    assert (tmp_path / "one.jsonl").read_text() == (tmp_path / "out.jsonl").read_text()
    ds, summary = build_dataset(DataConfig(path=str(tmp_path / "out.jsonl")), tok)
    assert summary["kept"] == 4
    assert_masks_exact(tok, ds, [r["messages"] for r in out], "<|end|>")


def test_regenerate_resumes_after_a_crash_and_answers_prompt_rows(tokenizers, tiny_target, tmp_path, monkeypatch):
    """A run killed after its first batch resumes from the shard it wrote (that batch is not generated again) and
    gives the same file as an uninterrupted run; Spec-Bench `turns` rows are answered turn by turn."""
    import train.data.answerer as answerer

    tok = tokenizers["reference"]
    rows = [{"question_id": i, "category": "x", "turns": [f"question {i}", "and a follow-up"]} for i in range(5)]
    cfg = DataConfig(path=write_jsonl(tmp_path / "q.jsonl", rows), max_length=256)
    kw = dict(max_new_tokens=5, batch_size=2, show_progress=False)
    full = regenerate_dataset(tiny_target, tok, cfg, tmp_path / "full.jsonl", **kw)
    assert full["rows_written"] == 5 and full["turns_regenerated"] == 10

    calls = []
    real_write = answerer._write_shard

    def crash_at_the_second_shard(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the first two conversations are on disk; die before the next ones are
            raise KeyboardInterrupt
        return real_write(*args, **kwargs)

    monkeypatch.setattr(answerer, "_write_shard", crash_at_the_second_shard)
    with pytest.raises(KeyboardInterrupt):
        regenerate_dataset(tiny_target, tok, cfg, tmp_path / "out.jsonl", **kw)
    monkeypatch.setattr(answerer, "_write_shard", real_write)
    shards = tmp_path / "out.jsonl.shards"
    written = [line for shard in shards.glob("shard-*.jsonl.gz") for line in gzip.open(shard, "rt").read().splitlines()]
    # the failed shard's two finished conversations are written on the way out (train.data.answerer.answer's finally)
    assert len(written) == 4 and not (tmp_path / "out.jsonl").exists()
    resumed = regenerate_dataset(tiny_target, tok, cfg, tmp_path / "out.jsonl", **kw)
    assert resumed["turns_regenerated"] == 2  # the one conversation not on disk only
    assert (tmp_path / "out.jsonl").read_text() == (tmp_path / "full.jsonl").read_text()
    assert not shards.exists()


def test_regenerate_cli_sampling(tokenizers, tiny_target, tmp_path):
    from scripts.regenerate import main

    tiny_target.save_pretrained(tmp_path / "target")
    tokenizers["reference"].save_pretrained(tmp_path / "target")
    data = write_jsonl(tmp_path / "d.jsonl", [as_sharegpt(c) for c in CONVERSATIONS])
    counts = main(
        [
            "--target",
            str(tmp_path / "target"),
            "--data",
            data,
            "--out",
            str(tmp_path / "o.jsonl"),
            "--temperature",
            "0.8",
            "--max-new-tokens",
            "4",
            "--batch-size",
            "2",
            "--limit",
            "3",
        ]
    )
    assert counts["rows_read"] == 3
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert len(rows) == counts["rows_written"] and all("messages" in r for r in rows)

    # two files are one dataset: a seeded sample draws from both
    more = write_jsonl(tmp_path / "more.jsonl", [as_sharegpt(c) for c in CONVERSATIONS])
    out = str(tmp_path / "two.jsonl")
    both = main(["--target", str(tmp_path / "target"), "--data", data, more, "--out", out, "--max-new-tokens", "2"])
    assert both["rows_read"] == 2 * len(CONVERSATIONS)

    # nothing to regenerate: a clear error and a non-zero exit, not an empty file and exit 0
    empty = write_jsonl(tmp_path / "e.jsonl", [{"messages": [{"role": "system", "content": "only a system turn"}]}])
    with pytest.raises(SystemExit) as stop:
        main(["--target", str(tmp_path / "target"), "--data", empty, "--out", str(tmp_path / "e_out.jsonl")])
    assert "no rows" in str(stop.value)


def test_regenerate_a_seeded_sample_keeps_each_rows_fields(tokenizers, tiny_target, tmp_path):
    """``sample`` answers a seeded random choice of rows (the same rows for the same seed), and a row's family,
    source and id travel to its output row, so a sampled tier can still be counted per family."""
    tok = tokenizers["reference"]
    rows = [
        {"id": f"r{i}", "family": "qa" if i % 2 else "chat", "messages": [{"role": "user", "content": f"question {i}"}]}
        for i in range(8)
    ]
    cfg = DataConfig(path=write_jsonl(tmp_path / "d.jsonl", rows), max_length=256)
    kw = dict(max_new_tokens=3, batch_size=2, show_progress=False, sample=3)
    counts = regenerate_dataset(tiny_target, tok, cfg, tmp_path / "a.jsonl", seed=1, **kw)
    assert counts["rows_read"] == 3 and counts["rows_written"] == 3
    out = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    by_id = {r["id"]: r for r in rows}
    for row in out:
        source = by_id[row["source_id"]]
        assert row["family"] == source["family"] and row["messages"][0] == source["messages"][0]
    assert len({r["source_id"] for r in out}) == 3
    regenerate_dataset(tiny_target, tok, cfg, tmp_path / "b.jsonl", seed=1, **kw)
    assert (tmp_path / "b.jsonl").read_text() == (tmp_path / "a.jsonl").read_text()
    picks = set()
    for seed in range(4):
        regenerate_dataset(tiny_target, tok, cfg, tmp_path / f"s{seed}.jsonl", seed=seed, **kw)
        lines = (tmp_path / f"s{seed}.jsonl").read_text().splitlines()
        picks.add(tuple(json.loads(line)["source_id"] for line in lines))
    assert len(picks) > 1  # the seed chooses the rows
    with pytest.raises(ValueError, match="not both"):
        regenerate_dataset(tiny_target, tok, cfg, tmp_path / "c.jsonl", limit=2, **kw)


def test_extra_paths_read_two_tiers_as_one_dataset(tmp_path):
    """``extra_paths`` appends more files or folders to ``path``; files keep the columns every file has (one tier's
    rows carry a ``kind``, the other's a ``family``), and a missing extra path is an error, not a smaller dataset."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    write_jsonl(one / "a.jsonl", [{"kind": "qa", "messages": CONVERSATIONS[0]}] * 2)
    write_jsonl(two / "b.jsonl", [{"family": "chat", "messages": CONVERSATIONS[1]}] * 3)
    raw = load_raw(DataConfig(path=str(one), extra_paths=[str(two)]))
    assert len(raw) == 5 and raw.column_names == ["messages"]
    assert raw[4]["messages"] == CONVERSATIONS[1]
    with pytest.raises(ValueError, match="no such file"):
        load_raw(DataConfig(path=str(one), extra_paths=[str(tmp_path / "missing")]))


def test_repeats_weight_each_path_of_a_mixture(tmp_path):
    """``repeats`` reads each of ``path`` and ``extra_paths`` that many times (a mixing weight); a count per path,
    each at least 1, or the config is refused."""
    one, two = tmp_path / "one.jsonl", tmp_path / "two"
    two.mkdir()
    write_jsonl(one, [{"messages": CONVERSATIONS[0]}] * 2)
    write_jsonl(two / "b.jsonl", [{"messages": CONVERSATIONS[1]}] * 3)
    raw = load_raw(DataConfig(path=str(one), extra_paths=[str(two)], repeats=[1, 3]))
    assert len(raw) == 2 + 3 * 3
    assert [m == CONVERSATIONS[1] for m in raw["messages"]] == [False] * 2 + [True] * 9
    for bad in ([2], [1, 0], [1, 2, 3]):
        with pytest.raises(ValueError, match="repeats"):
            DataConfig(path=str(one), extra_paths=[str(two)], repeats=bad)


def test_regenerate_leaves_out_rows_an_earlier_run_answered(tokenizers, tiny_target, tmp_path):
    """``exclude_ids`` (from `answered_ids`: the source ids in earlier runs' files, folders searched recursively)
    drops those rows before a sample is drawn, so a new run answers only new conversations, and counts them."""
    from train.data.regenerate import answered_ids

    tok = tokenizers["reference"]
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(6)]
    cfg = DataConfig(path=write_jsonl(tmp_path / "d.jsonl", rows), max_length=256)
    kw = dict(max_new_tokens=2, batch_size=2, show_progress=False)
    regenerate_dataset(tiny_target, tok, cfg, tmp_path / "runs" / "first" / "a.jsonl", limit=2, **kw)
    done = answered_ids([tmp_path / "runs"])
    assert done == {"r0", "r1"}
    counts = regenerate_dataset(tiny_target, tok, cfg, tmp_path / "b.jsonl", sample=10, exclude_ids=done, **kw)
    assert counts["rows_excluded"] == 2 and counts["rows_read"] == 4
    out = {json.loads(line)["source_id"] for line in (tmp_path / "b.jsonl").read_text().splitlines()}
    assert out == {"r2", "r3", "r4", "r5"}
    with pytest.raises(FileNotFoundError):
        answered_ids([tmp_path / "missing"])
