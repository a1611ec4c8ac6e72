"""Training requests per task family (train/data/tasks.py): prose extraction, templated and derived tasks, and the
disjointness from every evaluation prompt."""

import json

from train.data.tasks import (
    LANGUAGES,
    OPENERS,
    Disjoint,
    Passage,
    _prose,
    derived_tasks,
    evaluation_prompts,
    math_tasks,
    rag_tasks,
    summarization_tasks,
    to_language_tasks,
    write_tasks,
)

PROSE = [
    Passage(f"doc{i // 3}:{i % 3}", f"topic {i // 3}", f"Paragraph {i} of document {i // 3} describes topic {i // 3}.")
    for i in range(9)
]


def test_prose_keeps_running_text_and_drops_code_lists_markup_and_urls():
    text = "The assert statement is a convenient way to insert debugging checks into a program while it runs."
    assert _prose(text + "\nIt is *removed* when optimisation is requested at compile time.") == (
        text + " It is removed when optimisation is requested at compile time."
    )
    for bad in (
        "   assert_stmt ::= 'assert' expression [',' expression] which is the grammar of the statement here",
        "* a bullet item that is long enough to be a paragraph of prose by its number of words alone",
        text + " See https://docs.python.org for the details of this statement and its forms.",
        ">>> print('an example transcript that is long enough to pass the word count of the filter')",
        "too short",
    ):
        assert _prose(bad) is None, bad


def test_templated_tasks_use_the_passages_and_the_families_formats():
    summaries = summarization_tasks(PROSE, 4, seed=0)
    assert [t["kind"] for t in summaries] == ["summarization"] * 4
    assert all(any(p.text in t["turns"][0] for p in PROSE) for t in summaries)
    rag = rag_tasks(PROSE, 3, seed=0)
    for t in rag:
        prompt = t["turns"][0]
        assert prompt.startswith("Document 1: ") and "Document 3: " in prompt and "\n\nQuestion: " in prompt
        assert "topic" in prompt.split("Question: ")[1]
    out = to_language_tasks(PROSE, 5, seed=0)
    assert [t["lang"] for t in out] == list(LANGUAGES)
    assert all(t["turns"][0].startswith(f"Translate the following English text into {t['lang']}:") for t in out)
    assert len({t["turns"][0] for t in math_tasks(16, seed=0)}) == 16
    assert all(t["topic"] in t["turns"][0] or "encyclopedia" not in t["turns"][0] for t in write_tasks(8, seed=0))
    assert set(OPENERS) == {"qa", "math_reasoning", "mt_bench"}


def _answered(rid, request, answer, **meta):
    return {
        "id": rid,
        **meta,
        "messages": [{"role": "user", "content": request}, {"role": "assistant", "content": answer}],
    }


def test_derived_tasks_translate_back_and_summarise_and_retrieve_over_the_targets_articles():
    english = "The museum opened a new hall of old maps and it was full of visitors from the whole region all day."
    german = (
        "Das Museum hat einen neuen Saal mit alten Karten eröffnet, und er war den ganzen Tag voller Besucher aus der "
        "ganzen Region."
    )
    copied = english + " " + english
    articles = [
        _answered(
            f"write-{i}", "Write a short news article.", f"Article {i}: " + " ".join(["news"] * 30), topic=f"t{i}"
        )
        for i in range(6)
    ]
    rows = [
        _answered("translation-out-0", f"Translate the following English text into German:\n\n{english}", german,
                  lang="German"),
        _answered("translation-out-1", f"Translate the following English text into French:\n\n{english}", copied,
                  lang="French"),
        _answered("translation-out-2", "Translate the following English text into Spanish:\n\nHi.", "Hola.",
                  lang="Spanish"),
        *articles,
    ]  # fmt: skip
    tasks = derived_tasks(rows, seed=0, rag_share=0.5)
    back = [t for t in tasks if t["kind"] == "translation"]
    # the copy of the English and the too-short answer give no task
    assert back == [
        {
            "id": "translation-in-0",
            "kind": "translation",
            "turns": [f"Translate the following German text into English:\n\n{german}"],
        }
    ]
    others = [t for t in tasks if t["kind"] != "translation"]
    assert len(others) == 6 and {t["kind"] for t in others} == {"summarization", "rag"}
    for t in others:
        parent = t["id"].split("-", 1)[1]
        text = next(r["messages"][1]["content"] for r in articles if r["id"] == parent)
        assert text in t["turns"][0]
        if t["kind"] == "rag":
            assert t["turns"][0].count("Document ") == 3 and f"t{parent.split('-')[1]}" in t["turns"][0]


def test_requests_that_share_a_run_of_words_with_an_evaluation_prompt_are_dropped():
    texts = evaluation_prompts()
    assert len(texts) >= 18  # every shipped Spec-Bench-style question and the chat held-out requests
    d = Disjoint(texts)
    copy = "Please help: " + " ".join(texts[0].split()[:10])
    assert not d.ok(copy) and d.dropped == 1
    assert d.ok("A completely new request about baking bread at home with children.")
    # the templates the families share with evaluation (7 words) are not a run of SHINGLE words
    assert d.ok("Summarize the following article in three sentences:\n\nOur town opened a new library.")
    rows = [json.loads(line) for line in open("eval/prompts/specbench_style.jsonl")]
    assert not d.ok(rows[5]["turns"][0])  # a whole evaluation question is caught too
