"""segmenter.segment: structure-first, topic-aware, bounded, tiling, deterministic."""
import re

import numpy as np
import pytest

from segmenter import Document, Heading, PageStart, Segment, segment
from segmenter.readers import markdown_headings
from segmenter.segment import sentences


def words(text: str) -> int:
    """Token counter for tests: whitespace-separated words."""
    return len(text.split())


def sentence(topic: str, index: int, length: int = 10) -> str:
    """A plain sentence of `length` words, numbered so every sentence differs."""
    filler = " ".join(["filler"] * (length - 9))
    return f"Sentence {index} of the {topic} part has filler words {filler}."


def markdown(text: str) -> Document:
    return Document(name="t.md", format="md", text=text, headings=tuple(markdown_headings(text)))


def plain(text: str) -> Document:
    return Document(name="t.txt", format="txt", text=text)


def check_tiling(doc: Document, segments: list[Segment]) -> None:
    assert [s.ordinal for s in segments] == list(range(len(segments)))
    assert [s.char_start for s in segments[1:]] == [s.char_end for s in segments[:-1]]
    assert (segments[0].char_start, segments[-1].char_end) == (0, len(doc.text))
    assert all(s.text == doc.text[s.char_start:s.char_end] for s in segments)


def cuts(segments: list[Segment]) -> list[int]:
    return [s.char_start for s in segments[1:]]


# ---------------------------------------------------------------------------------------------
# Structure


def section(title: str, level: int, n_paragraphs: int, per_paragraph: int, topic: str) -> str:
    body = "\n\n".join(" ".join(sentence(topic, 10 * p + k) for k in range(per_paragraph))
                       for p in range(n_paragraphs))
    return f"{'#' * level} {title}\n\n{body}\n\n"


STRUCTURED = (
    "Preface text that is short.\n\n"
    + section("Chapter 1", 1, 2, 3, "first")  # 60 words
    + section("Section 1.1", 2, 2, 2, "second")  # 40 words
    + section("Chapter 2", 1, 0, 0, "none")  # heading only: joins its first child
    + section("Section 2.1", 2, 6, 3, "third")  # 180 words: longer than max_tokens
    + section("Section 2.2", 2, 1, 3, "fourth")
)


def test_boundaries_fall_at_headings_then_paragraphs():
    doc = markdown(STRUCTURED)
    segments = segment(doc, words, max_tokens=100, min_tokens=20)
    check_tiling(doc, segments)
    start = {heading.title: heading.char_start for heading in doc.headings}
    paragraph_starts = [match.end() for match in re.finditer(r"\n\n", doc.text)]
    assert cuts(segments)[:2] == [start["Section 1.1"], start["Chapter 2"]]
    assert cuts(segments)[-1] == start["Section 2.2"]
    inside_section_2_1 = cuts(segments)[2:-1]
    assert len(inside_section_2_1) == 1 and inside_section_2_1[0] in paragraph_starts
    assert [(s.heading_path, s.n_tokens) for s in segments] == [
        (None, 5 + 3 + 60),  # the short preface joins Chapter 1; it starts outside any heading
        ("Chapter 1 › Section 1.1", 3 + 40),
        ("Chapter 2 › Section 2.1", 3 + 3 + 90),  # the bare "# Chapter 2" joins its first child
        ("Chapter 2 › Section 2.1", 90),
        ("Chapter 2 › Section 2.2", 3 + 30),
    ]


