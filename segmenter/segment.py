"""Semantic segmentation: a `Document` -> `Segment`s that tile its text exactly.

Structure first, then topic, always within a token bound:

 1. Units. The text is cut at heading and page starts into sections: a heading line, then a body. A body
    that fits `max_tokens` is one unit; a longer body is split into paragraphs and sentences, and
    a single sentence longer than `max_tokens` into line / word / character chunks (flagged).
    Every unit keeps its trailing whitespace, so units tile the text.
 2. Cut costs. Each unit start is a candidate boundary with a cost: negative at a heading or a
    page start (cut there unless a piece would get too short), low at a paragraph break, higher between
    sentences, lower where the sentence windows on either side are dissimilar (a topic shift:
    embeddings when `embed` is given, TF-IDF cosine otherwise), prohibitive inside a sentence or
    between a heading and its body.
 3. Dynamic programming picks the cuts of least total cost such that every piece has at most
    `max_tokens` (by the sum of unit counts); pieces under `min_tokens` pay a penalty.
 4. Each piece is counted again as a whole; token counts are not exactly additive, so a piece
    over the bound is split again at its cheapest boundary.

Deterministic: no randomness, ties go to the later cut, dict order is insertion order.
"""
from __future__ import annotations

import bisect
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from segmenter.readers import Document, Heading

CountTokens = Callable[[str], int]
Embed = Callable[[list[str]], np.ndarray]

DEFAULT_MAX_TOKENS = 512  # one segment = one cached span with its own code table: a few paragraphs
DEFAULT_MIN_TOKENS = 64  # below this, per-span bookkeeping outweighs the text it holds
QUOTE_CHARS = 200  # a source quote in the UI: two or three sentences
HEADING_PATH_SEPARATOR = " › "

# Cut costs (dimensionless; only their order and differences matter).
HEADING_CUT_COST = -2.0  # negative: a heading is always a boundary unless a piece would be too short
HEADING_LEVEL_STEP = 0.1  # deeper headings cost a little more, so a chapter break beats a section break
# A page start is a boundary too (a PDF source then names the page its passage is on), a little
# weaker than any heading, so a heading further down the page still wins within the bound.
PAGE_CUT_COST = -1.0
PARAGRAPH_CUT_COST = 0.5
SENTENCE_CUT_COST = 1.0
VALLEY_BONUS = 0.3  # a significant similarity valley: prefer it, but a paragraph break still wins
DISSIMILARITY_WEIGHT = 0.1  # times tanh(z): among equal breaks, the less similar one wins
MID_SENTENCE_CUT_COST = 20.0  # only chunks of an over-long sentence have such boundaries
CHUNKS_PER_SEGMENT = 4  # an over-long sentence is chunked finer than max_tokens, for packing freedom
AFTER_HEADING_CUT_COST = 20.0  # never leave a heading line alone at the end of a segment
# A piece under min_tokens pays SHORT_PIECE_PENALTY * (1 - tokens / min_tokens): a section under
# about half of min_tokens joins a neighbour across its heading, a larger one keeps its own segment.
SHORT_PIECE_PENALTY = 4.0
ORPHAN_HEADING_PENALTY = 20.0  # a piece that ends with a heading line

# Topic shifts (TextTiling-style).
TOPIC_WINDOW = 3  # sentences on each side of a boundary
VALLEY_Z = 0.5  # a valley is a local minimum below mean - VALLEY_Z * std (TextTiling's cutoff)
MIN_TERM_CHARS = 3
STOPWORDS = frozenset(
    "the and for are but not you all any can had her was one our out has have him his how its may "
    "new now old see two way who did get let say she too use that with this from they will would "
    "there their what about which when make like than then them these some into could other more "
    "also been were said each just only over such very your most must where while because through "
    "being after before should does those both under between same well".split()
)

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n\s*")
_SENTENCE_END = re.compile(
    r"[.!?…]+[\"'”’»)\]]*\s+"  # full stop, optional closing quote/bracket, whitespace
    r"|[。！？]+[」』”’)\]]*\s*"  # CJK full stops need no space
    r"|\n(?=[ \t]*(?:[-*+•]|\d{1,3}[.)])[ \t])"  # a new list item
    r"|\n(?=[^\n]* \| )"  # a table row (markdown, or a docx table from the reader)
)
_WORD_BEFORE = re.compile(r"\w[\w.]*$")
MAX_WORD_LOOKBACK = 32  # characters searched back for the word before a full stop
_OPENERS = "\"'“‘«([¿¡"
ABBREVIATIONS = frozenset(
    "e.g i.e etc vs cf al mr mrs ms dr prof st jr sr no nos fig figs eq eqs approx inc ltd co dept "
    "vol p pp ch sec resp".split()
)
_WHITESPACE_RUN = re.compile(r"\s*")
_LINE_CUT = re.compile(r"\n\s*")
_WORD_CUT = re.compile(r"\s+")
_TERM = re.compile(r"[^\W\d_]+")


