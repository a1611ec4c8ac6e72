"""Chat rendering: a conversation in the target's chat template, and where its assistant turns are in that text.

Shared by the dataset (`train.data.dataset`: the loss mask), the answerer (`train.data.answerer`: the prompts it
answers and the end-of-turn tokens it stops at) and the chat build (`train.data.target_written`); it imports none of
them.

Finding the assistant spans. Both methods produce *character* spans in the rendered conversation;
the text is then tokenised segment by segment, cut at the span edges, so no token straddles an edge:

- ``generation``: the template wraps assistant text in ``{% generation %}…{% endgeneration %}``
  (the reference target's does). The spans are the ones transformers' renderer records for
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``; we read the character spans from
  that renderer instead of its token mask because the token mask marks every token that *overlaps* a
  span, so when byte-level BPE merges the template's newline with a newline that opens the content,
  the merged token (half template) is marked as assistant.
- ``diff`` (templates without markers: Llama-3, Qwen, ...): for assistant turn i, render turns < i
  with the generation prompt and turns ≤ i without it; the second must start with the first, and the
  difference is the turn (content, then end-of-turn text). The content is located in that difference
  (as given, or stripped when the template trims it), and the span is extended through the first
  special token that follows it after at most whitespace (``<|eot_id|>``, ``<|im_end|>``, ``<|end|>``).
  Text prefixes are diffed rather than token prefixes because the tokens of a prefix are not a prefix
  of the tokens of the whole when BPE merges across the cut. Limits: templates whose rendering of
  earlier turns changes once later turns exist (e.g. ones that drop reasoning from history) fail the
  prefix test and those rows are skipped as ``span_not_found``; an end-of-turn marker that is not a
  special token is not included in the span; content that also occurs inside the turn header would
  be found there first.
"""

from __future__ import annotations

import re

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class SpanError(ValueError):
    """The diff method could not locate an assistant turn exactly."""


def has_generation_markers(chat_template: str | None) -> bool:
    return bool(chat_template) and _GENERATION_TAG.search(chat_template) is not None


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def generation_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Rendered text and the character spans of its ``{% generation %}`` blocks.

    Uses the renderer behind ``apply_chat_template(return_assistant_tokens_mask=True)`` with the same
    template variables (the special tokens), so the text is identical to ``render``.
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, spans = render_jinja_template(
        conversations=[messages],
        chat_template=tokenizer.get_chat_template(),
        return_assistant_tokens_mask=True,
        **tokenizer.special_tokens_map,
    )
    return rendered[0], [(s, e) for s, e in spans[0] if e > s]


def _special_token_strings(tokenizer) -> list[str]:
    return [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]


def _end_of_turn_length(tail: str, special_tokens: list[str]) -> int:
    """Characters of ``tail`` up to and including its first special token, if only whitespace precedes it."""
    hits = [(tail.find(tok), -len(tok)) for tok in special_tokens if tail.find(tok) >= 0]
    if not hits:
        return 0
    start, neg_len = min(hits)  # earliest token; the longest one when two start at the same place
    return start - neg_len if not tail[:start].strip() else 0


def diff_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Rendered text and assistant spans (content + end-of-turn) found by rendering turn by turn."""
    text = render(tokenizer, messages)
    special = _special_token_strings(tokenizer)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        full = render(tokenizer, messages[: i + 1])
        if not full.startswith(prompt) or not text.startswith(full):
            raise SpanError(f"turn {i}: the rendering of earlier turns changes when later turns are added")
        delta = full[len(prompt) :]
        content = message["content"]
        start = delta.find(content)
        if start < 0:  # templates such as Llama-3's trim the content
            content = content.strip()
            start = delta.find(content)
        if start < 0:
            raise SpanError(f"turn {i}: assistant content not found in its rendering")
        end = start + len(content)
        end += _end_of_turn_length(delta[end:], special)
        spans.append((len(prompt) + start, len(prompt) + end))
    return text, spans


def end_of_turn_token_ids(tokenizer) -> list[int]:
    """The special token(s) the chat template writes right after assistant content, found by the diff method."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    text, spans = diff_spans(tokenizer, probe)
    start, end = spans[-1]
    turn_end = text[start:end][text[start:end].find("Hello") + len("Hello") :]
    return [t for t in tokenizer(turn_end, add_special_tokens=False)["input_ids"] if t in tokenizer.all_special_ids]
