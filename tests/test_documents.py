"""Documents in the prefix (chat/documents.py): where each semantic segment ends among the
rendered prefix ids, so each becomes its own span and cache segment. Issue #6, part 3."""
import pytest

from chat.documents import SEGMENT_TOKENS, segment_ends
from chat.render import system_text
from chat.testing import tiny_engine
from segmenter import Document, segment

PARAGRAPHS = [" ".join(f"Paragraph {i} sentence {j} tells about topic {i * 7 + j} in some detail." for j in range(12))
              for i in range(8)]
LONG = "\n\n".join(PARAGRAPHS)  # ~5,800 characters: several segments
SHORT = "Second file. " * 40


def prefix_ids(engine, documents):
    system = system_text("Be brief.", documents)
    return engine.chat_ids([{"role": "system", "content": system}], add_generation_prompt=False)


def segments_of(engine, text):
    return segment(Document("document", "txt", text), lambda s: len(engine.encode(s)), max_tokens=SEGMENT_TOKENS)


def test_segment_ends_are_the_segment_ends_of_each_document_in_order():
    engine = tiny_engine()  # byte tokenizer: token i of a text is its byte i
    ids = prefix_ids(engine, [("a.txt", LONG), ("b.txt", SHORT)])
    expected = []
    for text in (LONG, SHORT):
        base = bytes(i for i in ids if i < 256).index(text.encode()) + 1  # + the <|im_start|> token
        expected += [base + len(text[: piece.char_end].encode()) for piece in segments_of(engine, text)]
    assert len(segments_of(engine, LONG)) > 3
    assert segment_ends(engine, [LONG, SHORT], ids) == expected


def test_a_document_not_in_the_prefix_contributes_no_ends():
    engine = tiny_engine()
    ids = prefix_ids(engine, [("b.txt", SHORT)])
    assert segment_ends(engine, ["A text that was never attached, so it is nowhere."], ids) == []
    assert segment_ends(engine, [LONG, SHORT], ids) == segment_ends(engine, [SHORT], ids)


@pytest.mark.model
def test_segment_ends_with_the_models_bpe_tokenizer(engine):
    ids = prefix_ids(engine, [("a.txt", LONG), ("b.txt", SHORT)])
    ends = segment_ends(engine, [LONG, SHORT], ids)
    pieces = segments_of(engine, LONG)
    between = [engine.tokenizer.decode(ids[a:b]) for a, b in zip(ends, ends[1:])]
    assert between == [piece.text for piece in pieces[1:]] + ['\n</document>\n\n<document name="b.txt">\n' + SHORT]
    assert engine.tokenizer.decode(ids[: ends[0]]).endswith("<document name=\"a.txt\">\n" + pieces[0].text)
    assert ends[-1] == len(ids) - len(engine.encode("\n</document><|im_end|>\n"))