@dataclass(frozen=True, slots=True)
class Segment:
    """A contiguous piece of `Document.text`: text == doc.text[char_start:char_end].

    `page` is the page of its first character (None without pages); `heading_path` joins the
    enclosing headings at its first body character ("Chapter 2 › Section 2.1"), None outside any
    heading. `body_start` is where text after its leading heading lines begins. `split_sentence`
    is True when a boundary of this segment falls inside a sentence, which happens only when one
    sentence is longer than max_tokens.
    """

    ordinal: int
    char_start: int
    char_end: int
    text: str
    n_tokens: int
    page: int | None
    heading_path: str | None
    body_start: int
    split_sentence: bool = False

    def quote(self, max_chars: int = QUOTE_CHARS) -> str:
        """The segment's opening body text, whitespace collapsed, cut at a sentence end within
        `max_chars` (else at a word boundary, with "…"). For source chips in the UI."""
        body = self.text[self.body_start - self.char_start:]
        body = body if body.strip() else self.text
        collapsed = " ".join(body.split())
        if len(collapsed) <= max_chars:
            return collapsed
        ends = [" ".join(body[:end].split()) for end in sentence_ends(body, 0, len(body))]
        fitting = [prefix for prefix in ends if len(prefix) <= max_chars]
        if fitting:
            return fitting[-1]
        cut = collapsed.rfind(" ", 0, max_chars)
        return collapsed[: cut if cut > 0 else max_chars].rstrip() + "…"


@dataclass(slots=True)
class _Unit:
    """Smallest piece the planner moves; `cost` is the price of a boundary at its start."""

    start: int
    end: int
    tokens: int
    cost: float
    heading: bool = False  # the unit is a heading line
    broken: bool = False  # its start falls inside a sentence


def segment(doc: Document, count_tokens: CountTokens, *, max_tokens: int = DEFAULT_MAX_TOKENS,
            min_tokens: int = DEFAULT_MIN_TOKENS, embed: Embed | None = None) -> list[Segment]:
    """Cut `doc.text` into segments that tile it exactly, in order, ordinals 0..n-1.

    Every segment has at most `max_tokens` tokens by `count_tokens` (a single character that alone
    exceeds it is the only exception) and ends at a sentence end unless `split_sentence` is set.
    `embed(texts) -> (len(texts), d)` array, if given, is called once per section body longer than
    `max_tokens` with its sentences; without it a lexical similarity is used. An empty text gives [].
    """
    if max_tokens < 1 or not 0 <= min_tokens <= max_tokens:
        raise ValueError("need 1 <= max_tokens and 0 <= min_tokens <= max_tokens, "
                         f"got max_tokens={max_tokens}, min_tokens={min_tokens}")
    if not doc.text:
        return []
    units = _units(doc, count_tokens, max_tokens, embed)
    starts = _plan(units, max_tokens, min_tokens)
    pieces = _enforce_limit(doc.text, units, starts, count_tokens, max_tokens)
    return _segments(doc, units, pieces)


# ---------------------------------------------------------------------------------------------
# 1. Units


def _units(doc: Document, count: CountTokens, max_tokens: int, embed: Embed | None) -> list[_Unit]:
    """Units of the whole text, section by section (a section starts at a heading or a page start)."""
    text = doc.text
    level_at: dict[int, int] = {}
    for heading in doc.headings:
        if heading.char_start < len(text):
            level_at[heading.char_start] = min(heading.level, level_at.get(heading.char_start, heading.level))
    page_starts = {page.char_start for page in doc.pages if 0 < page.char_start < len(text)}
    bounds = sorted({0, *level_at, *page_starts}) + [len(text)]
    units: list[_Unit] = []
    for start, end in zip(bounds, bounds[1:]):
        level = level_at.get(start)
        cut_cost = PAGE_CUT_COST if start in page_starts else PARAGRAPH_CUT_COST
        if level is not None:
            cut_cost = HEADING_CUT_COST + HEADING_LEVEL_STEP * level
        body_start, heading_tokens = start, 0
        if level is not None:
            body_start = _heading_line_end(text, start, end)
            heading_tokens = count(text[start:body_start])
        if heading_tokens > max_tokens:  # a "heading" this long is a styled paragraph: treat it as body
            body_start, heading_tokens = start, 0
        elif level is not None:
            units.append(_Unit(start, body_start, heading_tokens, cut_cost, heading=True))
            cut_cost = AFTER_HEADING_CUT_COST
        if body_start < end:
            units += _body_units(text, body_start, end, count, max_tokens - heading_tokens, cut_cost, embed,
                                 max_tokens)
    return units


