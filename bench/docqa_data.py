"""Document-QA data for bench/docqa.py: questions, source texts, excerpts and scoring (pure, no model).

Questions live in bench/docqa_questions.json: each names a document (a source text and where
its excerpt sits), the exact passage it is about, the question, the accepted answers and the
kind of value the answer is. An excerpt is a window of the source text of a target length in
tokens that contains every passage of its document's questions, the first one at the
document's depth; a planted document instead inserts its (fictional) facts into a haystack
excerpt at each fact's depth.

Scoring is by exact answer substrings: case-insensitive, whitespace and quote marks
normalised, matched at word boundaries (so "1" does not match inside "15"). A wrong answer
is *hallucinated* when it states a value of the expected kind (a year, number, name or
place) that is not an accepted answer; a wrong answer without one (a refusal, "the document
does not say") is not.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

QUESTIONS_FILE = Path(__file__).resolve().parent / "docqa_questions.json"
PYDOC_ROOTS = (Path("/usr/share/doc/python3-doc/html"), *sorted(Path("/usr/share/doc").glob("python3.*-doc/html")))
PYDOC_HINT = "install Python's HTML documentation with `apt-get install -y python3-doc`"
KINDS_WITH_VALUES = ("year", "number", "name", "place")  # kinds whose wrong values are detected
_CHARS_PER_TOKEN = 8  # generous: the character window tokenised around a passage is this x the length


class SourceMissing(LookupError):
    """A source text's package is not installed (its questions are skipped, with this message)."""


@dataclass(frozen=True)
class Question:
    id: str
    document: str
    passage: str  # exact, unique substring of the source text (or a planted sentence)
    question: str
    answers: tuple[str, ...]
    kind: str  # year | number | name | place | thing
    quick: bool = False
    # Other values of the passage (e.g. the schools that did not accept him): a reply naming one
    # is not counted correct even if it also names the answer (listing every candidate is no answer).
    distractors: tuple[str, ...] = ()


@dataclass(frozen=True)
class DocumentSpec:
    id: str
    kind: str  # essay | play | scripture | technical | planted
    source: dict  # {"type": essays | play | kjv | pydoc, ...}
    depth: float = 0.5  # where the first passage (planted: the haystack anchor) sits
    haystack_anchor: str | None = None  # planted only
    facts: tuple[tuple[str, float], ...] = ()  # planted only: (sentence, depth)


@dataclass(frozen=True)
class Excerpt:
    """A document as fed to the model: its text, length in tokens and each passage's depth."""

    text: str
    n_tokens: int
    depths: dict  # passage -> fraction of the excerpt (in tokens, or characters when planted) before it
    truncated: bool = False  # the source is shorter than the target length


def load_questions(path: Path = QUESTIONS_FILE) -> tuple[dict[str, DocumentSpec], list[Question]]:
    data = json.loads(Path(path).read_text())
    documents = {
        d["id"]: DocumentSpec(d["id"], d["kind"], d["source"], d.get("depth", 0.5), d.get("haystack_anchor"),
                              tuple((f["sentence"], f["depth"]) for f in d.get("facts", ())))
        for d in data["documents"]
    }
    questions = [Question(q["id"], q["document"], q["passage"], q["question"], tuple(q["answers"]), q["kind"],
                          bool(q.get("quick", False)), tuple(q.get("distractors", ()))) for q in data["questions"]]
    for q in questions:
        if q.document not in documents:
            raise ValueError(f"question {q.id!r} names an unknown document {q.document!r} in {path}")
    return documents, questions


# ----------------------------------------------------------------------------- scoring


def normalise(text: str) -> str:
    """Lower case, curly quotes and dashes made plain, runs of whitespace made one space."""
    text = text.translate(str.maketrans({"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"',
                                         "\u2013": "-", "\u2014": "-", "\u2212": "-"}))
    return " ".join(text.lower().split())


def contains(text: str, phrase: str) -> bool:
    """`phrase` occurs in `text` (both normalised), not inside a longer word or number."""
    pattern = r"(?<![\w])" + re.escape(normalise(phrase)) + r"(?![\w]|\.\d)"
    return re.search(pattern, normalise(text)) is not None


