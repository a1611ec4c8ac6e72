"""German → English translation prompts over two more Debian manuals, for the target to answer.

Translation is the family whose served acceptance moved when the CPU stages read new text of it (the Debian
Reference's German, French and Spanish paragraphs, `train.data.debian_reference`; `docs/decisions.md`, "New material
from the Debian Reference moved translation only"), and the Spec-Bench translation task is German into English. Two
more manuals install from Debian's archive in German, as HTML: the Debian New Maintainers' Guide (``maint-guide-de``,
Josip Rodin, Osamu Aoki et al., GPL-2+) and the Debian FAQ (``debian-faq-de``, Susan G. Kleinmann, Sven Rudolph,
Santiago Vila, Josip Rodin, Javier Fernández-Sanguino et al., GPL-2+). Every prose paragraph (an HTML ``<p>``) of
`debian_reference.PARAGRAPH_WORDS` words is asked to be translated into English in a shape of
`debian_reference.TRANSLATE_SHAPES`.

    python -m train.data.debian_manuals --out outputs/debian-manuals/prompts.jsonl.gz
"""

from __future__ import annotations

import argparse
import random
from html.parser import HTMLParser
from pathlib import Path

from train.data.debian_reference import PARAGRAPH_WORDS, TRANSLATE_SHAPES, fetch, is_prose, package_files
from train.data.reshaped import prompt_row, write_prompts

MANUALS = {"maint-guide-de": ".de.html", "debian-faq-de": ".de.html"}
"""Package → the suffix of its German HTML pages."""


class _Paragraphs(HTMLParser):
    """The text of every ``<p>`` of a page, whitespace collapsed (markup inside a paragraph, e.g. ``<code>``, kept as
    its text)."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.parts: list[str] = []
        self.found: list[str] = []

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag == "p":
            self.depth += 1
            self.parts = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "p" and self.depth:
            self.depth -= 1
            self.found.append(" ".join("".join(self.parts).split()))

    def handle_data(self, data: str) -> None:
        if self.depth:
            self.parts.append(data)


def paragraphs(page: str) -> list[str]:
    """The prose paragraphs of an HTML page, in order."""
    parser = _Paragraphs()
    parser.feed(page)
    return [p for p in parser.found if p and is_prose(p)]


def build(manuals: dict[str, dict[str, list[str]]], seed: int = 0) -> list[dict]:
    """Translation prompts for every paragraph of ``PARAGRAPH_WORDS`` words (manual → page → paragraphs), shuffled
    (deterministic in ``seed``)."""
    rng = random.Random(seed)
    rows = []
    for manual, pages in manuals.items():
        for page, found in sorted(pages.items()):
            for k, text in enumerate(found):
                if PARAGRAPH_WORDS[0] <= len(text.split()) <= PARAGRAPH_WORDS[1]:
                    user = rng.choice(TRANSLATE_SHAPES).format(language="German", text=text)
                    rows.append(prompt_row("translation", f"{manual}/de", f"{manual}-{Path(page).stem}-{k}", user))
    rng.shuffle(rows)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output .jsonl.gz of prompts")
    ap.add_argument("--download-dir", type=Path, default=Path("outputs/debian-manuals/sources"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    manuals = {}
    for name, suffix in MANUALS.items():
        pages = package_files(fetch(name, args.download_dir), suffix)
        manuals[name] = {path: paragraphs(raw.decode("utf-8", errors="replace")) for path, raw in pages.items()}
        if not any(manuals[name].values()):
            raise SystemExit(f"{name}: no prose paragraphs in its {suffix} pages: has the layout changed?")
    write_prompts(build(manuals, args.seed), args.out)


if __name__ == "__main__":
    main()
