"""The Debian Reference prompts (train/data/debian_reference.py): the text edition's layout read into sections and
prose paragraphs, and the prompts built from them; the German HTML manuals' paragraphs (train/data/debian_manuals.py)."""

import pytest

from train.data import debian_manuals as dm
from train.data import debian_reference as dr
from train.data.text_tier import EVAL_RAG, EVAL_SUMMARIZE, EVAL_TRANSLATE

PROSE = "This paragraph explains how the shell finds a command in the directories named by the search path variable."
EDITION = "\n".join(
    [
        "Debian Reference",
        "",
        "        1.1. Console basics",  # the contents: indented deeper, not a heading
        "",
        "Chapter 1. GNU/Linux tutorials",
        "",
        "    I think learning a computer system is like learning a new foreign",
        "    language. Although tutorial books and documentation are helpful,",
        "\xa0 \xa0 you have to practice it yourself.",  # a line indented with no-break spaces
        "",
        "1.1.\xa0Console basics",
        "",
        "    " + PROSE.partition(" in the")[0],  # one paragraph wrapped over two lines
        "    in the" + PROSE.partition(" in the")[2],
        "",
        "    $ ls -l /usr/bin",  # a command listing
        "    total 12",
        "",
        "    Tip",  # a label: too short, and no sentence end
        "",
        "       | table | row |",
        "",
        "1.2.\xa0Root login",
        "",
        "    " + PROSE,
    ]
)


def test_sections_and_their_prose_paragraphs():
    found = dr.sections(EDITION)
    assert [title for title, _ in found] == [
        "Debian Reference",
        "Chapter 1. GNU/Linux tutorials",
        "Console basics",
        "Root login",
    ]
    assert found[0][1] == []
    assert found[1][1] == [
        "I think learning a computer system is like learning a new foreign language. Although tutorial books and "
        "documentation are helpful, you have to practice it yourself."
    ]
    assert found[2][1] == [PROSE]  # the listing, the label and the table are left out
    assert found[3][1] == [PROSE]


def test_prose_test():
    assert dr.is_prose(PROSE)
    assert not dr.is_prose("$ sudo apt-get update\n$ sudo apt-get upgrade.")
    assert not dr.is_prose("Tip")
    assert not dr.is_prose("/etc/apt/sources.list /etc/apt/sources.list.d/*.list 1.2.3.")


def test_prompts_per_family_and_none_in_an_evaluation_wording():
    words = " ".join(["word"] * 40) + "."
    section = " ".join(["text"] * 150) + "."
    editions = {
        "en": [("Package management", [section]), ("Too short", [words])],
        "de": [("Paketverwaltung", [words, "Zu kurz."])],
        "fr": [("Gestion des paquets", [words])],
    }
    rows = dr.build(editions, seed=3)
    assert sorted((r["family"], r["source"]) for r in rows) == [
        ("rag", "debian-reference/en"),
        ("summarization", "debian-reference/en"),
        ("translation", "debian-reference/de"),
        ("translation", "debian-reference/fr"),
    ]
    assert len({r["id"] for r in rows}) == len(rows)
    assert rows == dr.build(editions, seed=3)  # deterministic in the seed
    by_family = {r["family"]: r["messages"][0]["content"] for r in rows if r["source"] != "debian-reference/fr"}
    assert words in by_family["translation"] and "German" in by_family["translation"]
    assert section in by_family["summarization"] and section in by_family["rag"]
    assert all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user" for r in rows)
    evaluation_heads = [w.split("{")[0].strip() for w in (EVAL_TRANSLATE, EVAL_SUMMARIZE, EVAL_RAG)]
    for shape in dr.TRANSLATE_SHAPES + dr.SUMMARY_SHAPES + dr.QUESTION_SHAPES:
        assert not any(head and head in shape for head in evaluation_heads), shape


def test_the_newest_package_already_downloaded_is_used_and_none_is_fetched_without_apt(tmp_path, monkeypatch):
    monkeypatch.setattr(dr.shutil, "which", lambda name: None)  # no apt-get: nothing may be fetched
    with pytest.raises(SystemExit, match="no .deb in .* and no apt-get"):
        dr.fetch("debian-reference-de", tmp_path)
    for version in ("2.99", "2.100", "2.9"):
        (tmp_path / f"debian-reference-de_{version}_all.deb").write_bytes(b"")
    assert (
        dr.fetch("debian-reference-de", tmp_path).name == "debian-reference-de_2.100_all.deb"
    )  # by version, not by name


PAGE = """<html><body><h1>Kapitel 1</h1>
<p>Dieses Dokument beschreibt, wie ein Paket für Debian gebaut wird, und zwar Schritt für Schritt mit
   <code>dpkg-buildpackage</code> und den Werkzeugen, die dazu gehören, so dass auch Neulinge folgen können.</p>
<pre>$ dpkg-buildpackage -us -uc</pre>
<p>Hinweis</p>
<div><p>Ein zweiter Absatz, der ebenfalls lang genug ist, um übersetzt zu werden, denn er hat mehr als
fünfundzwanzig Wörter und endet mit einem Punkt, wie es sich für einen Absatz gehört.</p></div>
</body></html>"""


def test_html_manuals_give_their_prose_paragraphs_to_translate():
    found = dm.paragraphs(PAGE)
    assert found == [
        "Dieses Dokument beschreibt, wie ein Paket für Debian gebaut wird, und zwar Schritt für Schritt mit "
        "dpkg-buildpackage und den Werkzeugen, die dazu gehören, so dass auch Neulinge folgen können.",
        "Ein zweiter Absatz, der ebenfalls lang genug ist, um übersetzt zu werden, denn er hat mehr als "
        "fünfundzwanzig Wörter und endet mit einem Punkt, wie es sich für einen Absatz gehört.",
    ]  # markup inside a paragraph kept as its text; the listing and the one-word label left out
    rows = dm.build({"maint-guide-de": {"usr/share/doc/x/build.de.html": found + ["Zu kurz."]}}, seed=1)
    assert [r["id"] for r in sorted(rows, key=lambda r: r["id"])] == [
        "maint-guide-de-build.de-0",
        "maint-guide-de-build.de-1",
    ]
    assert all(r["family"] == "translation" and "German" in r["messages"][0]["content"] for r in rows)
    assert rows == dm.build({"maint-guide-de": {"usr/share/doc/x/build.de.html": found + ["Zu kurz."]}}, seed=1)
