"""The writing requests and questions from the inspect-evals wheel (train/data/wheel_requests.py): English requests
within the length limit, FreshQA's distinct questions across its releases, and the prompts made of them."""

import json

import pytest

from train.data import wheel_requests as wr

HEADER = "id,split,question,effective_year,next_review,false_premise,answer_0,note"
TABLE_A = f""""Warning: do not click thumbs up/down on these examples.",,,,,,,
,,,,,,,
{HEADER}
0,TEST,What is the name of the first animal to land on the moon?,before 2022,never,TRUE,none,
1,TEST,"Who wrote ""Dune"", the novel?",before 2022,never,FALSE,Frank Herbert,
2,DEV,,before 2022,never,FALSE,,
"""
TABLE_B = f"""warning,,,,,,,
{HEADER}
7,TEST,what is the name of the first  animal to land on the moon?,before 2022,never,TRUE,none,
8,DEV,How many moons does Mars have?,before 2022,never,FALSE,two,
"""


def test_freshqa_questions_are_distinct_across_releases_and_read_through_csv_quoting():
    assert wr.fresh_questions([TABLE_A, TABLE_B]) == [
        "What is the name of the first animal to land on the moon?",
        'Who wrote "Dune", the novel?',
        "How many moons does Mars have?",
    ]
    with pytest.raises(ValueError, match="header"):
        wr.fresh_questions(["no header here\n1,2,3"])


def test_writing_requests_keep_english_within_the_word_limit():
    rows = [
        {"index": 1, "domain1": "Education", "query": "Write a lesson plan about volcanoes for ten-year-olds."},
        {"index": 2, "domain1": "Education", "query": "请帮我写一份关于火山的教案，面向十岁的学生。"},
        {"index": 3, "domain1": "Finance", "query": " ".join(["word"] * (wr.WRITING_WORDS + 1))},
        {"index": 4, "domain1": "Finance", "query": "Draft a memo (see the table: 收入 up 5 %) " + "text " * 60},
    ]
    raw = "\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n"
    # a Chinese request and one past the limit are left; a few Chinese characters in English text are not Chinese
    assert [r["index"] for r in wr.writing_requests(raw)] == [1, 4]


def test_prompts_are_the_requests_as_written_one_each_in_their_families():
    writing = [{"index": 5, "query": "Write a product description for a kettle."}]
    questions = ["Who is the mayor of Paris?", "How tall is Mount Fuji?"]
    rows = wr.build(writing, questions, seed=1)
    assert sorted((r["family"], r["source"], r["messages"][0]["content"]) for r in rows) == [
        ("mt_bench", "inspect-evals/writingbench", "Write a product description for a kettle."),
        ("qa", "inspect-evals/freshqa", "How tall is Mount Fuji?"),
        ("qa", "inspect-evals/freshqa", "Who is the mayor of Paris?"),
    ]
    assert len({r["id"] for r in rows}) == 3 and rows == wr.build(writing, questions, seed=1)
    assert all(r["messages"][0]["role"] == "user" and len(r["messages"]) == 1 for r in rows)
