"""A hybrid proposer: the running text's own continuation (prompt lookup) and a learned drafter's tree, verified in
one forward.

Text-matching proposers win where the answer copies the prompt or itself (translation of names, summaries, RAG,
code edits); learned drafters win where it does not (SuffixDecoding's authors combine a suffix tree with a learned
speculator for the same reason, Oliaro et al. 2024). Where the verify curve is flat, verifying both costs little
more than either. Per step and row, from the match length m (the n-gram size that matched, 0 for none):

- m >= ``strong_match``: the lookup chain (up to ``num_draft`` tokens) is merged into the learned tree;
- 0 < m < ``strong_match``: only its first ``weak_tokens`` tokens are, a weak match being right less often;
- no match: the learned tree alone;
- with a ``datastore`` (`infer.datastore.Datastore`, the target's own earlier text): where the match is not strong
  and the datastore has a continuation, that continuation is merged instead of the weak chain, after the learned
  tree's nodes (it was written for another answer, so it never replaces the drafter's step or leads the tree);
- and where every row's match is at least ``alone_match`` tokens long (0: never), the lookup chains are verified
  alone and the learned drafter is not run that step: on copied text (translation, retrieved documents) a long
  match is right most of the time, and the drafter's step (~10 ms of a ~50 ms round for EAGLE-3's tree on SmolLM2
  in bf16) buys little there. The drafter loses nothing: the signals it did not read wait for its next step
  (each proposer feeds every observed token at its next ``propose``).

Priced (``price``, `infer.pricing.VerifyPrice`: this machine's verify curve): every node carries the probability
that it is accepted (the learned tree's path probabilities; for the lookup chain, how often its j-th token was right
after an n-gram match of that size, tallied online in a `infer.pricing.ChainAcceptance` from the tokens each round
emitted), a node shared by both sources the larger one. Each row then verifies the most valuable nodes, as many as
give the most expected tokens per millisecond on the curve, lookup-alone steps too; weak matches offer their whole
chain (their tally values it). A weak chain that would push a 4-node tree past a step of the curve is dropped, and a
strong chain fills a step's spare nodes. At a batch each row is priced alone, on the curve it was given (the report's
is timed at batch 1), and the verify is as wide as its widest row.

The union is a trie: a lookup token equal to a learned node's child follows it, so shared prefixes are verified
once. It is capped at ``budget`` nodes (root included): the learned tree keeps its first nodes (proposers emit nodes
parents-first, best-scored first), after the lookup chain's on a strong match, before them on a weak one.

Lossless at every temperature: the accept rules are exact for any deterministic tree (one-hot q). A learned proposer
that *samples* its drafts (a chain with ``draft_probs`` at T > 0) cannot share a tree with deterministic nodes, so
then the step verifies one source, chosen from the match length alone (never from the target's output): the lookup
chain on a strong match, the learned draft otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from infer.datastore import Datastore
from infer.pricing import ChainAcceptance, VerifyPrice
from infer.proposer import Proposer
from infer.proposers import PromptLookupProposer, _pack_rows
from infer.sampling import SamplingParams
from infer.tree import DraftTree


@dataclass
class RoundAccount:
    """Where a hybrid's accepted drafts come from, by the kind of match each round had ("none", "weak", "strong",
    "datastore", or "lookup alone": a strong round that skipped the learned drafter): rounds, drafts accepted (the
    bonus token not counted), and how many of them prompt lookup's chain alone held (its common prefix with what the
    round emitted: at T = 0 what a lookup-only round would have had accepted, capped at what this round emitted).
    A row's last round is not counted (no later step sees what it emitted). Pass one to share it across calls."""

    rounds: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    lookup: dict[str, int] = field(default_factory=dict)

    def record(self, kind: str, chain: list[int], emitted: list[int]) -> None:
        """One round of ``kind`` whose lookup chain was ``chain`` and which emitted ``emitted`` (bonus included)."""
        held = 0
        for drafted, token in zip(chain, emitted):
            if drafted != token:
                break
            held += 1
        self.rounds[kind] = self.rounds.get(kind, 0) + 1
        self.accepted[kind] = self.accepted.get(kind, 0) + max(0, len(emitted) - 1)
        self.lookup[kind] = self.lookup.get(kind, 0) + held