def _heading_line_end(text: str, start: int, end: int) -> int:
    """End of the heading line at `start`, including the whitespace after it, within `end`."""
    newline = text.find("\n", start, end)
    line_end = end if newline < 0 else newline
    return _WHITESPACE_RUN.match(text, line_end, end).end()


def _body_units(text: str, start: int, end: int, count: CountTokens, room: int, first_cost: float,
                embed: Embed | None, max_tokens: int) -> list[_Unit]:
    """One unit if the body fits in `room` (max_tokens less its heading line); else sentence
    units (chunks for sentences over max_tokens), with topic-shift costs."""
    tokens = count(text[start:end])
    if tokens <= room:
        return [_Unit(start, end, tokens, first_cost)]
    units = []
    for paragraph_start, paragraph_end in paragraphs(text, start, end):
        cost = PARAGRAPH_CUT_COST
        for sentence_start, sentence_end in sentences(text, paragraph_start, paragraph_end):
            units += _sentence_units(text, sentence_start, sentence_end, count, max_tokens, cost)
            cost = SENTENCE_CUT_COST
    units[0].cost = first_cost
    _mark_topic_shifts(units, [text[unit.start:unit.end] for unit in units], embed)
    return units


def _sentence_units(text: str, start: int, end: int, count: CountTokens, max_tokens: int,
                    cost: float) -> list[_Unit]:
    """The sentence as one unit or, when it alone exceeds max_tokens, as flagged chunks of at
    most max_tokens / CHUNKS_PER_SEGMENT tokens, so the planner can still balance pieces."""
    tokens = count(text[start:end])
    if tokens <= max_tokens:
        return [_Unit(start, end, tokens, cost)]
    chunk_tokens = max(1, max_tokens // CHUNKS_PER_SEGMENT)
    cut_lists = [_cut_positions(pattern, text, start, end) for pattern in (_LINE_CUT, _WORD_CUT)]
    units: list[_Unit] = []
    while start < end:
        stop = _fitting_prefix_end(text, start, end, count, chunk_tokens, cut_lists)
        chunk_cost = MID_SENTENCE_CUT_COST if units else cost
        units.append(_Unit(start, stop, count(text[start:stop]), chunk_cost, broken=bool(units)))
        start = stop
    return units


def _cut_positions(pattern: re.Pattern, text: str, start: int, end: int) -> list[int]:
    """Sorted offsets just after each match of `pattern` in text[start:end], and `end` itself."""
    ends = {match.end() for match in pattern.finditer(text, start, end) if match.end() > start}
    return sorted(ends | {end})


def _fitting_prefix_end(text: str, start: int, end: int, count: CountTokens, limit: int,
                        cut_lists: list[list[int]]) -> int:
    """Largest cut after `start` keeping text[start:cut] within `limit` tokens: from the first
    cut list (lines) if any fits, else the next (words), else characters (at least one)."""
    def fits(cut: int) -> bool:
        return count(text[start:cut]) <= limit

    for cuts in cut_lists:
        best = _last_fitting(cuts, bisect.bisect_right(cuts, start), fits)
        if best is not None:
            return best
    best = _last_fitting(range(start + 1, end + 1), 0, fits)
    return best if best is not None else start + 1


def _last_fitting(cuts: Sequence[int], first: int, fits: Callable[[int], bool]) -> int | None:
    """The last cuts[k], k >= first, that fits, assuming fitting is monotone in k (prefix token
    counts). Gallops (first, +1, +2, +4, ...) then bisects, so the number of `fits` calls and
    the text they count grow with the answer, not with len(cuts)."""
    if first >= len(cuts) or not fits(cuts[first]):
        return None
    good, step = first, 1
    while good + step < len(cuts) and fits(cuts[good + step]):
        good, step = good + step, step * 2
    bad = min(good + step, len(cuts))  # first index known not to fit, or past the end
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(cuts[middle]) else (good, middle)
    return cuts[good]


def paragraphs(text: str, start: int, end: int) -> Iterator[tuple[int, int]]:
    """(start, end) of paragraphs in text[start:end], split at blank lines kept with the paragraph before."""
    for match in _PARAGRAPH_BREAK.finditer(text, start, end):
        if match.end() < end:
            yield start, match.end()
            start = match.end()
    yield start, end


def sentences(text: str, start: int, end: int) -> Iterator[tuple[int, int]]:
    """(start, end) of sentences in text[start:end]; each keeps its trailing whitespace."""
    for cut in sentence_ends(text, start, end):
        if cut < end:
            yield start, cut
            start = cut
    yield start, end


def sentence_ends(text: str, start: int, end: int) -> Iterator[int]:
    """Offsets just after sentence-final punctuation and its whitespace, skipping abbreviations
    ("e.g.", "Dr.", initials) and ends followed by a lowercase letter."""
    for match in _SENTENCE_END.finditer(text, start, end):
        if match.group().startswith(("\n", "。", "！", "？")):
            yield match.end()
            continue
        word = _WORD_BEFORE.search(text, max(start, match.start() - MAX_WORD_LOOKBACK), match.start())
        if word and _is_abbreviation_or_marker(text, word):
            continue
        following = text[match.end(): match.end() + 2].lstrip(_OPENERS)[:1]
        if not following.islower():
            yield match.end()


def _is_abbreviation_or_marker(text: str, word: re.Match) -> bool:
    """True for "e.g."-style abbreviations, initials ("J.") and list numbers opening a line ("2.")."""
    token = word.group()
    if token.lower() in ABBREVIATIONS or (len(token) == 1 and token.isupper()):
        return True
    return token.isdigit() and not text[text.rfind("\n", 0, word.start()) + 1: word.start()].strip()


# ---------------------------------------------------------------------------------------------
# 2. Topic shifts


def _mark_topic_shifts(units: list[_Unit], texts: list[str], embed: Embed | None) -> None:
    """Lower the cut cost of boundaries where neighbouring sentence windows are dissimilar."""
    if len(units) < 3:
        return
    similarity = _embedding_similarities(texts, embed) if embed else _lexical_similarities(texts)
    valid = similarity[~np.isnan(similarity)]
    if len(valid) < 2 or valid.std() == 0:
        return
    mean, std = valid.mean(), valid.std()
    padded = np.concatenate([[np.inf], np.nan_to_num(similarity, nan=np.inf), [np.inf]])
    for boundary, value in enumerate(similarity, start=1):  # similarity[k] is the boundary before unit k+1
        if np.isnan(value) or units[boundary].broken:
            continue
        z = (mean - value) / std
        is_valley = padded[boundary] <= min(padded[boundary - 1], padded[boundary + 1]) and z > VALLEY_Z
        units[boundary].cost -= DISSIMILARITY_WEIGHT * math.tanh(z) + VALLEY_BONUS * is_valley


def _embedding_similarities(texts: list[str], embed: Embed) -> np.ndarray:
    """Cosine between mean embeddings of the TOPIC_WINDOW texts left and right of each boundary."""
    vectors = np.asarray(embed(texts), dtype=np.float64)  # (n, d)
    if vectors.ndim != 2 or vectors.shape[0] != len(texts):
        raise ValueError(f"embed must return one row per text: got shape {vectors.shape} "
                         f"for {len(texts)} texts")
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)  # (n, 1)
    vectors = vectors / np.where(norms > 0, norms, 1.0)
    cumulative = np.vstack([np.zeros((1, vectors.shape[1])), np.cumsum(vectors, axis=0)])  # (n+1, d)
    boundaries = np.arange(1, len(texts))  # (n-1,)
    left = cumulative[boundaries] - cumulative[np.maximum(boundaries - TOPIC_WINDOW, 0)]  # (n-1, d)
    right = cumulative[np.minimum(boundaries + TOPIC_WINDOW, len(texts))] - cumulative[boundaries]  # (n-1, d)
    denominator = np.linalg.norm(left, axis=1) * np.linalg.norm(right, axis=1)  # (n-1,)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, (left * right).sum(axis=1) / denominator, np.nan)