def test_no_segment_exceeds_max_tokens_and_counts_are_exact():
    doc = markdown(STRUCTURED)
    for max_tokens in (12, 25, 50, 400):
        segments = segment(doc, words, max_tokens=max_tokens, min_tokens=max_tokens // 4)
        check_tiling(doc, segments)
        assert all(s.n_tokens == words(s.text) <= max_tokens for s in segments)
        assert not any(s.split_sentence for s in segments)


def test_never_cuts_mid_sentence():
    text = " ".join(sentence("only", index, length=9 + index % 7) for index in range(40))
    for max_tokens in (20, 33, 70):
        segments = segment(plain(text), words, max_tokens=max_tokens, min_tokens=5)
        assert all(re.search(r"\.\s*$", s.text) for s in segments), [s.text[-20:] for s in segments]


def test_over_long_sentence_is_split_at_words_and_flagged():
    long_sentence = "This sentence never ends and " + "goes on " * 60 + "until here. "
    text = "A short opener here. " + long_sentence + "Then a normal sentence follows it."
    inside = range(text.index(long_sentence) + 1, text.index("Then"))
    segments = segment(plain(text), words, max_tokens=30, min_tokens=5)
    check_tiling(plain(text), segments)
    assert [s.n_tokens for s in segments] == [25, 28, 28, 28, 28]  # 137 words, 5 pieces needed
    assert all(s.text.endswith((" ", ".")) for s in segments)  # word boundaries
    assert [s.split_sentence for s in segments] == [
        s.char_start in inside or s.char_end in inside for s in segments]
    assert segments[0].split_sentence and segments[0].text.startswith("A short opener here. This sentence")


def test_headings_and_pages_attached():
    text = ("Title page\n\n" "Chapter 1\n\nOne. Two.\n\n" "Section 1.1\n\nThree. Four.\n\n"
            "Chapter 2\n\nFive. Six.")
    pages = (PageStart(0, 1), PageStart(text.index("Section"), 2), PageStart(text.index("Chapter 2"), 4))
    headings = (Heading(0, 0, "Title page"), Heading(text.index("Chapter 1"), 1, "Chapter 1"),
                Heading(text.index("Section"), 2, "Section 1.1"),
                Heading(text.index("Chapter 2"), 1, "Chapter 2"))
    doc = Document(name="b.pdf", format="pdf", text=text, pages=pages, headings=headings, page_count=4)
    segments = segment(doc, words, max_tokens=6, min_tokens=0)
    assert [(s.text, s.page, s.heading_path, s.quote()) for s in segments] == [
        # a heading never ends a segment: the title page joins Chapter 1
        ("Title page\n\nChapter 1\n\nOne. Two.\n\n", 1, "Title page › Chapter 1", "One. Two."),
        ("Section 1.1\n\nThree. Four.\n\n", 2, "Title page › Chapter 1 › Section 1.1", "Three. Four."),
        ("Chapter 2\n\nFive. Six.", 4, "Title page › Chapter 2", "Five. Six."),
    ]


def test_determinism():
    doc = markdown(STRUCTURED)
    assert segment(doc, words, max_tokens=40, min_tokens=10) == segment(
        doc, words, max_tokens=40, min_tokens=10)
    text, _ = two_topics()
    embed = topic_embedding
    assert segment(plain(text), words, max_tokens=150, min_tokens=20, embed=embed) == segment(
        plain(text), words, max_tokens=150, min_tokens=20, embed=embed)


def test_non_additive_token_counts_are_still_bounded():
    def count(text: str) -> int:  # a long piece costs more than its parts, as a tokenizer may
        return words(text) + (10 if len(text) > 400 else 0)

    doc = markdown(STRUCTURED)
    segments = segment(doc, count, max_tokens=70, min_tokens=10)
    check_tiling(doc, segments)
    assert all(s.n_tokens == count(s.text) <= 70 for s in segments)


# ---------------------------------------------------------------------------------------------
# Topic shifts


COOKING = [
    "The baker mixed flour, butter and sugar in a large bowl for the bread dough.",
    "Kneading the dough with floured hands makes the bread soft and the crust crisp.",
    "The oven must be hot before the bread dough goes in on a floured tray.",
    "Butter and sugar cream together before the flour is folded into the cake batter.",
    "A baker checks the oven often so the cake and the bread do not burn.",
    "Fresh bread from the oven smells of butter, yeast and warm flour.",
    "The dough rises twice, and the baker shapes the bread loaves by hand.",
    "Sugar on the crust caramelises in the hot oven while the bread bakes.",
    "Cake batter with butter, eggs and flour bakes in the oven for an hour.",
]
ASTRONOMY = [
    "Astronomers point the telescope at distant galaxies and faint nebulae each night.",
    "A telescope mirror gathers starlight from galaxies millions of years away.",
    "The planets orbit the sun while astronomers track each orbit with the telescope.",
    "Nebulae are clouds of gas where new stars and planets slowly form.",
    "Starlight from a distant galaxy shifts red as the universe expands.",
    "The observatory telescope records planets crossing in front of their stars.",
    "Astronomers measure the orbit of planets around stars in nearby galaxies.",
]


def two_topics() -> tuple[str, int]:
    """One paragraph: cooking then astronomy; returns (text, offset of the change)."""
    first = " ".join(COOKING) + " "
    return first + " ".join(ASTRONOMY), len(first)


def test_lexical_fallback_cuts_at_the_topic_change():
    text, change = two_topics()
    assert (words(text[:change]), words(text[change:])) == (125, 81)  # one cut, anywhere in words 56..150
    segments = segment(plain(text), words, max_tokens=150, min_tokens=20)
    assert cuts(segments) == [change]


def test_lexical_fallback_with_several_forced_cuts():
    text, change = two_topics()
    text = text + " " + text  # cooking, astronomy, cooking, astronomy
    segments = segment(plain(text), words, max_tokens=130, min_tokens=20)  # three cuts needed
    assert cuts(segments) == [change, text.index(COOKING[0], 1), text.index(ASTRONOMY[0], change + 1)]


def numbered_text(n: int) -> str:
    return " ".join(f"Item {index} is written with the same plain words as the others." for index in range(n))


def topic_embedding(texts: list[str]) -> np.ndarray:
    """A fake embedding: texts mentioning a number >= 11 (or astronomy) point one way, others another."""
    def is_second(text: str) -> bool:
        numbers = [int(n) for n in re.findall(r"\d+", text)]
        astronomy = ("telescope", "planets", "star")
        return bool(numbers and numbers[0] >= 11) or any(word in text for word in astronomy)
    return np.array([[0.0, 1.0] if is_second(text) else [1.0, 0.1] for text in texts])


def test_embedding_cuts_where_the_lexical_fallback_sees_nothing():
    text = numbered_text(20)  # 11 words per sentence, 220 words, lexically uniform
    change = text.index("Item 11 ")
    without = segment(plain(text), words, max_tokens=150, min_tokens=20)
    assert cuts(without) != [change]
    calls = []

    def embed(texts):
        calls.append(len(texts))
        return topic_embedding(texts)

    assert cuts(segment(plain(text), words, max_tokens=150, min_tokens=20, embed=embed)) == [change]
    assert calls == [20]  # once, one row per sentence


def test_embedding_with_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="embed must return one row per text"):
        segment(plain(numbered_text(20)), words, max_tokens=150, min_tokens=20,
                embed=lambda texts: np.zeros(3))


