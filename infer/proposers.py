"""Drafter-free proposers: prompt lookup (n-gram) and a small draft model, chain and tree.

Both are baselines that every trained drafter is reported beside (REFERENCE.md: Spec-Bench PLD and
SpS rows). Trees from the draft model use EAGLE-2's dynamic expansion (``infer.dynamic_tree``).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from infer.attention import additive_mask, drop_holes
from infer.datastore import Datastore
from infer.proposer import Proposer
from infer.sampling import SamplingParams, greedy_ids, sample_from_probs, warp_logits
from infer.tree import DraftTree, chain
from infer.tree_search import DynamicTreeConfig, build_dynamic_tree, build_static_tree


def _pack_rows(rows: list[list[int]], parents: list[list[int]], device) -> DraftTree:
    """Ragged per-row trees (node 0 = root) → one padded DraftTree (padding nodes invalid)."""
    n = max(len(r) for r in rows)
    B = len(rows)
    tokens = torch.zeros(B, n, dtype=torch.long)
    par = torch.zeros(B, n, dtype=torch.long)
    valid = torch.zeros(B, n, dtype=torch.bool)
    for b, (r, p) in enumerate(zip(rows, parents)):
        tokens[b, : len(r)] = torch.tensor(r)
        par[b, : len(p)] = torch.tensor(p)
        valid[b, : len(r)] = True
        # padding nodes hang off the root; invalid, so never accepted and never attended to
    par[:, 0] = -1
    return DraftTree(tokens.to(device), par.to(device), valid.to(device))


# ------------------------------------------------------------------------------------ prompt lookup
class PromptLookupProposer(Proposer):
    """Copy the continuation of the latest earlier occurrence of the context's last n-gram.

    Like HF's ``prompt_lookup_num_tokens`` (Saxena 2023): try n-gram sizes from ``max_ngram`` down to
    ``min_ngram``; the first size with a match wins. With ``num_candidates > 1`` the continuations
    of the most recent distinct matches are merged into a prefix tree (a static-shape tree is not
    needed: rows are padded). Drafts are deterministic, so sampling verifies them as one-hot q.

    ``datastore`` (`infer.datastore.Datastore`): where the context's own match is shorter than
    ``DATASTORE_BELOW`` tokens, the datastore's continuation is drafted instead, when it has one.
    """

    DATASTORE_BELOW = 2
    """A 1-gram match in the context loses to any datastore match (n >= 2): a single token recurs too often."""

    def __init__(
        self,
        num_draft: int = 10,
        max_ngram: int = 3,
        min_ngram: int = 1,
        num_candidates: int = 1,
        datastore: Datastore | None = None,
    ):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if num_draft < 1 or num_candidates < 1:
            raise ValueError("num_draft and num_candidates must be >= 1")
        self.num_draft, self.max_ngram, self.min_ngram, self.num_candidates = (
            num_draft,
            max_ngram,
            min_ngram,
            num_candidates,
        )
        self.datastore = datastore
        self.device = torch.device("cpu")

    def match(self, ctx: list[int]) -> tuple[int, list[list[int]]]:
        """(n, continuations): the n-gram size that matched (0: none) and up to ``num_candidates`` distinct
        continuations of its matches, most recent first."""
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            tail = ctx[-n:]
            found: list[list[int]] = []
            for start in range(len(ctx) - n - 1, -1, -1):  # latest match first; excludes the tail itself
                if ctx[start : start + n] == tail:
                    cont = ctx[start + n : start + n + self.num_draft]
                    if cont and cont not in found:
                        found.append(cont)
                        if len(found) == self.num_candidates:
                            return n, found
            if found:
                return n, found
        return 0, []

    def candidates(self, ctx: list[int]) -> list[list[int]]:
        """Up to ``num_candidates`` distinct continuations, most recent match first (the datastore's, where the
        context's own match is short and the datastore has one)."""
        n, found = self.match(ctx)
        if self.datastore is not None and n < self.DATASTORE_BELOW:
            stored = self.datastore.match(ctx)[1]
            if stored:
                return [stored[: self.num_draft]]
        return found

    def propose(self, contexts: list[list[int]], params: SamplingParams, generator: torch.Generator) -> DraftTree:
        rows, parents = [], []
        for ctx in contexts:
            tokens, par, children = [ctx[-1]], [-1], {}
            for cont in self.candidates(ctx):
                node = 0
                for t in cont:  # merge into a trie so shared prefixes are verified once
                    key = (node, t)
                    if key not in children:
                        children[key] = len(tokens)
                        tokens.append(t)
                        par.append(node)
                    node = children[key]
            rows.append(tokens)
            parents.append(par)
        return _pack_rows(rows, parents, generator.device)


# -------------------------------------------------------------------------------------- draft model
class DraftModelProposer(Proposer):
    """A small LM sharing the target's tokenizer drafts a chain (``k`` tokens) or an EAGLE-2 tree.

    The draft keeps its own KV cache with the same slot layout as the runtime (``kv_valid`` holes,
    explicit positions). Only real context tokens stay valid in it: the slots written while
    drafting are closed after each proposal, and the next proposal re-feeds the tokens accepted
    since (they ride along in the first draft forward, so rejected drafts cost no extra forward).
    Chains at T > 0 are sampled from the draft's warped distribution q and verified with q
    (stochastic); greedy chains and trees (top-k children) are deterministic drafts (one-hot q).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        k: int = 4,
        tree: DynamicTreeConfig | None = None,
        static_paths: list[tuple[int, ...]] | None = None,
    ):
        if k < 1:
            raise ValueError("k must be >= 1")
        if tree is not None and static_paths is not None:
            raise ValueError("choose a dynamic tree or static paths, not both")
        self.model, self.k, self.tree, self.static_paths = model.eval(), k, tree, static_paths
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    def begin(self, contexts: list[list[int]]) -> None:
        self.cache = DynamicCache()
        self.kv_valid = torch.zeros(len(contexts), 0, dtype=torch.bool, device=self.device)
        self.cached = [[] for _ in contexts]  # real tokens in this row's valid slots, in order

    def drop_rows(self, keep: torch.Tensor) -> None:
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys.index_select(0, keep), layer.values.index_select(0, keep)
        self.kv_valid = self.kv_valid.index_select(0, keep)
        self.cached = [self.cached[i] for i in keep.tolist()]

    def _forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        new_allowed: torch.Tensor,
        new_valid: torch.Tensor,
        read_at: torch.Tensor | None = None,
    ):
        """Append [B, m] tokens; ``new_allowed[b, i, j]``: token i may see new token j. Returns logits [B, m, V], or
        [B, V] at position ``read_at[b]`` of each row (the head then runs on those positions only: a 49k-wide head
        over a whole prompt would cost more than the rest of the draft model)."""
        B, m = tokens.shape
        allowed = torch.cat([self.kv_valid[:, None, :].expand(B, m, -1), new_allowed], 2)
        hidden = self.model.get_decoder()(
            input_ids=tokens,
            attention_mask=additive_mask(allowed, self.dtype),
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
        ).last_hidden_state
        self.kv_valid = torch.cat([self.kv_valid, new_valid], 1)
        if read_at is not None:
            hidden = hidden[torch.arange(B, device=hidden.device), read_at]
        return self.model.get_output_embeddings()(hidden)

    def _sync(self, contexts: list[list[int]]) -> torch.Tensor:
        """Feed each row's uncached context tokens (root included); returns root logits [B, V]."""
        B = len(contexts)
        feed = []
        for b, ctx in enumerate(contexts):
            have = self.cached[b]
            if ctx[: len(have)] != have:  # the runtime only appends, so this would be a bug upstream
                raise RuntimeError("draft cache diverged from the accepted context")
            feed.append(ctx[len(have) :])
        m = max(len(f) for f in feed)
        tokens = torch.zeros(B, m, dtype=torch.long, device=self.device)
        valid = torch.zeros(B, m, dtype=torch.bool, device=self.device)
        for b, f in enumerate(feed):
            tokens[b, : len(f)] = torch.tensor(f, device=self.device)
            valid[b, : len(f)] = True
        start = self.kv_valid.sum(1)
        positions = start[:, None] + torch.arange(m, device=self.device)[None]
        causal = torch.ones(m, m, dtype=torch.bool, device=self.device).tril()
        allowed = (causal[None] & valid[:, None, :]) | torch.eye(m, dtype=torch.bool, device=self.device)[None]
        last = valid.sum(1) - 1
        root_logits = self._forward(tokens, positions, allowed, valid, read_at=last)
        for b, f in enumerate(feed):
            self.cached[b] = self.cached[b] + f
        self._draft_pos = start + valid.sum(1)  # position of the root's children
        self._proposal_start = self.kv_valid.shape[1]
        return root_logits

    def _close_draft_slots(self) -> None:
        self.kv_valid[:, self._proposal_start :] = False
        # re-pack when holes dominate, so the cache does not grow without bound on long generations
        layers = self.cache.layers
        self.kv_valid, kvs = drop_holes(self.kv_valid, [kv for layer in layers for kv in (layer.keys, layer.values)])
        for layer, keys, values in zip(layers, kvs[::2], kvs[1::2]):
            layer.keys, layer.values = keys, values

    @torch.no_grad()
    def propose(self, contexts: list[list[int]], params: SamplingParams, generator: torch.Generator) -> DraftTree:
        root_logits = self._sync(contexts)
        if self.tree is not None or self.static_paths is not None:
            tree = self._propose_tree(contexts, root_logits)
        else:
            tree = self._propose_chain(contexts, root_logits, params, generator)
        self._close_draft_slots()
        return tree

    def _propose_chain(self, contexts, root_logits, params, generator) -> DraftTree:
        B = len(contexts)
        tokens = [torch.tensor([c[-1] for c in contexts], device=self.device)]
        qs = []
        logits = root_logits
        for i in range(self.k):
            if params.greedy:
                nxt = greedy_ids(logits)
            else:
                q = warp_logits(logits, params).softmax(-1)
                qs.append(q)
                nxt = sample_from_probs(q, torch.rand(B, generator=generator, device=generator.device))
            tokens.append(nxt)
            if i + 1 < self.k:
                # the new token sees the valid context and, through kv_valid, the chain drafted so far
                one = torch.ones(B, 1, 1, dtype=torch.bool, device=self.device)
                logits = self._forward(nxt[:, None], (self._draft_pos + i)[:, None], one, one[:, 0])[:, -1]
        draft_probs = None
        if qs:
            # row i = distribution node i's child was drawn from; the leaf's row is unused (zeros)
            draft_probs = torch.stack(qs + [torch.zeros_like(qs[0])], 1)
        return chain(torch.stack(tokens, 1), draft_probs)

    def _propose_tree(self, contexts, root_logits) -> DraftTree:
        B = len(contexts)
        roots = torch.tensor([c[-1] for c in contexts], device=self.device)
        start = self._proposal_start

        def expand(frontier_tokens: torch.Tensor, frontier_depth: int, frontier_anc: torch.Tensor) -> torch.Tensor:
            """Score frontier [B, k]; ``frontier_anc[b, i, j]``: the j-th earlier expanded node (= draft
            cache slot ``start + j``) is an ancestor of frontier node i. Returns log-probs [B, k, V]."""
            k = frontier_tokens.shape[1]
            own = torch.eye(k, dtype=torch.bool, device=self.device)[None].expand(B, k, k)
            allowed_prior = torch.cat([self.kv_valid[:, None, :start].expand(B, k, -1), frontier_anc], 2)
            allowed = torch.cat([allowed_prior, own], 2)
            logits = self.model(
                input_ids=frontier_tokens,
                attention_mask=additive_mask(allowed, self.dtype),
                position_ids=(self._draft_pos + frontier_depth - 1)[:, None].expand(B, k),
                cache=self.cache,
                use_cache=True,
            ).logits
            self.kv_valid = torch.cat([self.kv_valid, torch.ones(B, k, dtype=torch.bool, device=self.device)], 1)
            return logits.float().log_softmax(-1)

        root_logprobs = root_logits.float().log_softmax(-1)
        if self.static_paths is not None:
            return build_static_tree(roots, root_logprobs, expand, self.static_paths)
        return build_dynamic_tree(roots, root_logprobs, expand, self.tree)