def _lexical_similarities(texts: list[str]) -> np.ndarray:
    """TF-IDF cosine between the TOPIC_WINDOW texts left and right of each boundary
    (NaN where a side has no terms)."""
    counts = [Counter(_terms(text)) for text in texts]
    document_frequency = Counter(term for count in counts for term in count)
    idf = {term: math.log((1 + len(texts)) / (1 + df)) + 1 for term, df in document_frequency.items()}
    similarities = []
    for boundary in range(1, len(texts)):
        left = _window_weights(counts[max(boundary - TOPIC_WINDOW, 0): boundary], idf)
        right = _window_weights(counts[boundary: boundary + TOPIC_WINDOW], idf)
        similarities.append(_cosine(left, right))
    return np.array(similarities, dtype=np.float64)


def _terms(text: str) -> list[str]:
    """Lowercased content words, plural 's' stripped, stopwords and short words dropped."""
    words = (word.lower() for word in _TERM.findall(text))
    return [_stem(word) for word in words if len(word) >= MIN_TERM_CHARS and word not in STOPWORDS]


def _stem(word: str) -> str:
    plural = word.endswith("s") and not word.endswith("ss") and len(word) > MIN_TERM_CHARS
    return word[:-1] if plural else word


def _window_weights(counts: list[Counter], idf: dict[str, float]) -> dict[str, float]:
    total: Counter = Counter()
    for count in counts:
        total.update(count)
    return {term: frequency * idf[term] for term, frequency in total.items()}


