"""The one answerer (train/data/answerer.py): turn-by-turn answers from the target's own earlier answers, continuous
batching that changes nothing, shards that resume, ranks that split the work disjointly, continuations of exact
length; and the continuous decoder under it (infer/continuous.py)."""

import gzip
import json
from collections.abc import Callable

import pytest
import torch

from infer.generate import generate_vanilla
from infer.sampling import SamplingParams
from models.target import TargetModel
from tests.test_data import backend, tiny_target, tokenizers  # noqa: F401 (fixtures)
from train.data.answerer import AnswerConfig, Job, answer, answer_stop_ids, drop_stale, read_shards, window_sorted
from train.data.chat_render import render
from train.data.files import read_shard, rewrite_shard

QUESTIONS = ["hello there", "what is it", "a much longer question about many things", "why", "tell me more please"]


def _jobs() -> list[Job]:
    return [
        Job(f"q{i}", [[{"role": "user", "content": q}], [{"role": "user", "content": "and then?"}]], meta={"kind": "x"})
        for i, q in enumerate(QUESTIONS)
    ]


def _ids(tok, messages):
    return tok(render(tok, messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"]


def test_chat_answers_follow_the_targets_own_earlier_answers(tokenizers, tiny_target, tmp_path):  # noqa: F811
    tok, target = tokenizers["reference"], TargetModel(tiny_target)
    cfg = AnswerConfig(max_new_tokens=6, batch_size=2)
    counts = answer(target, tok, _jobs(), cfg, tmp_path / "a", log=lambda m: None)
    rows = read_shards(tmp_path / "a")
    assert set(rows) == {f"q{i}" for i in range(5)} and counts["rows_written"] == 5
    stop = answer_stop_ids(tok, target.model)
    assert tok.convert_tokens_to_ids("<|end|>") in stop and tok.eos_token_id in stop
    params = SamplingParams(max_new_tokens=6)
    for i in range(len(QUESTIONS)):  # each answer equals a lone greedy run on the conversation so far
        msgs = rows[f"q{i}"]["messages"]
        assert rows[f"q{i}"]["kind"] == "x" and [m["role"] for m in msgs] == ["user", "assistant"] * 2
        for turn in (1, 3):
            toks = generate_vanilla(target, [_ids(tok, msgs[:turn])], params, stop).tokens[0]
            toks = toks[:-1] if toks and toks[-1] in stop else toks
            assert tok.decode(toks, skip_special_tokens=True).strip() == msgs[turn]["content"]
    assert counts["answers"] == 10 and counts["answer_tokens"] > 0 and counts["tokens_per_s"] > 0


def test_a_rerun_answers_only_what_no_shard_holds(tokenizers, tiny_target, tmp_path, monkeypatch):  # noqa: F811
    import train.data.answerer as answerer

    tok, target = tokenizers["reference"], TargetModel(tiny_target)
    cfg = AnswerConfig(max_new_tokens=4, batch_size=2)
    answer(target, tok, _jobs()[:3], cfg, tmp_path / "a", log=lambda m: None)
    first = read_shards(tmp_path / "a")
    handed = []
    real = answerer.decode_continuous

    def recording(target, submit, *rest):
        def wrapped(n):
            out = submit(n)
            handed.extend(key for key, _ in out)
            return out

        return real(target, wrapped, *rest)

    monkeypatch.setattr(answerer, "decode_continuous", recording)
    answer(target, tok, _jobs(), cfg, tmp_path / "a", log=lambda m: None)
    assert sorted(handed) == ["q3", "q3", "q4", "q4"]  # the two new conversations, two turns each
    rows = read_shards(tmp_path / "a")
    assert len(rows) == 5 and all(rows[k] == v for k, v in first.items())
    assert not list((tmp_path / "a").glob("*.tmp"))


def test_a_run_stopped_by_ctrl_c_keeps_its_finished_rows_and_the_rerun_does_the_rest(
    tokenizers,  # noqa: F811
    tiny_target,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    import train.data.answerer as answerer

    tok, target = tokenizers["reference"], TargetModel(tiny_target)
    # all 5 first turns decode together, then the 5 second turns; a shard every 8 rows: the stop at the 7th answer
    # (2 conversations finished) comes before the first shard
    cfg = AnswerConfig(max_new_tokens=4, batch_size=8)
    answer(target, tok, _jobs(), cfg, tmp_path / "whole", log=lambda m: None)
    real = answerer.decode_continuous

    def stopped_after_seven_answers(target, submit, on_done, *rest):
        seen = []

        def done(key, toks):
            on_done(key, toks)
            seen.append(key)
            if len(seen) == 7:
                raise KeyboardInterrupt

        return real(target, submit, done, *rest)

    monkeypatch.setattr(answerer, "decode_continuous", stopped_after_seven_answers)
    lines = []
    with pytest.raises(KeyboardInterrupt):
        answer(target, tok, _jobs(), cfg, tmp_path / "a", log=lines.append)
    kept = read_shards(tmp_path / "a")
    assert len(kept) == 2 and any("of it" in line for line in lines)  # finished rows on disk, the rate said
    monkeypatch.setattr(answerer, "decode_continuous", real)
    answer(target, tok, _jobs(), cfg, tmp_path / "a", log=lambda m: None)
    assert read_shards(tmp_path / "a") == read_shards(tmp_path / "whole")


def test_ranks_write_disjoint_shards_whose_union_is_the_single_process_run(
    tokenizers,  # noqa: F811
    tiny_target,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    tok, target = tokenizers["reference"], TargetModel(tiny_target)
    cfg = AnswerConfig(max_new_tokens=4, batch_size=2)
    answer(target, tok, _jobs(), cfg, tmp_path / "one", log=lambda m: None)
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        answer(target, tok, _jobs(), cfg, tmp_path / "two", log=lambda m: None)
    per_rank = {
        r: {json.loads(line)["id"] for f in (tmp_path / "two").glob(f"shard-r0{r}-*.jsonl.gz") for line in gzip.open(f)}
        for r in (0, 1)
    }
    assert per_rank == {0: {"q0", "q2", "q4"}, 1: {"q1", "q3"}}
    assert read_shards(tmp_path / "two") == read_shards(tmp_path / "one")


def test_continuations_have_exactly_their_length_and_every_token_is_a_target(tiny_target, tmp_path):  # noqa: F811
    target = TargetModel(tiny_target)
    jobs = [Job(str(i), prompt_ids=list(range(3 + i, 9 + i))) for i in range(3)]
    answer(target, None, jobs, AnswerConfig(new_tokens=7, batch_size=2), tmp_path / "c", log=lambda m: None)
    rows = read_shards(tmp_path / "c")
    for job in jobs:
        ids = rows[job.id]["input_ids"]
        assert ids[:6] == job.prompt_ids and len(ids) == 13 and rows[job.id]["loss_mask"] == [1] * 13
        assert ids[6:] == generate_vanilla(target, [job.prompt_ids], SamplingParams(max_new_tokens=7)).tokens[0]


def test_a_conversation_ends_where_its_prompt_outgrows_the_budget(tokenizers, tiny_target, tmp_path):  # noqa: F811
    tok, target = tokenizers["reference"], TargetModel(tiny_target)
    first = len(_ids(tok, [{"role": "user", "content": QUESTIONS[0]}]))
    cfg = AnswerConfig(max_new_tokens=4, batch_size=4, max_length=first + 4)  # room for turn 1 only
    counts = answer(target, tok, _jobs()[:1], cfg, tmp_path / "e", log=lambda m: None)
    row = read_shards(tmp_path / "e")["q0"]
    assert [m["role"] for m in row["messages"]] == ["user", "assistant"] and row["ended"] == "prompt_too_long"
    assert counts["prompt_too_long"] == 1 and counts["no_answer_prompt_too_long"] == 0
    tight = AnswerConfig(max_new_tokens=4, max_length=first + 3)  # not even turn 1: no row, counted
    counts = answer(target, tok, _jobs()[:1], tight, tmp_path / "f", log=lambda m: None)
    assert read_shards(tmp_path / "f") == {} and counts["no_answer_prompt_too_long"] == 1


def test_a_job_is_chat_or_continuation():
    with pytest.raises(ValueError, match="exactly one"):
        Job("x")
    with pytest.raises(ValueError, match="exactly one"):
        Job("x", [[{"role": "user", "content": "hi"}]], prompt_ids=[1, 2])


def _submit_from(waiting: list) -> Callable[[int], list]:
    """``decode_continuous``'s ``submit``: the next n (key, prompt) pairs of ``waiting``, taken off it (a test may put
    more on it meanwhile, as a conversation's next turn)."""

    def submit(n: int) -> list:
        out = waiting[:n]
        del waiting[:n]
        return out

    return submit


def test_continuous_batching_gives_each_prompt_its_lone_greedy_answer(tiny_target, monkeypatch):  # noqa: F811
    """Prompts of different lengths joining a running batch of 2 as slots free up (and one prompt of a single token,
    nothing to prefill), some of them submitted from on_done as a next turn would be: every answer equals the lone
    greedy run."""
    import infer.continuous as continuous_module
    from infer.continuous import decode_continuous

    target = TargetModel(tiny_target)
    prompts = {f"p{i}": list(range(2 + i, 2 + i + n)) for i, n in enumerate((5, 1, 9, 3, 12, 2))}
    later = {"p0": ("p0-next", [7, 8, 9, 10])}
    waiting = list(prompts.items())
    answers: dict[str, list[int]] = {}

    submit = _submit_from(waiting)

    def on_done(key, toks):
        answers[key] = toks
        if key in later:
            waiting.insert(0, later[key])

    params = SamplingParams(max_new_tokens=6)
    widths = []
    real_step = continuous_module.vanilla_round

    def step(target, state, *args):
        widths.append(state.kv_valid.shape[1])
        assert all(layer.keys.shape[2] == widths[-1] for layer in state.cache.layers)
        return real_step(target, state, *args)

    monkeypatch.setattr(continuous_module, "vanilla_round", step)
    stats = decode_continuous(target, submit, on_done, params, (), batch_size=2, refill=1)
    # slots no live row holds are dropped: the cache never outgrows the longest prompt plus one answer
    assert max(widths) <= 12 + 6
    expected = {**prompts, "p0-next": later["p0"][1]}
    assert set(answers) == set(expected) and stats.new_tokens == 6 * len(expected)
    for key, prompt in expected.items():
        assert answers[key] == generate_vanilla(target, [prompt], params).tokens[0], key


def test_a_longer_prompt_joining_a_running_batch_keeps_keys_and_values_aligned(tiny_target, monkeypatch):  # noqa: F811
    """Rows stop at an end token at different rounds, so prompts join a batch that is still decoding, some of them
    longer than its cache: the join left-pads the running rows' keys and values alike. (A cache whose keys, once
    assigned at the new width, widened what its values read took the buffer's spare slots for values: answers went
    to junk mid-sentence.) Every answer equals the lone greedy run."""
    import infer.continuous as continuous_module
    from infer.continuous import decode_continuous

    target = TargetModel(tiny_target)
    lengths = (4, 6, 30, 5, 40, 3, 25, 7)
    prompts = {f"p{i}": [3 + (7 * i + j) % 90 for j in range(n)] for i, n in enumerate(lengths)}
    params = SamplingParams(max_new_tokens=12)
    lone = {k: generate_vanilla(target, [p], params).tokens[0] for k, p in prompts.items()}

    def stops(t: int) -> set[int]:
        return {a.index(t) if t in a else len(a) for a in lone.values()}

    eos = max({t for a in lone.values() for t in a}, key=lambda t: len(stops(t)))
    assert len(stops(eos)) >= 3, "the stand-in's answers give no end token that staggers the rows"
    expected = {k: generate_vanilla(target, [p], params, (eos,)).tokens[0] for k, p in prompts.items()}
    waiting, answers, joins = list(prompts.items()), {}, []

    submit = _submit_from(waiting)

    real_join = continuous_module._join

    def join(target, state, new, *args):
        if state is not None and state.active:  # a join into a running batch: (its width, the fresh rows')
            joins.append((state.kv_valid.shape[1], max(len(p) for p in new) - 1))
        return real_join(target, state, new, *args)

    monkeypatch.setattr(continuous_module, "_join", join)
    decode_continuous(target, submit, lambda k, toks: answers.update({k: toks}), params, (eos,), 3, refill=1)
    assert any(fresh > running for running, fresh in joins), joins
    assert answers == expected


def test_prefill_groups_bound_their_padding():
    """`length_groups` by hand: shortest first, a prompt joins the group while count x longest stays within 10 % of
    the group's tokens, or below the minimum size."""
    from infer.continuous import length_groups

    lengths = [10, 300, 12, 310, 11, 600]
    # 3 x 12 = 36 <= 1.1 x 33; 4 x 300 > 1.1 x 333; 2 x 310 <= 1.1 x 610; 3 x 600 > 1.1 x 1210
    assert length_groups(lengths, 0.1, min_tokens=0) == [[0, 4, 2], [1, 3], [5]]
    assert length_groups(lengths, 0.1, min_tokens=1200) == [[0, 4, 2, 1], [3, 5]]
    assert length_groups([7], 0.1) == [[0]] and length_groups([], 0.1) == []


def _decode_queue(target: TargetModel, prompts: dict, params: SamplingParams) -> dict:
    """`decode_continuous` over ``prompts`` handed out in order, 4 rows, a join once 2 are free: key -> answer."""
    from infer.continuous import decode_continuous

    waiting, answers = list(prompts.items()), {}

    submit = _submit_from(waiting)

    decode_continuous(target, submit, lambda k, toks: answers.update({k: toks}), params, (), 4, refill=2)
    return answers


def test_a_join_prefilled_in_length_groups_gives_each_prompt_its_lone_greedy_answer(tiny_target, monkeypatch):  # noqa: F811
    """Every prompt its own prefill group (a one-token prompt's group has no cache at all), joined to a batch that is
    still decoding: each answer equals the lone greedy run."""
    import infer.continuous as continuous_module
    from infer.continuous import length_groups

    target = TargetModel(tiny_target)
    prompts = {f"p{i}": [3 + (5 * i + j) % 80 for j in range(n)] for i, n in enumerate((6, 1, 11, 3, 17, 2, 9))}
    params = SamplingParams(max_new_tokens=5)
    groups = []

    def every_prompt_alone(lengths):
        groups.append(length_groups(lengths, 0.0, min_tokens=0))
        return groups[-1]

    monkeypatch.setattr(continuous_module, "length_groups", every_prompt_alone)
    answers = _decode_queue(target, prompts, params)
    assert len(groups) >= 2 and len(groups[0]) == 4  # a first batch of four groups, then joins
    assert answers == {k: generate_vanilla(target, [p], params).tokens[0] for k, p in prompts.items()}


def test_a_join_builds_each_cache_layer_once_with_spare_slots_for_the_next_steps(tiny_target, monkeypatch):  # noqa: F811
    """A join of several prefill groups into a running batch: every layer comes out as one buffer holding all rows
    with spare slots beyond the joined width, so the steps after it write in place (the buffer does not move), and
    the answers are still the lone greedy ones."""
    import infer.continuous as continuous_module
    from infer.continuous import length_groups

    target = TargetModel(tiny_target)
    prompts = {f"p{i}": [3 + (7 * i + j) % 80 for j in range(n)] for i, n in enumerate((5, 9, 2, 14, 6, 11))}
    params = SamplingParams(max_new_tokens=4)
    monkeypatch.setattr(continuous_module, "length_groups", lambda lengths: length_groups(lengths, 0.0, min_tokens=0))
    real_join, real_round, joined, moved = continuous_module._join, continuous_module.vanilla_round, [], []

    def join(*args):
        state = real_join(*args)
        layer = state.cache.layers[0]
        assert layer._k.shape[0] == state.kv_valid.shape[0] and layer.keys.shape[2] == state.kv_valid.shape[1]
        joined.append(layer._k.shape[2] > layer.keys.shape[2])  # spare slots past the joined width
        return state

    def step(target, state, *args):
        before = [layer._k.data_ptr() for layer in state.cache.layers]
        out = real_round(target, state, *args)
        moved.append(before != [layer._k.data_ptr() for layer in state.cache.layers])
        return out

    monkeypatch.setattr(continuous_module, "_join", join)
    monkeypatch.setattr(continuous_module, "vanilla_round", step)
    answers = _decode_queue(target, prompts, params)
    assert len(joined) >= 2 and all(joined)
    assert not any(moved[:3])  # the first steps after the first join grow into the spare slots
    assert answers == {k: generate_vanilla(target, [p], params).tokens[0] for k, p in prompts.items()}


def test_a_cache_layer_refuses_buffers_that_cannot_hold_its_slots():
    from infer.attention import SlackLayer

    layer = SlackLayer()
    with pytest.raises(ValueError, match="cannot hold 9 slots"):
        layer.adopt(torch.zeros(1, 1, 8, 4), torch.zeros(1, 1, 8, 4), 9)
    layer.adopt(torch.ones(1, 1, 8, 4), torch.ones(1, 1, 8, 4), 5)
    assert layer.keys.shape == (1, 1, 5, 4) and layer.get_seq_length() == 5


def test_static_batching_answers_the_same_and_the_decode_flops_count_every_weight(tokenizers, tiny_target, tmp_path):  # noqa: F811
    from train.data.answerer import decode_flops_per_token

    tok, target = tokenizers["reference"], TargetModel(tiny_target)
    answer(target, tok, _jobs(), AnswerConfig(max_new_tokens=4, batch_size=2), tmp_path / "c", log=lambda m: None)
    static = AnswerConfig(max_new_tokens=4, batch_size=2, refill=2)
    answer(target, tok, _jobs(), static, tmp_path / "s", log=lambda m: None)
    assert read_shards(tmp_path / "s") == read_shards(tmp_path / "c")
    # the test model: hidden 32, 2 layers, 2 heads of 16, 1 KV head, MLP 64: per layer q, o 32x32, k, v 32x16,
    # gate / up / down 32x64; the head 32 x vocab; attention 4 · layers · context · 32
    config = tiny_target.config
    weights = 2 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64) + 32 * config.vocab_size
    assert decode_flops_per_token(config, 10) == 2 * weights + 4 * 2 * 10 * 32


def test_every_join_offers_the_freed_heap_back(tokenizers, tiny_target, tmp_path, monkeypatch):  # noqa: F811
    """The answerer keeps freed blocks in its heap (`keep_freed_memory`); over a run of long prompts the fragments
    outgrew a 24 GB machine. Every join (each call for new prompts) offers them back (`release_freed_memory` trims
    only past half the machine), so a run of many joins calls it once a join."""
    import train.data.answerer as answerer

    calls = []
    monkeypatch.setattr(answerer, "release_freed_memory", lambda: calls.append(1) or False)
    tok, target = tokenizers["reference"], TargetModel(tiny_target)
    asked = []
    monkeypatch.setattr(answerer._Answering, "submit", _counting(answerer._Answering.submit, asked))
    answer(target, tok, _jobs(), AnswerConfig(max_new_tokens=4, batch_size=2), tmp_path / "c", log=lambda m: None)
    assert len(asked) >= 5 and len(calls) == len(asked)  # 10 turns, two rows at a time


def _counting(method, calls: list):
    def wrapped(self, n):
        calls.append(n)
        return method(self, n)

    return wrapped


def test_the_run_is_set_against_the_machines_limit_for_the_same_work(tokenizers, tiny_target, tmp_path, monkeypatch):  # noqa: F811
    """Every answer run prints its answer tokens/s beside the fastest the same FLOPs (every prompt's prefill, every
    decode step) could run at the machine's GEMM rate."""
    import train.data.answerer as answerer
    from train.data.answerer import decode_flops_per_token, machine_limit

    monkeypatch.setattr(
        answerer, "_gemm_rate", lambda *dtype_and_shape: 1e9
    )  # 1 GFLOP/s: the arithmetic below is exact
    tok, target = tokenizers["reference"], TargetModel(tiny_target)
    lines = []
    counts = answer(
        target, tok, _jobs(), AnswerConfig(max_new_tokens=4, batch_size=2), tmp_path / "c", log=lines.append
    )
    assert counts["prompt_tokens"] > counts["answers"] * 5  # each of the 10 turns' prompts, prefilled whole
    # the ratio is printed to 3 decimals: on a slow (loaded) host it is small and the rounding is its error
    ratio = counts["tokens_per_s"] / counts["limit_tokens_per_s"]
    assert counts["ratio_to_limit"] == pytest.approx(ratio, rel=0.02, abs=5e-4)
    assert any("answer tokens/s against this machine's limit" in line for line in lines)
    config = tiny_target.config
    head = 2 * 32 * config.vocab_size
    fake = {"answers": 2, "answer_tokens": 10, "prompt_tokens": 40, "tokens_per_s": 5.0}
    flops = 40 * (decode_flops_per_token(config, 10) - head) + 10 * decode_flops_per_token(config, 22)
    got = machine_limit(target, fake)
    assert got["gflop_per_answer_token"] == round(flops / 10 / 1e9, 3)
    assert got["limit_tokens_per_s"] == round(1e9 / (flops / 10), 1)


def test_the_limit_is_the_best_gemm_rate_the_run_saw(tokenizers, tiny_target, tmp_path, monkeypatch):  # noqa: F811
    """The machine's rate is probed before the run and again at its shards (at most once a minute; here every time):
    the limit divides by the fastest of them, so a probe taken in a slow minute cannot lower it."""
    import train.data.answerer as answerer

    rates = iter([1e9, 4e9, 2e9, 3e9, 1e9, 1e9, 1e9, 1e9, 1e9])
    calls = []
    monkeypatch.setattr(answerer, "best_gemm_rate", lambda dtype, shapes: (calls.append(shapes) or next(rates), None))
    monkeypatch.setattr(answerer, "_best_rates", {})
    monkeypatch.setattr(answerer, "RATE_EVERY_S", 0.0)
    tok, target = tokenizers["reference"], TargetModel(tiny_target)
    counts = answer(target, tok, _jobs(), AnswerConfig(max_new_tokens=4, batch_size=2), tmp_path / "r", log=lambda m: 0)
    shards = len(list((tmp_path / "r").glob("shard-*")))
    assert shards >= 2 and len(calls) == 1 + shards + 1  # before the run, at each shard, and for the limit
    assert counts["gemm_gflops"] == 4.0  # the best, not the last (1e9) nor the first
    # a probe younger than RATE_EVERY_S is not taken again: the best so far stands
    monkeypatch.setattr(answerer, "RATE_EVERY_S", 3600.0)
    text = target.config.get_text_config()
    assert answerer._gemm_rate(target.dtype, text.hidden_size, text.intermediate_size) == 4e9
    assert len(calls) == 1 + shards + 1


def test_the_target_written_build_answers_through_the_answerer_and_resumes(
    tokenizers,  # noqa: F811 (a fixture)
    tiny_target,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """`train.target_written.build` with the request stage, the code tasks and the prose replaced by fixed ones (a random
    tiny model writes no request the filter keeps): held-out requests of every family are answered apart or kept as
    evaluation prompts, pass 2 derives tasks from pass-1 answers, a request copying an evaluation prompt is dropped,
    the data card counts every family, and a second build answers nothing again."""
    import train.data.target_written as target_written
    import train.data.tasks as tasks

    def fake_requests(target, tokenizer, cfg, path, log=print, family="chat", count=-1):
        kind = "magpie" if family == "chat" else family
        n = cfg.magpie if count < 0 else count
        return [{"id": f"{kind}-{i}", "kind": kind, "batch": 0, "turns": [f"{family} request {i}"]} for i in range(n)]

    evaluation = tasks.evaluation_prompts()[0]
    code = [{"id": "code-0", "kind": "code", "source": "x.py", "turns": [evaluation]}]  # copies an evaluation prompt
    code += [{"id": f"code-{i}", "kind": "code", "source": "x.py", "turns": [f"explain f{i}()"]} for i in (1, 2)]
    prose = [tasks.Passage(f"doc:{i}:0", f"topic {i}", f"Paragraph {i} says something plain.") for i in range(4)]
    monkeypatch.setattr(target_written, "synthesize_requests", fake_requests)
    monkeypatch.setattr(target_written, "code_tasks", lambda n, seed: code[:n])  # the stdlib scan takes a minute
    monkeypatch.setattr(target_written, "prose_passages", lambda split: prose)
    tok, target = tokenizers["reference"], TargetModel(tiny_target)
    cfg = target_written.BuildConfig(
        magpie=5, heldout_chat=2, code=3, multi_turn=0.5, max_new_tokens=4, batch_size=3, qa=2, math_reasoning=0,
        math_templates=1, mt_bench=1, summarization=1, rag=1, translation=1, articles=3, heldout_per_family=1,
    )  # fmt: skip
    monkeypatch.setattr(
        target_written,
        "derived_tasks",
        lambda rows, seed: [
            {"id": "rag-derived", "kind": "rag", "turns": ["Document 1: " + rows[0]["messages"][1]["content"]]}
        ],
    )  # fmt: skip (train/data/tasks.py's own derivation: tests/test_tasks.py)
    summary = target_written.build(target, tok, cfg, tmp_path / "d", log=lambda m: None)
    with gzip.open(tmp_path / "d" / "train.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    # pass 1: 3 chat + 2 qa + 1 mt_bench + 2 code (one dropped) + 1 math + 1 summary + 1 rag + 1 translation +
    # 3 articles; pass 2: 1
    assert summary["conversations"] == len(rows) == 16 and summary["dropped_as_eval_overlap"] == 1
    assert rows[-1]["id"] == "rag-derived" and summary["heldout_by_family"] == {"chat": 2, "qa": 1, "mt_bench": 1}
    kinds = {r["kind"] for r in rows}
    assert kinds == {
        "magpie",
        "qa",
        "mt_bench",
        "code",
        "math_reasoning",
        "summarization",
        "rag",
        "translation",
        "article",
    }
    assert not {r["id"] for r in rows} & {"magpie-0", "magpie-1", "qa-0", "mt_bench-0", "code-0"}
    assert all(len(r["messages"]) == 4 for r in rows if r["kind"] == "mt_bench")  # always a second turn
    assert all(m["content"] for r in rows for m in r["messages"]) and summary["multi_turn"] >= 1
    assert set(summary["by_family"]) == {"chat", "code", "mt_bench", "translation", "summarization", "qa",
                                         "math_reasoning", "rag"}  # fmt: skip
    assert summary["answer_tokens"] == sum(f["answer_tokens"] for f in summary["by_family"].values()) > 0
    qa = summary["by_family"]["qa"]
    card = (tmp_path / "d" / "README.md").read_text()
    assert f"| qa | {qa['conversations']:,} | {qa['answers']:,} | {qa['answer_tokens']:,} |" in card
    with gzip.open(tmp_path / "d" / "heldout.jsonl.gz", "rt") as f:
        assert [json.loads(line)["id"] for line in f] == ["magpie-0", "magpie-1"]
    held = [json.loads(line) for line in (tmp_path / "d" / "families_heldout.jsonl").read_text().splitlines()]
    assert [(r["question_id"], r["category"]) for r in held] == [
        ("magpie-0", "chat"), ("magpie-1", "chat"), ("qa-0", "qa"), ("mt_bench-0", "mt_bench")
    ]  # fmt: skip
    again = target_written.build(target, tok, cfg, tmp_path / "d", log=lambda m: None)
    assert again["this_run"]["first_pass"]["answers"] == again["this_run"]["derived"]["answers"] == 0
    assert again["conversations"] == 16
    # the pass-1 answer the derived task quotes is now another text on disk (an audit removed it and it was answered
    # again): the next build drops the derived row that quoted the old text and answers the task's new prompt
    quoted = rows[0]["id"]
    (shard,) = [
        p for p in (tmp_path / "d" / "answers").glob("*.jsonl.gz") if quoted in {r["id"] for r in read_shard(p)}
    ]
    edited = [r | {"messages": [r["messages"][0], {"role": "assistant", "content": "new text"}]} if r["id"] == quoted
              else r for r in read_shard(shard)]  # fmt: skip
    rewrite_shard(shard, edited)
    third = target_written.build(target, tok, cfg, tmp_path / "d", log=lambda m: None)
    assert third["this_run"]["first_pass"]["answers"] == 0 and third["this_run"]["derived"]["answers"] == 1
    derived = read_shards(tmp_path / "d" / "answers_derived")["rag-derived"]
    assert derived["messages"][0]["content"] == "Document 1: new text" and third["conversations"] == 16


def test_drop_stale_removes_exactly_the_rows_whose_prompts_changed(tmp_path):
    def row(i, *turns):
        msgs = [m for t in turns for m in ({"role": "user", "content": t}, {"role": "assistant", "content": "a"})]
        return {"id": f"c{i}", "messages": msgs}

    def job(i, *turns):
        return Job(f"c{i}", [[{"role": "user", "content": t}] for t in turns])

    out = tmp_path / "a"
    out.mkdir()
    rewrite_shard(
        out / "shard-r00-0000000.jsonl.gz", [row(0, "x", "y"), row(1, "x") | {"ended": "empty_answer"}, row(2, "old")]
    )
    rewrite_shard(out / "shard-r00-0000001.jsonl.gz", [row(3, "old", "y")])
    rewrite_shard(out / "shard-r00-0000002.jsonl.gz", [row(4, "kept"), row(5, "x")])
    jobs = [job(0, "x", "y"), job(1, "x", "y"), job(2, "new"), job(3, "new", "y"), job(5, "x", "a follow-up added")]
    assert drop_stale(out, jobs, log=lambda m: None) == 3  # c2, c3: another prompt; c5: a turn it never answered
    assert set(read_shards(out)) == {"c0", "c1", "c4"}  # c1 ended early; c4: no job names it, left alone
    assert not (out / "shard-r00-0000001.jsonl.gz").exists()  # left empty: removed
    assert drop_stale(out, jobs, log=lambda m: None) == 0


def test_steered_requests_are_sampled_continuously_filtered_and_resumed(tokenizers, tiny_target, tmp_path, monkeypatch):  # noqa: F811
    """`synthesize_requests` for a steered family: every prompt is the user header plus an opener, a kept request is
    the opener plus the target's text, duplicates and unfinished ones are dropped, and a rerun keeps what is on disk
    and samples only the rest (the decoder is a stand-in that answers from a script)."""
    import train.data.target_written as target_written
    from train.data.chat_render import end_of_turn_token_ids
    from train.data.tasks import OPENERS

    tok = tokenizers["reference"]
    stop = end_of_turn_token_ids(tok)[0]
    header = target_written.user_turn_prefix(tok)
    script = iter(
        [" is a river?", " is a river?", " unfinished", *(f" is thing number {i}?" for i in range(40))]
    )  # a duplicate, an unfinished one, then new ones
    seen_prompts = []

    def fake_decode(target, submit, on_done, params, eos, batch_size, refill=None):
        while True:
            new = submit(2)
            if not new:
                return None
            for key, prompt in new:
                seen_prompts.append(tok.decode(prompt))
                text = next(script)
                ids = tok(text, add_special_tokens=False)["input_ids"]
                on_done(key, ids if "unfinished" in text else [*ids, stop])

    monkeypatch.setattr(target_written, "decode_continuous", fake_decode)
    cfg = target_written.BuildConfig(batch_size=2)
    path = tmp_path / "qa_requests.jsonl"
    rows = target_written.synthesize_requests(TargetModel(tiny_target), tok, cfg, path, lambda m: None, "qa", 3)
    assert [r["id"] for r in rows] == ["qa-0", "qa-1", "qa-2"] and all(r["kind"] == "qa" for r in rows)
    assert all(p.startswith(header) and p[len(header) :] in OPENERS["qa"] for p in seen_prompts)
    assert all(any(r["turns"][0].startswith(o) for o in OPENERS["qa"]) for r in rows)
    assert len({r["turns"][0] for r in rows}) == 3 and not any("unfinished" in r["turns"][0] for r in rows)
    seen_prompts.clear()
    more = target_written.synthesize_requests(TargetModel(tiny_target), tok, cfg, path, lambda m: None, "qa", 5)
    assert more[:3] == rows and [r["id"] for r in more] == [f"qa-{i}" for i in range(5)]
    assert len(seen_prompts) == 2  # only the two missing requests were sampled


def test_new_prompts_are_sorted_by_length_only_within_windows_so_any_prefix_keeps_the_mix():
    """Two kinds alternate, one short and one long: sorted within windows of 4, every window (hence every prefix of
    the answering order) holds both kinds; a window as large as the set would put every short prompt first."""
    prompts = [(f"{kind}{i}", [0] * (3 if kind == "short" else 40 + i)) for i in range(8) for kind in ("long", "short")]
    got = window_sorted(prompts, 4)
    assert sorted(got) == sorted(prompts)
    for w in range(0, len(got), 4):
        window = got[w : w + 4]
        assert [len(p) for _, p in window] == sorted(len(p) for _, p in window)
        assert {k.rstrip("0123456789") for k, _ in window} == {"short", "long"}
    assert [k for k, _ in window_sorted(prompts, len(prompts))][:8] == [f"short{i}" for i in range(8)]
    with pytest.raises(ValueError, match="length_window"):
        AnswerConfig(length_window=0)


def test_a_row_stop_row_ends_leaves_its_slot_and_the_others_answer_as_alone(tiny_target):  # noqa: F811
    """``stop_row`` ends a row after the step where it says so: that answer is the lone greedy run's prefix, its slot
    takes the next prompt, and every other answer is the lone run's whole."""
    from infer.continuous import decode_continuous

    target = TargetModel(tiny_target)
    prompts = {f"p{i}": list(range(3 + i, 9 + 2 * i)) for i in range(4)}
    waiting = list(prompts.items())
    answers: dict[str, list[int]] = {}

    submit = _submit_from(waiting)

    params = SamplingParams(max_new_tokens=8)
    decode_continuous(
        target,
        submit,
        lambda key, toks: answers.__setitem__(key, list(toks)),
        params,
        (),
        batch_size=2,
        refill=1,
        stop_row=lambda key, toks: key == "p1" and len(toks) >= 3,
    )
    assert set(answers) == set(prompts)
    for key, prompt in prompts.items():
        alone = generate_vanilla(target, [prompt], params).tokens[0]
        assert answers[key] == (alone[:3] if key == "p1" else alone), key


def test_answers_caught_in_a_loop_stop_and_are_counted(tokenizers, tiny_target, tmp_path, monkeypatch):  # noqa: F811
    """With ``stop_loops`` a turn whose last tokens repeat its own earlier text ends there: its tokens are the
    uncapped answer's up to the first ``stop_loops`` tokens of the loop, and it counts as stopped in a loop, not as
    capped; answers that never loop are the same."""
    import train.data.answerer as answerer_module
    from train.data.loops import LoopWatch

    decoded: dict[str, dict[str, list[int]]] = {}
    real = answerer_module.decode_continuous

    def spy(target, submit, on_done, *args):  # the tokens each run decoded, by job
        run = decoded.setdefault(str(len(decoded)), {})
        return real(target, submit, lambda key, toks: (run.__setitem__(key, list(toks)), on_done(key, toks)), *args)

    monkeypatch.setattr(answerer_module, "decode_continuous", spy)
    tok, target = tokenizers["reference"], TargetModel(tiny_target)
    jobs = [Job(f"q{i}", [[{"role": "user", "content": q}]]) for i, q in enumerate(QUESTIONS)]
    full = answer(target, tok, jobs, AnswerConfig(max_new_tokens=80, batch_size=2), tmp_path / "f", log=lambda m: None)
    cut = AnswerConfig(max_new_tokens=80, batch_size=2, stop_loops=4)
    counts = answer(target, tok, jobs, cut, tmp_path / "c", log=lambda m: None)
    looped = 0
    for key, toks in decoded["0"].items():
        watch = LoopWatch()
        stop = next((n for n in range(1, len(toks) + 1) if watch.update(toks[:n]) >= 4), None)
        looped += stop is not None
        assert decoded["1"][key] == (toks if stop is None else toks[:stop]), key
    assert looped > 0 and counts["loop_stopped"] == looped
    assert counts["hit_max_new_tokens"] == full["hit_max_new_tokens"] - looped
    assert counts["answer_tokens"] < full["answer_tokens"]
    with pytest.raises(ValueError, match="stop_loops"):
        AnswerConfig(stop_loops=0)