def test_short_sections_are_not_embedded():
    def embed(texts):
        raise AssertionError("embed called for a section that fits")

    assert len(segment(plain(numbered_text(5)), words, max_tokens=150, embed=embed)) == 1


# ---------------------------------------------------------------------------------------------
# Details


def test_sentence_splitter():
    text = ("Dr. Smith arrived at 3.30 p.m. today. He said e.g. this works. “Really?” she asked. "
            "J. R. Tolkien wrote it!\n- first item\n- second item\nEnd")
    assert [text[a:b] for a, b in sentences(text, 0, len(text))] == [
        "Dr. Smith arrived at 3.30 p.m. today. ",
        "He said e.g. this works. ",
        "“Really?” she asked. ",
        "J. R. Tolkien wrote it!\n",
        "- first item\n",
        "- second item\nEnd",
    ]


def test_quote_stops_at_a_sentence_end():
    first = "A first sentence that is moderately long, about eighty characters in all here. "
    second = "A second one of similar size follows it and still fits inside the quote span. "
    third = "The third sentence would take the quote past two hundred characters, so it is left out."
    segments = segment(plain(first + second + third), words)
    assert segments[0].quote() == (first + second).strip()
    unbroken = Segment(0, 0, 300, "word " * 60, 60, None, None, 0)
    assert unbroken.quote(max_chars=22) == "word word word word…"
    assert unbroken.quote(max_chars=400) == ("word " * 60).strip()


def test_arguments_and_empty_text():
    assert segment(plain(""), words) == []
    for max_tokens, min_tokens in ((0, 0), (10, 11), (10, -1)):
        with pytest.raises(ValueError, match="need 1 <= max_tokens"):
            segment(plain("Hello."), words, max_tokens=max_tokens, min_tokens=min_tokens)


def test_a_heading_longer_than_max_tokens_is_treated_as_body():
    text = "# " + "Very long styled heading. " * 10 + "\n\nBody text here."
    segments = segment(markdown(text), words, max_tokens=12, min_tokens=2)
    check_tiling(markdown(text), segments)
    assert all(s.n_tokens <= 12 for s in segments)
    assert not any(s.split_sentence for s in segments)


def test_page_starts_are_boundaries_when_pages_are_long_enough():
    """Issue #18: a PDF source names the page its passage is on, so segments do not cross pages."""
    pages_text = [" ".join(f"Page {p} sentence {i} is here." for i in range(20)) for p in (1, 2, 3)]
    text = "\n\n".join(pages_text)
    starts = [0, len(pages_text[0]) + 2, len(pages_text[0]) + len(pages_text[1]) + 4]
    doc = Document(name="r.pdf", format="pdf", text=text, pages=tuple(PageStart(s, p + 1) for p, s in enumerate(starts)),
                   page_count=3)
    segments = segment(doc, words, max_tokens=512, min_tokens=32)
    assert [(s.char_start, s.page) for s in segments] == [(starts[0], 1), (starts[1], 2), (starts[2], 3)]