def correct(reply: str, answers: tuple[str, ...], distractors: tuple[str, ...] = ()) -> bool:
    """An accepted answer is in the reply and none of the distractors is."""
    return any(contains(reply, a) for a in answers) and not any(contains(reply, d) for d in distractors)


_NUMBER_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
                 "sixteen seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety "
                 "hundred thousand million dozen").split()
_NOT_NAMES = set(("i the a an it he she they we you this that these those there here in on at of to and or but "
                  "yes no not according based sorry however answer document text passage question "
                  "unfortunately as from by for with is was").split())


def values_of_kind(text: str, kind: str, ignore: str = "") -> list[str]:
    """Values of `kind` stated in `text`: years and numbers as digits or number words; names and
    places as capitalised words, except common words and words of `ignore` (the question)."""
    if kind == "year":
        return re.findall(r"\b(?:1[0-9]{3}|20[0-9]{2})\b", text)
    if kind == "number":
        words = r"\b(?:" + "|".join(_NUMBER_WORDS) + r")\b"
        return re.findall(r"\d[\d,.]*", text) + re.findall(words, text.lower())
    if kind in ("name", "place"):
        asked = {_bare(w) for w in re.findall(r"[A-Za-z][\w'-]*", ignore)}
        words = [_bare(w) for w in re.findall(r"\b[A-Z][\w'-]*", normalise_quotes(text))]
        return [w for w in words if w not in _NOT_NAMES and w not in asked]
    return []


def normalise_quotes(text: str) -> str:
    return text.replace("\u2019", "'").replace("\u2018", "'")


def _bare(word: str) -> str:
    """A word without a possessive ending, lower case ("Naomi's" -> "naomi"), for the name check."""
    word = word.lower()
    return word[:-2] if word.endswith("'s") else word


def hallucinated(reply: str, question: Question) -> bool:
    """A wrong reply that states a value of the question's kind (not a refusal)."""
    if question.kind not in KINDS_WITH_VALUES or correct(reply, question.answers, question.distractors):
        return False
    return any(contains(reply, d) for d in question.distractors) or bool(
        values_of_kind(reply, question.kind, ignore=question.question))


# ----------------------------------------------------------------------------- source texts


class _MainText(HTMLParser):
    """Text of a Sphinx page's main body (`<div role="main">`), blocks on their own lines."""

    _BLOCKS = {"p", "div", "li", "dt", "dd", "h1", "h2", "h3", "h4", "pre", "tr", "br", "table"}

    def __init__(self):
        super().__init__()
        self.parts: list[str] = []
        self.depth = 0  # nesting inside the main div (0: outside)
        self.skip = 0  # inside script / style

    def handle_starttag(self, tag, attrs):
        if self.depth:
            self.depth += tag not in ("br", "img", "hr", "meta", "link", "input")
        elif tag == "div" and dict(attrs).get("role") == "main":
            self.depth = 1
        self.skip += tag in ("script", "style")
        if self.depth and tag in self._BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if self.depth and tag not in ("br", "img", "hr", "meta", "link", "input"):
            self.depth -= 1
        self.skip -= tag in ("script", "style")

    def handle_data(self, data):
        if self.depth and not self.skip:
            self.parts.append(data)


def html_to_text(html: str) -> str:
    parser = _MainText()
    parser.feed(html)
    return re.sub(r"\n\s*\n+", "\n\n", "".join(parser.parts)).strip()


def pydoc_root() -> Path:
    for root in PYDOC_ROOTS:
        if (root / "library").is_dir():
            return root
    raise SourceMissing(f"Python's HTML documentation is not installed; {PYDOC_HINT}")


@functools.lru_cache(maxsize=16)
def _source_text(kind: str, key: str) -> str:
    from spotlight import corpus
    from spotlight.errors import CorpusEmpty

    try:
        if kind == "essays":  # all essays in file order: an excerpt may run into the next essay
            return "\n\n".join(d.text.strip() for d in corpus.essays())
        if kind == "play":
            return (corpus.package_dir("shksprdata") / "texts" / key).read_text(encoding="utf-8", errors="replace")
        if kind == "kjv":
            return "\n\n".join(d.text for d in corpus.kjv())
    except CorpusEmpty as error:
        raise SourceMissing(str(error)) from error
    if kind == "pydoc":
        root = pydoc_root()
        return "\n\n".join(html_to_text((root / name).read_text(encoding="utf-8")) for name in key.split("|"))
    raise ValueError(f"unknown source type {kind!r}: use essays, play, kjv or pydoc")


