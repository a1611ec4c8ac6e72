"""Where a greedy answer ends repeating itself, and how much of that repetition training data keeps.

A small target decoded greedily often ends an answer in a loop, the same sentence or list item again until its
length cap (nearly half of the target's answers to ShareGPT requests; docs/decisions.md has the shares). Served
beside prompt lookup, the drafter is not what drafts there (lookup copies the loop), so those tokens cost training
and answering time without teaching it anything new. A token is in a loop where the `LOOP_NGRAM` tokens ending at it
already stood together earlier in the same answer; the loop tail is the run of such tokens that reaches the answer's
end.
"""

from __future__ import annotations

LOOP_NGRAM = 16
"""Tokens that must recur together: long enough that a phrase a text legitimately repeats (a name, a code idiom)
does not start a tail, short enough that a looping sentence is caught within its second pass."""


def loop_tail(tokens: list[int], ngram: int = LOOP_NGRAM) -> int:
    """How many of ``tokens``' last tokens are a repetition: the longest run at the end in which the ``ngram``
    tokens ending at each one already stood together earlier in ``tokens`` (0 where the end does not repeat)."""
    return LoopWatch(ngram).update(tokens)


def trim_loop_tails(ids: list[int], mask: list[int], keep: int) -> tuple[list[int], list[int], int]:
    """``ids`` and ``mask`` with each loss span's loop tail (`loop_tail`) cut to its first ``keep`` tokens; a span's
    last token is kept where the loop ends just before it (the turn's end mark, inside the loss), and the tokens
    after the span (the template's newline, later turns) follow the cut directly. Returns the kept ids,
    their mask and how many tokens were dropped."""
    out_ids: list[int] = []
    out_mask: list[int] = []
    start = 0
    while start < len(ids):
        end = start + 1
        while end < len(ids) and mask[end] == mask[start]:
            end += 1
        span = ids[start:end]
        if mask[start]:
            body, close, tail = span, [], loop_tail(span)
            if not tail and len(span) > 1:  # a span closed by its turn's end mark: the loop ends just before it
                body, close = span[:-1], span[-1:]
                tail = loop_tail(body)
            span = body[: len(body) - max(0, tail - keep)] + close
        out_ids += span
        out_mask += [mask[start]] * len(span)
        start = end
    return out_ids, out_mask, len(ids) - len(out_ids)


class LoopWatch:
    """`loop_tail` of a growing answer, kept up to date token by token (a decode loop asks after every step, and a
    rescan of each row's answer would cost its length per token)."""

    def __init__(self, ngram: int = LOOP_NGRAM) -> None:
        self.ngram, self.seen, self.run, self.read = ngram, set(), 0, 0

    def update(self, tokens: list[int]) -> int:
        """The loop tail of ``tokens``, which extend the tokens of the previous call."""
        for end in range(max(self.read, self.ngram - 1) + 1, len(tokens) + 1):
            gram = tuple(tokens[end - self.ngram : end])
            self.run = self.run + 1 if gram in self.seen else 0
            self.seen.add(gram)
        self.read = max(self.read, len(tokens))
        return self.run
