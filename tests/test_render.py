"""chat/render.py: one rendering holds the ids, the prefix, message ends and document segment ranges (issue #18)."""
import dataclasses

import pytest

from chat.documents import segment_document
from chat.render import AttachedDocument, Conversation, DocumentSegment, Renderer, SegmentRange
from spotlight.testing import tiny_engine
from segmenter import Document

PARAGRAPHS = [" ".join(f"Paragraph {i} sentence {j} tells about topic {i * 7 + j} in some detail." for j in range(12))
              for i in range(8)]
LONG = "\n\n".join(PARAGRAPHS)  # ~5,800 characters: several segments
SHORT = "Second file. " * 40


def attached(engine, name: str, text: str) -> AttachedDocument:
    segments = segment_document(Document(name, "txt", text), engine.count_tokens)
    return AttachedDocument(name, name, text, tuple(segments))


def test_byte_tokenizer_rendering_is_exact():
    engine = tiny_engine()  # byte tokenizer: token i of an ASCII text is its character i
    documents = (attached(engine, "a.txt", LONG), attached(engine, "b.txt", SHORT))
    conversation = Conversation("Be brief.", documents, (("user", "Hi"), ("assistant", "Hello")))
    rendering = Renderer(engine).full(conversation)
    messages = conversation.template_messages()
    assert list(rendering.ids) == engine.chat_ids(messages, add_generation_prompt=False)
    assert rendering.prefix_len == len(engine.chat_ids(messages[:1], add_generation_prompt=False))
    assert rendering.message_ends == (len(engine.chat_ids(messages[:2], add_generation_prompt=False)),
                                      len(rendering.ids))
    text = engine.chat_text(messages, add_generation_prompt=False)
    special = len("<|im_start|>") - 1  # one token per character, but <|im_start|> is one token of 12

    expected = []
    for index, document in enumerate(documents):
        base = text.index(document.text) - special
        expected += [SegmentRange(index, piece, base + piece.char_start, base + piece.char_end)
                     for piece in document.segments]
    assert len(documents[0].segments) > 3
    assert rendering.segments == tuple(expected)
    assert rendering.token_at(1, 0) == text.index(SHORT) - special


def test_a_conversation_without_documents_has_no_segments():
    engine = tiny_engine()
    rendering = Renderer(engine).prompt(Conversation("", (), (("user", "Hi"),)))
    assert (rendering.prefix_len, rendering.segments, rendering.document_chars) == (0, (), ())
    assert list(rendering.ids) == engine.chat_ids([{"role": "user", "content": "Hi"}])


def test_message_ends_of_a_template_that_rewrites_history_fall_back_to_the_floor():
    """A template that renders earlier messages differently once more follow gives them an
    empty range, and their tokens go to the next stable message."""
    engine = tiny_engine()

    class Rewriting(type(engine.tokenizer)):
        def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, return_dict=False):
            marked = [dict(m, content=m["content"] + ("*" if i < len(messages) - 1 else ""))
                      for i, m in enumerate(messages)]
            return super().apply_chat_template(marked, add_generation_prompt, tokenize, return_dict)

    rewriting = dataclasses.replace(engine, tokenizer=Rewriting())
    conversation = Conversation("", (), (("user", "Hi"), ("assistant", "Hello"), ("user", "More")))
    rendering = Renderer(rewriting).full(conversation)
    assert rendering.message_ends == (0, 0, len(rendering.ids))


@pytest.mark.model
def test_model_tokenizer_rendering_matches_the_piece_tokenizer(engine):
    documents = (attached(engine, "a.txt", LONG), attached(engine, "b.txt", SHORT))
    conversation = Conversation("Be brief.", documents, (("user", "What is topic 7?"),))
    rendering = Renderer(engine).prompt(conversation)
    messages = conversation.template_messages()
    assert list(rendering.ids) == engine.chat_ids(messages)
    assert rendering.prefix_len == len(engine.chat_ids(messages[:1], add_generation_prompt=False))
    for r in rendering.segments:  # each range decodes to its segment's text (BPE may merge one edge token)
        piece = conversation.documents[r.document].text[r.segment.char_start:r.segment.char_end]
        decoded = engine.decode(list(rendering.ids[r.start:r.end]))
        assert piece.strip()[8:-8] in decoded, (piece[:40], decoded[:40])