class HybridProposer(Proposer):
    """``learned`` (any proposer) and prompt lookup in one tree; see the module docstring for the per-step rule."""

    def __init__(
        self,
        learned: Proposer,
        num_draft: int = 10,
        strong_match: int = 2,
        weak_tokens: int = 2,
        budget: int = 24,
        max_ngram: int = 3,
        alone_match: int = 0,
        datastore: Datastore | None = None,
        price: VerifyPrice | None = None,
        chain_acceptance: ChainAcceptance | None = None,
        account: RoundAccount | None = None,
    ):
        if budget < 2 or weak_tokens < 0 or strong_match < 1 or alone_match < 0:
            raise ValueError("need budget >= 2, weak_tokens >= 0, strong_match >= 1 and alone_match >= 0")
        if alone_match > max_ngram:
            raise ValueError(f"alone_match {alone_match} can never hold: matches are at most max_ngram {max_ngram}")
        self.learned = learned
        self.lookup = PromptLookupProposer(num_draft=num_draft, max_ngram=max_ngram)
        self.strong_match, self.weak_tokens, self.budget = strong_match, weak_tokens, budget
        self.alone_match = alone_match
        self.datastore = datastore
        self.price = price
        self.tally = chain_acceptance if chain_acceptance is not None else ChainAcceptance()
        """Lookup chains' acceptance by n-gram size and position (``price`` set): pass one to share it across calls."""
        self.account = account if account is not None else RoundAccount()
        self._verified: list[tuple[str, int, list[int], int] | None] = []
        """Per row, the last step's kind (as the account names it), its tally row, its lookup chain and the context
        length then, judged against what the row emitted at its next step."""
        self.signal = learned.signal
        self.steps = {"strong": 0, "datastore": 0, "weak": 0, "none": 0, "lookup alone": 0}
        """Rows per kind of match over the proposer's life, counted as they are proposed (``account`` judges them once
        their tokens are known); "lookup alone" counts the strong rows of steps that skipped the learned drafter."""

    def begin(self, contexts: list[list[int]]) -> None:
        self.learned.begin(contexts)
        self._verified = [None] * len(contexts)

    def observe(self, features: torch.Tensor, new_lengths: torch.Tensor) -> None:
        self.learned.observe(features, new_lengths)

    def drop_rows(self, keep: torch.Tensor) -> None:
        self.learned.drop_rows(keep)
        self._verified = [self._verified[i] for i in keep.tolist()]

    def _chain(self, ctx: list[int]) -> tuple[str, int, list[int]]:
        """(kind of match, its n-gram size, the chain to merge)."""
        n, found = self.lookup.match(ctx)
        if found and n >= self.strong_match:
            return "strong", n, found[0]
        if self.datastore is not None:
            stored = self.datastore.match(ctx)[1][: self.lookup.num_draft]
            if stored:
                return "datastore", n, stored
        if not found:
            return "none", 0, []
        # priced, a weak match offers its whole chain: its tally decides how much of it a step verifies
        return "weak", n, found[0] if self.price is not None else found[0][: self.weak_tokens]

    def _judge(self, contexts: list[list[int]], matched: list[tuple[str, int, list[int]]], alone: bool) -> None:
        """Judge the last step's lookup chains against what each row emitted since (the account; the tally where
        the proposer is priced), and remember this step's."""
        if len(self._verified) != len(contexts):
            raise RuntimeError(f"{len(contexts)} rows proposed for, {len(self._verified)} begun: call begin first")
        for b, ctx in enumerate(contexts):
            if self._verified[b] is not None:
                label, key, chain, length = self._verified[b]
                self.account.record(label, chain, ctx[length:])
                if self.price is not None and chain:
                    self.tally.record(key, chain, ctx[length:])
            kind, n, chain = matched[b]
            self._verified[b] = ("lookup alone" if alone else kind, _tally_key(kind, n), chain, len(ctx))

    def propose(self, contexts: list[list[int]], params: SamplingParams, generator: torch.Generator) -> DraftTree:
        matched = [self._chain(ctx) for ctx in contexts]
        alone = bool(self.alone_match) and all(n >= self.alone_match for _, n, _ in matched)
        self._judge(contexts, matched, alone)
        if alone:
            self.steps["lookup alone"] += len(matched)
            chains = [c[: self._priced_length(n, len(c))] for _, n, c in matched]
            return _pack_rows(
                [[ctx[-1], *c] for ctx, c in zip(contexts, chains)],
                [list(range(-1, len(c))) for c in chains],
                generator.device,
            )
        learned = self.learned.propose(contexts, params, generator)
        for kind, _, _ in matched:
            self.steps[kind] += 1
        if learned.draft_probs is not None:  # sampled drafts: one source per row, chosen from the match alone
            use_learned = [kind != "strong" for kind, _, _ in matched]
            return learned if all(use_learned) else self._mixed_rows(learned, matched, use_learned)
        return self._merge(learned, matched)

    def _priced_length(self, ngram: int, length: int) -> int:
        """How many tokens of a lookup chain a lookup-alone step verifies (all of them unpriced)."""
        if self.price is None:
            return length
        return self.price.best_count(self.tally.values(ngram, length), drafted=False) - 1

    def _merge(self, learned: DraftTree, chains: list[tuple[str, int, list[int]]]) -> DraftTree:
        """Deterministic learned trees: each row's tree and its lookup chain as one trie (`_union`), priced where
        the proposer has a price."""
        tokens, parents, valid = learned.tokens.tolist(), learned.parents.tolist(), learned.valid.tolist()
        if self.price is not None and learned.values is None:
            raise ValueError("a priced hybrid needs a learned proposer whose trees carry node values (EAGLE-2 trees)")
        values = learned.values.tolist() if self.price is not None else None
        rows, pars = [], []
        for b, (kind, ngram, chain) in enumerate(chains):
            nodes = [i for i in range(len(tokens[b])) if valid[b][i]]
            index = {node: k for k, node in enumerate(nodes)}  # padding removed: parents renumbered
            row_tokens, row_parents = _union(
                [tokens[b][i] for i in nodes],
                [index[parents[b][i]] if i else -1 for i in nodes],
                chain,
                self.budget,
                lookup_first=kind == "strong",
                priced=None
                if values is None
                else (
                    self.price,
                    [values[b][i] for i in nodes],
                    self.tally.values(_tally_key(kind, ngram), len(chain)),
                ),
            )
            rows.append(row_tokens)
            pars.append(row_parents)
        return _pack_rows(rows, pars, learned.tokens.device)

    def _mixed_rows(self, learned: DraftTree, chains, use_learned: list[bool]) -> DraftTree:
        """Rows that use the learned draft keep it (and its q); the others verify the lookup chain, one-hot."""
        B, n = learned.tokens.shape
        width = max(n, max((len(c) + 1 for (_, _, c), u in zip(chains, use_learned) if not u), default=1))
        tokens = torch.zeros(B, width, dtype=torch.long, device=learned.tokens.device)
        parents = torch.zeros_like(tokens)
        valid = torch.zeros(B, width, dtype=torch.bool, device=tokens.device)
        probs = learned.draft_probs.new_zeros(B, width, learned.draft_probs.shape[2])
        for b, ((_, _, chain), use) in enumerate(zip(chains, use_learned)):
            if use:
                tokens[b, :n], parents[b, :n], valid[b, :n] = learned.tokens[b], learned.parents[b], learned.valid[b]
                probs[b, :n] = learned.draft_probs[b]
            else:
                k = len(chain)
                tokens[b, 0] = learned.tokens[b, 0]
                tokens[b, 1 : k + 1] = torch.tensor(chain, device=tokens.device)
                parents[b, 1 : k + 1] = torch.arange(k, device=tokens.device)
                valid[b, : k + 1] = True
                # one-hot q at every node: a deterministic draft under the rejection rule (infer/accept.py)
                probs[b, torch.arange(k, device=tokens.device), tokens[b, 1 : k + 1]] = 1.0
        parents[:, 0] = -1
        return DraftTree(tokens, parents, valid, probs)


