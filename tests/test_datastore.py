"""The datastore of the target's own text (infer/datastore.py) and the proposers that draft from it: the longest
n-gram's latest continuation, never across a sequence's end; prompt lookup and the hybrid fall back to it where the
context's own match is short; decoding with it is token-identical to vanilla."""

import gzip
import json

import pytest
import torch

from infer.datastore import Datastore
from infer.generate import generate_speculative, generate_vanilla
from infer.hybrid import HybridProposer
from infer.proposers import DraftModelProposer, PromptLookupProposer
from infer.sampling import SamplingParams
from infer.tree_search import DynamicTreeConfig
from tests.test_generate import GREEDY, PROMPTS
from tests.test_hybrid import Fixed


def test_the_longest_ngram_gives_its_latest_continuation_cut_at_the_sequence_end():
    store = Datastore([[1, 2, 3, 4, 5], [9, 2, 3, 7], [2, 3, 8, 8, 8, 8]], num_draft=3, min_ngram=2, max_ngram=4)
    assert len(store) == 15
    assert store.match([0, 1, 2, 3]) == (3, [4, 5])  # "1 2 3" occurs once: its continuation stops at the end
    assert store.match([0, 2, 3]) == (2, [8, 8, 8])  # "2 3" thrice: the latest wins, num_draft tokens
    assert store.match([9, 2, 3]) == (3, [7])
    assert store.match([3, 7]) == (0, [])  # "3 7" ends its sequence: nothing follows it there
    assert store.match([6]) == (0, [])  # shorter than min_ngram
    assert store.match([4, 4, 5, 6]) == (0, [])
    long = Datastore([[1, 2, 3, 4, 5, 6, 7], [9, 3, 4, 5, 6, 0]], num_draft=2, min_ngram=4, max_ngram=6)
    assert long.match([1, 2, 3, 4, 5, 6]) == (6, [7]) and long.match([3, 4, 5, 6]) == (4, [0])
    assert long.match([4, 5, 6]) == (0, [])  # below min_ngram


def test_bad_ids_and_settings_are_refused():
    with pytest.raises(ValueError, match="token ids"):
        Datastore([[1, -3]])
    with pytest.raises(ValueError, match="min_ngram"):
        Datastore([[1, 2]], min_ngram=3, max_ngram=2)


def test_a_hash_collision_is_a_miss_not_a_wrong_match(monkeypatch):
    import infer.datastore as ds

    monkeypatch.setattr(ds, "_MULT", 0)  # every n-gram's key is its last token: n-grams ending alike collide
    store = Datastore([[1, 2, 3, 9], [4, 5, 3, 8]], num_draft=2, min_ngram=2, max_ngram=6)
    # "4 5 3" and "5 3" hold the shared keys' latest places: "1 2 3" finds them, sees other n-grams, and misses
    assert store.match([1, 2, 3]) == (0, [])
    assert store.match([7, 5, 3]) == (2, [8])
    assert store.match([7, 7, 3]) == (0, [])


def test_prompt_lookup_drafts_from_the_datastore_only_where_its_own_match_is_short():
    store = Datastore([[20, 21, 22, 23], [5, 6, 30, 31]], num_draft=4)
    lookup = PromptLookupProposer(num_draft=4, datastore=store)
    assert lookup.candidates([5, 6, 7, 8, 5, 6]) == [[7, 8, 5, 6]]  # its own 2-gram match wins
    assert lookup.candidates([1, 20, 21]) == [[22, 23]]  # no match of its own
    assert lookup.candidates([20, 1, 20, 21]) == [[22, 23]]  # a 1-gram match ("20") loses to the store's 2-gram
    assert lookup.candidates([20, 1, 20]) == [[1, 20]]  # the store has no 2-gram: the 1-gram match stays


def test_the_hybrid_merges_the_datastore_chain_after_the_learned_nodes():
    store = Datastore([[2, 3, 60, 61, 62]], num_draft=4)
    hybrid = HybridProposer(Fixed(), num_draft=4, strong_match=2, weak_tokens=1, budget=16, datastore=store)
    strong = [5, 6, 7, 8, 9, 5, 6]  # its own 2-gram: the lookup chain, as without a datastore
    stored = [1, 2, 3]  # no match of its own, the store's "2 3"
    hybrid.begin([strong, stored])
    tree = hybrid.propose([strong, stored], SamplingParams(), torch.Generator())
    rows = [[(int(t), int(p)) for t, p, v in zip(*r) if v] for r in zip(tree.tokens, tree.parents, tree.valid)]
    assert rows[0] == [(6, -1), (90, 0), (91, 0), (7, 0), (8, 3), (9, 4), (5, 5)]
    assert rows[1] == [(3, -1), (90, 0), (91, 0), (60, 0), (61, 3), (62, 4)]
    assert hybrid.steps == {"strong": 1, "datastore": 1, "weak": 0, "none": 0, "lookup alone": 0}


@pytest.mark.parametrize("batch", [1, 4])
def test_decoding_with_a_datastore_is_token_identical(tiny_target, tiny_draft, batch):
    prompts = PROMPTS[:batch]
    expected = [generate_vanilla(tiny_target, [p], GREEDY).tokens[0] for p in prompts]
    # the store holds the target's own answers, the last half of each cut off, plus noise: it matches often and is
    # wrong where the answer goes on past what it holds
    store = Datastore([e[: len(e) // 2] for e in expected] + [[1, 2, 3, 4, 5, 6]], num_draft=6)
    lookup = PromptLookupProposer(num_draft=6, datastore=store)
    assert generate_speculative(tiny_target, lookup, prompts, GREEDY).tokens == expected
    learned = DraftModelProposer(tiny_draft, tree=DynamicTreeConfig(top_k=2, depth=3, total_tokens=6))
    hybrid = HybridProposer(learned, num_draft=6, budget=12, datastore=store)
    assert generate_speculative(tiny_target, hybrid, prompts, GREEDY).tokens == expected
    assert hybrid.steps["datastore"] > 0
    sampled = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5)
    runs = [generate_speculative(tiny_target, PromptLookupProposer(6, datastore=store), prompts, sampled).tokens]
    runs.append(generate_speculative(tiny_target, PromptLookupProposer(6, datastore=store), prompts, sampled).tokens)
    assert runs[0] == runs[1]


def test_built_from_the_assistant_turns_of_conversation_shards(tmp_path):
    class Chars:  # a stand-in tokenizer: one id per character
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "abcd"}]},
        {"messages": [{"role": "user", "content": "yo"}, {"role": "assistant", "content": "xbcz"}]},
    ]
    with gzip.open(tmp_path / "shard.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    store = Datastore.from_conversations([tmp_path], Chars(), num_draft=2)
    assert len(store) == 8  # answers only, not the user turns
    assert store.match([ord("b"), ord("c")]) == (2, [ord("z")])
    with pytest.raises(FileNotFoundError, match="no \\*.jsonl.gz"):
        Datastore.from_conversations([tmp_path / "nothing"], Chars())
