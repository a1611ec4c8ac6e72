"""The prompts over the gensim and inspect-evals wheels' documents (train/data/wheel_documents.py): wikitext read as
plain prose per section, the news corpus's stories, and the prompts built from them."""

import json

from eval.prompts import load_prompt_file
from tests.conftest import ROOT
from train.data import wheel_documents as wd
from train.data.text_tier import EVAL_RAG, EVAL_SUMMARIZE

PROSE = " ".join(["Prose"] + ["word"] * 130) + "."
DUMP = f"""<mediawiki>
<page><title>Anarchism &amp; order</title><ns>0</ns><revision><text xml:space="preserve">{{{{Infobox |name={{{{nested}}}}}}}}
'''Anarchism''' is a [[political philosophy|philosophy]] that [[state (polity)|rejects]] rulers.&lt;ref&gt;A book,
p. 3&lt;/ref&gt; It has a&amp;nbsp;[[history]] &amp;mdash; a long one.
[[File:Flag.svg|thumb|A [[flag]] in black]]
{{| class="wikitable"
| a table || that goes
|}}
* a list item
== History ==
{PROSE}
== See also ==
{PROSE}
</text></revision></page>
<page><title>AccessibleComputing</title><ns>0</ns><revision><text>#REDIRECT [[Computer accessibility]]</text>
</revision></page>
<page><title>Talk:Anarchism</title><ns>1</ns><revision><text>{PROSE}</text></revision></page>
</mediawiki>"""


def test_wikitext_is_read_as_plain_prose_per_section():
    sections = wd.wiki_sections(DUMP)
    # the redirect, the talk page and the "See also" section are skipped; lists, tables and files leave nothing
    # XML's escapes and the wikitext's own entities (&nbsp;, &mdash;) are read as the characters they name
    assert [(a, s) for a, s, _ in sections] == [("Anarchism & order", "overview"), ("Anarchism & order", "History")]
    lead = sections[0][2]
    assert lead == "Anarchism is a philosophy that rejects rulers. It has a history \u2014 a long one."
    assert sections[1][2] == PROSE


def test_prompts_per_source_and_none_in_an_evaluation_wording():
    story = " ".join(["news"] * 60) + "."
    wiki = [("Anarchism", "overview", PROSE), ("Anarchism", "History", PROSE), ("Anarchism", "Short", "Too short.")]
    bank = [
        {"id": f"doc_{i}", "title": f"Internal: Opening Account {i}", "content": f"Step {i}. " * 40} for i in range(7)
    ]
    rows = wd.build([story], wiki, bank, seed=3)
    kinds = sorted((r["family"], r["source"]) for r in rows)
    # a story twice, two long sections twice each (the short one not at all), 7 documents and 2 groups of 3 (80 words
    # each: under the group's limit)
    assert kinds == sorted(
        [("summarization", "gensim/lee-news")] * 2
        + [("summarization", "gensim/enwiki"), ("rag", "gensim/enwiki")] * 2
        + [("rag", "inspect-evals/banking")] * (7 + 2)
    )
    assert len({r["id"] for r in rows}) == len(rows) and rows == wd.build([story], wiki, bank, seed=3)
    news = [r["messages"][0]["content"] for r in rows if r["source"] == "gensim/lee-news"]
    assert all(story in text for text in news) and news[0] != news[1]  # two shapes of the same story
    grouped = [r["messages"][0]["content"] for r in rows if r["id"].startswith("retrieved-")]
    assert all(text.count("Internal: Opening Account") == 3 and "[3]" in text for text in grouped)
    asked = next(r["messages"][0]["content"] for r in rows if r["id"] == "doc_0-q")
    assert "opening Account 0" in asked  # the title without its "Internal:" prefix, as a question's object
    assert all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user" for r in rows)
    # no shape opens with an evaluation prompt's instruction (the text tier's, nor the shipped evaluation files')
    heads = {w.split("{")[0].strip() for w in (EVAL_SUMMARIZE, EVAL_RAG)}
    for path in sorted((ROOT / "eval" / "prompts").glob("*.jsonl")):
        heads |= {
            p.turns[0].split("\n")[0].strip() for p in load_prompt_file(path) if p.category in ("summarization", "rag")
        }
    for shape in wd.SUMMARY_SHAPES + wd.QUESTION_SHAPES + wd.RETRIEVED_SHAPES:
        assert not any(head and head in shape for head in heads), shape


def test_a_wheel_already_downloaded_is_used(tmp_path, monkeypatch):
    wheel = tmp_path / f"gensim-{wd.WHEELS['gensim']}-cp311-cp311-linux_x86_64.whl"
    wheel.write_bytes(b"")
    monkeypatch.setattr(wd.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("fetched")))
    assert wd.fetch("gensim", tmp_path) == wheel


def test_news_stories_are_the_corpus_lines_long_enough_to_summarise():
    raw = "\n".join([" ".join(["a"] * 50), "", "too short", json.dumps("x")])
    assert wd.news_stories(raw) == [" ".join(["a"] * 50)]
