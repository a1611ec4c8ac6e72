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

The union is a trie: a lookup token equal to a learned node's child follows it, so shared prefixes are verified
once. It is capped at ``budget`` nodes (root included): the learned tree keeps its first nodes (proposers emit nodes
parents-first, best-scored first), after the lookup chain's on a strong match, before them on a weak one.

Lossless at every temperature: the accept rules are exact for any deterministic tree (one-hot q). A learned proposer
that *samples* its drafts (a chain with ``draft_probs`` at T > 0) cannot share a tree with deterministic nodes, so
then the step verifies one source, chosen from the match length alone (never from the target's output): the lookup
chain on a strong match, the learned draft otherwise.
"""

from __future__ import annotations

import torch

from infer.datastore import Datastore
from infer.proposer import Proposer
from infer.proposers import PromptLookupProposer, _pack_rows
from infer.sampling import SamplingParams
from infer.tree import DraftTree


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
        self.signal = learned.signal
        self.steps = {"strong": 0, "datastore": 0, "weak": 0, "none": 0, "lookup alone": 0}
        """Rows per kind of match over the proposer's life (the report's account of how often lookup joined in);
        "lookup alone" counts the strong rows of steps that skipped the learned drafter."""

    def begin(self, contexts: list[list[int]]) -> None:
        self.learned.begin(contexts)

    def observe(self, features: torch.Tensor, new_lengths: torch.Tensor) -> None:
        self.learned.observe(features, new_lengths)

    def drop_rows(self, keep: torch.Tensor) -> None:
        self.learned.drop_rows(keep)

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
        return "weak", n, found[0][: self.weak_tokens]

    def propose(self, contexts: list[list[int]], params: SamplingParams, generator: torch.Generator) -> DraftTree:
        matched = [self._chain(ctx) for ctx in contexts]
        if self.alone_match and all(n >= self.alone_match for _, n, _ in matched):
            self.steps["lookup alone"] += len(matched)
            return _pack_rows(
                [[ctx[-1], *c] for ctx, (_, _, c) in zip(contexts, matched)],
                [list(range(-1, len(c))) for _, _, c in matched],
                generator.device,
            )
        learned = self.learned.propose(contexts, params, generator)
        chains = [(kind, c) for kind, _, c in matched]
        for kind, _ in chains:
            self.steps[kind] += 1
        if learned.draft_probs is not None:  # sampled drafts: one source per row, chosen from the match alone
            use_learned = [kind != "strong" for kind, _ in chains]
            return learned if all(use_learned) else self._mixed_rows(learned, chains, use_learned)
        return self._merge(learned, chains)

    def _merge(self, learned: DraftTree, chains: list[tuple[str, list[int]]]) -> DraftTree:
        """Deterministic learned trees: each row's tree and its lookup chain as one trie (`_union`)."""
        tokens, parents, valid = learned.tokens.tolist(), learned.parents.tolist(), learned.valid.tolist()
        rows, pars = [], []
        for b, (kind, chain) in enumerate(chains):
            nodes = [i for i in range(len(tokens[b])) if valid[b][i]]
            index = {node: k for k, node in enumerate(nodes)}  # padding removed: parents renumbered
            row_tokens, row_parents = _union(
                [tokens[b][i] for i in nodes],
                [index[parents[b][i]] if i else -1 for i in nodes],
                chain,
                self.budget,
                lookup_first=kind == "strong",
            )
            rows.append(row_tokens)
            pars.append(row_parents)
        return _pack_rows(rows, pars, learned.tokens.device)

    def _mixed_rows(self, learned: DraftTree, chains, use_learned: list[bool]) -> DraftTree:
        """Rows that use the learned draft keep it (and its q); the others verify the lookup chain, one-hot."""
        B, n = learned.tokens.shape
        width = max(n, max((len(c) + 1 for (_, c), u in zip(chains, use_learned) if not u), default=1))
        tokens = torch.zeros(B, width, dtype=torch.long, device=learned.tokens.device)
        parents = torch.zeros_like(tokens)
        valid = torch.zeros(B, width, dtype=torch.bool, device=tokens.device)
        probs = learned.draft_probs.new_zeros(B, width, learned.draft_probs.shape[2])
        for b, ((_, chain), use) in enumerate(zip(chains, use_learned)):
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


def _union(
    tokens: list[int], parents: list[int], chain: list[int], budget: int, lookup_first: bool
) -> tuple[list[int], list[int]]:
    """One row's learned tree (node 0 = root, parents-first order) with ``chain`` hung from the root as a trie path,
    capped at ``budget`` nodes. ``lookup_first``: the chain's nodes are kept before the learned tree's."""
    tokens, parents = list(tokens), list(parents)
    children = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}
    chain_nodes, node = [], 0
    for t in chain:  # follow learned nodes while they agree, then append the chain's own nodes
        nxt = children.get((node, t))
        if nxt is None:
            tokens.append(t)
            parents.append(node)
            nxt = len(tokens) - 1
            children[(node, t)] = nxt
        chain_nodes.append(nxt)
        node = nxt
    if lookup_first:
        priority = chain_nodes + [i for i in range(1, len(tokens)) if i not in chain_nodes]
    else:  # the learned tree by index (the chain's shared prefix included), then the chain's new nodes
        priority = list(range(1, len(tokens)))
    kept = {0}
    for i in priority:  # every node's parent comes earlier in either order
        if len(kept) == budget:
            break
        if parents[i] in kept:
            kept.add(i)
    order = sorted(kept)  # union indices are parents-first
    remap = {old: new for new, old in enumerate(order)}
    return [tokens[i] for i in order], [remap[parents[i]] if i else -1 for i in order]