def source_text(spec: DocumentSpec) -> str:
    """The whole text a document's excerpt is cut from. Raises SourceMissing when not installed."""
    source = spec.source
    return _source_text(source["type"], source.get("file") or "|".join(source.get("files", ())))


# ----------------------------------------------------------------------------- excerpts


def find_passage(text: str, passage: str) -> int:
    """Character offset of `passage`, which must occur exactly once in `text`."""
    count = text.count(passage)
    if count != 1:
        raise ValueError(f"passage {passage[:60]!r} occurs {count} times in its source; make it exact and unique")
    return text.index(passage)


def excerpt(text: str, passages: list[str], length: int, depth: float, encode, decode) -> Excerpt:
    """`length` tokens of `text` containing every passage, the first one `depth` of the way in.

    `encode(str) -> list[int]` and `decode(list[int]) -> str` are one tokenizer's. The text is
    cut at token boundaries around the passages' region, which is kept verbatim."""
    starts = [find_passage(text, p) for p in passages]
    lo, hi = min(starts), max(s + len(p) for s, p in zip(starts, passages))
    margin = length * _CHARS_PER_TOKEN
    before_text, region, after_text = text[max(0, lo - margin):lo], text[lo:hi], text[hi:hi + margin]
    before, middle, after = encode(before_text), encode(region), encode(after_text)
    if len(middle) > length:
        raise ValueError(f"the passages span {len(middle)} tokens, more than the excerpt's {length}; "
                         f"split the document's questions or use a longer length")
    room = length - len(middle)
    n_before = min(len(before), max(round(depth * length), room - len(after)), room)
    n_after = min(len(after), room - n_before)
    head = decode(before[len(before) - n_before:]).lstrip("\ufffd") if n_before else ""
    tail = decode(after[:n_after]).rstrip("\ufffd") if n_after else ""
    body = head + region + tail
    n_tokens = n_before + len(middle) + n_after
    depths = {p: (n_before + len(encode(region[:s - lo]))) / n_tokens for p, s in zip(passages, starts)}
    return Excerpt(body, n_tokens, depths, truncated=n_tokens < length)


def planted(text: str, anchor: str, facts: tuple[tuple[str, float], ...], length: int, encode, decode) -> Excerpt:
    """A haystack excerpt starting at `anchor` with each (sentence, depth) fact inserted at the
    first sentence end at or after that fraction of its characters."""
    fact_tokens = sum(len(encode(" " + sentence)) for sentence, _ in facts)
    hay = excerpt(text, [anchor], length - fact_tokens, 0.0, encode, decode).text
    cuts = sorted((_sentence_end(hay, int(depth * len(hay))), sentence) for sentence, depth in facts)
    pieces, depths, previous = [], {}, 0
    for cut, sentence in cuts:
        pieces.append(hay[previous:cut])
        depths[sentence] = sum(len(piece) for piece in pieces) + 1  # characters before it
        pieces.append(" " + sentence + " ")
        previous = cut
    pieces.append(hay[previous:])
    body = "".join(pieces)
    return Excerpt(body, len(encode(body)), {s: c / len(body) for s, c in depths.items()})


def _sentence_end(text: str, at: int) -> int:
    """Offset just after the first '. ', '.\\n' or blank line at or after `at` (else `at`)."""
    match = re.compile(r"[.!?]['\")\]]?(?=\s)|\n\n").search(text, at)
    return match.end() if match else at


def document_excerpt(spec: DocumentSpec, questions: list[Question], length: int, encode, decode) -> Excerpt:
    """The excerpt fed to the model for `spec` at `length` tokens (questions: those about it)."""
    text = source_text(spec)
    if spec.kind == "planted":
        return planted(text, spec.haystack_anchor, spec.facts, length, encode, decode)
    passages = [q.passage for q in questions]
    ordered = sorted(passages, key=lambda p: find_passage(text, p))
    return excerpt(text, ordered, length, spec.depth, encode, decode)