def _cosine(left: dict[str, float], right: dict[str, float]) -> float:
    norm = math.sqrt(sum(v * v for v in left.values()) * sum(v * v for v in right.values()))
    if norm == 0:
        return math.nan
    return sum(weight * right.get(term, 0.0) for term, weight in left.items()) / norm


# ---------------------------------------------------------------------------------------------
# 3. Planning and 4. enforcing the bound


def _plan(units: list[_Unit], max_tokens: int, min_tokens: int) -> list[int]:
    """Indices of the units that start pieces (always [0, ...]), by least total cost.

    best[j] = cheapest way to cut units[:j]; a piece units[i:j] is allowed when its token sum is
    within max_tokens or it is a single unit. Ties keep the later cut (i is scanned downwards).
    """
    prefix = [0]
    for unit in units:
        prefix.append(prefix[-1] + unit.tokens)
    best, back = [0.0] + [math.inf] * len(units), [0] * (len(units) + 1)
    for j in range(1, len(units) + 1):
        i = j - 1
        while i >= 0 and (i == j - 1 or prefix[j] - prefix[i] <= max_tokens):
            cut = units[i].cost if i > 0 else 0.0
            cost = best[i] + cut + _piece_penalty(units, i, j, prefix, min_tokens)
            if cost < best[j]:
                best[j], back[j] = cost, i
            i -= 1
    starts, j = [], len(units)
    while j > 0:
        j = back[j]
        starts.append(j)
    return starts[::-1]


def _piece_penalty(units: list[_Unit], i: int, j: int, prefix: list[int], min_tokens: int) -> float:
    tokens = prefix[j] - prefix[i]
    short = SHORT_PIECE_PENALTY * (1 - tokens / min_tokens) if tokens < min_tokens else 0.0
    orphan = ORPHAN_HEADING_PENALTY if units[j - 1].heading and j < len(units) else 0.0
    return short + orphan


def _enforce_limit(text: str, units: list[_Unit], starts: list[int], count: CountTokens,
                   max_tokens: int) -> list[tuple[int, int, int]]:
    """(first unit, end unit, tokens) per piece, re-splitting pieces whose real count exceeds max_tokens."""
    pending = list(zip(starts, starts[1:] + [len(units)]))[::-1]
    pieces = []
    while pending:
        first, end = pending.pop()
        tokens = count(text[units[first].start: units[end - 1].end])
        if tokens <= max_tokens or end - first == 1:
            pieces.append((first, end, tokens))
            continue
        middle = (first + end) / 2
        cut = min(range(first + 1, end), key=lambda k: (units[k].cost, abs(k - middle), -k))
        pending += [(cut, end), (first, cut)]
    return pieces


# ---------------------------------------------------------------------------------------------
# Assembly


def _segments(doc: Document, units: list[_Unit], pieces: list[tuple[int, int, int]]) -> list[Segment]:
    path_at = _heading_paths(doc.headings)
    segments = []
    for ordinal, (first, end, tokens) in enumerate(pieces):
        start, stop = units[first].start, units[end - 1].end
        body = next((unit.start for unit in units[first:end] if not unit.heading), units[end - 1].start)
        split = units[first].broken or (end < len(units) and units[end].broken)
        segments.append(Segment(ordinal, start, stop, doc.text[start:stop], tokens, doc.page_at(start),
                                path_at(body), body, split))
    return segments


def _heading_paths(headings: tuple[Heading, ...]) -> Callable[[int], str | None]:
    """A function: char offset -> enclosing heading titles joined by HEADING_PATH_SEPARATOR."""
    stack: list[Heading] = []
    starts, paths = [], []
    for heading in headings:
        while stack and stack[-1].level >= heading.level:
            stack.pop()
        stack.append(heading)
        starts.append(heading.char_start)
        paths.append(HEADING_PATH_SEPARATOR.join(item.title for item in stack))

    def path_at(char: int) -> str | None:
        index = bisect.bisect_right(starts, char) - 1
        return paths[index] if index >= 0 else None

    return path_at