def _tally_key(kind: str, ngram: int) -> int:
    """The `ChainAcceptance` row a chain is tallied in: the context's n-gram size, 0 for a datastore continuation."""
    return 0 if kind == "datastore" else ngram


def _union(
    tokens: list[int],
    parents: list[int],
    chain: list[int],
    budget: int,
    lookup_first: bool,
    priced: tuple[VerifyPrice, list[float], list[float]] | None = None,
) -> tuple[list[int], list[int]]:
    """One row's learned tree (node 0 = root, parents-first order) with ``chain`` hung from the root as a trie path,
    capped at ``budget`` nodes. ``lookup_first``: the chain's nodes are kept before the learned tree's.
    ``priced``: (the price, the learned nodes' values, the chain's values): nodes are kept by value instead (a shared
    node takes the larger), as many as the price says pay."""
    tokens, parents = list(tokens), list(parents)
    values = list(priced[1]) if priced is not None else None
    children = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}
    chain_nodes, node = [], 0
    for j, t in enumerate(chain):  # follow learned nodes while they agree, then append the chain's own nodes
        nxt = children.get((node, t))
        if nxt is None:
            tokens.append(t)
            parents.append(node)
            nxt = len(tokens) - 1
            children[(node, t)] = nxt
            if values is not None:
                values.append(0.0)
        if values is not None:
            values[nxt] = max(values[nxt], priced[2][j])
        chain_nodes.append(nxt)
        node = nxt
    if values is not None:  # values never rise along a path, and a tie keeps the parent (smaller index) first
        priority = sorted(range(1, len(tokens)), key=lambda i: (-values[i], i))
    elif lookup_first:
        priority = chain_nodes + [i for i in range(1, len(tokens)) if i not in chain_nodes]
    else:  # the learned tree by index (the chain's shared prefix included), then the chain's new nodes
        priority = list(range(1, len(tokens)))
    cap = budget if priced is None else min(budget, priced[0].max_nodes)
    kept, order = {0}, []
    for i in priority:  # every node's parent comes earlier in either order
        if len(kept) == cap:
            break
        if parents[i] in kept:
            kept.add(i)
            order.append(i)
    if priced is not None:
        count = priced[0].best_count([values[i] for i in order], drafted=True)
        kept = {0, *order[: count - 1]}
    order = sorted(kept)  # union indices are parents-first
    remap = {old: new for new, old in enumerate(order)}
    return [tokens[i] for i in order], [remap[parents[i]] if i else -1 for i in order]
