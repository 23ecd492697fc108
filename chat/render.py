"""How a conversation becomes the exact token ids the KV cache holds, and where each part lies.

Decision (documents in the prompt): the **system message** carries the system prompt
followed by every attached document, each wrapped as

    <document name="NAME">
    TEXT
    </document>

in attachment order. The rendered system message (through the model's own chat template)
is the conversation's **prefix**: it never changes while the documents and the system
prompt stay the same, so its KV spans are content-addressed and shared by every
conversation with the same system prompt and documents. A first user message was the
alternative; it would put the document inside the first turn and tie its cache to that
turn's text, which defeats sharing.

One rendering (`Renderer.render`) holds everything the later steps read: the token ids,
the prefix's length, where each message ends, and the token range of every document
segment (segments were cut once, at ingest, and stored with their pages and headings).
It is one pass of the tokenizer over the template's text with character offsets
(`engine.token_offsets`), so every position is found by offset, never by searching for
token ids:

    text:    <|im_start|>system\\n PROMPT <document name="a.pdf">\\n SEG 0 | SEG 1 | ... </document> <|im_end|>\\n ...
    ids:     [ prefix (system message)                                                        ) [ message 0 ) [ message 1 ) ...
             0                                                                       prefix_len   message_ends[0]

Message i owns `ids[message_ends[i-1]:message_ends[i]]` (message -1 ends at the prefix):
`message_ends[i]` is the length of the rendering of the conversation up to and including
message i; the generation prompt "<|im_start|>assistant\\n" belongs to the assistant
message that follows it. A template that re-renders history differently (not prefix
stable) gives the messages it rewrote an empty range; their tokens go to the next stable one.
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

_MEMO_SIZE = 8  # renderings kept: a turn needs ~4 distinct ones
DOCUMENT_FORMAT = '<document name="{name}">\n{text}\n</document>'
_DOCUMENT_HEAD = '<document name="{name}">\n'
_BLOCK_SEPARATOR = "\n\n"


@dataclass(frozen=True, slots=True)
class DocumentSegment:
    """A segment of an attached document as cut at ingest: characters [char_start, char_end)
    of its text, the page of its first character and the headings around it."""

    ordinal: int
    char_start: int
    char_end: int
    page: int | None = None
    heading: str | None = None
    n_tokens: int | None = None
    id: str | None = None  # its row in the store's segments table


@dataclass(frozen=True, slots=True)
class AttachedDocument:
    """A document in a conversation: its name there, its text and its segments (in order, tiling it)."""

    id: str
    name: str
    text: str
    segments: tuple[DocumentSegment, ...] = ()


@dataclass(frozen=True)
class Conversation:
    """What is rendered: the system prompt, the attached documents, the visible messages."""

    system_prompt: str
    documents: tuple[AttachedDocument, ...] = ()
    messages: tuple[tuple[str, str], ...] = ()

    @functools.cached_property
    def _system(self) -> tuple[str, tuple[int, ...]]:
        blocks = [self.system_prompt.strip()] if self.system_prompt.strip() else []
        offsets = []
        for document in self.documents:
            before = sum(len(block) for block in blocks) + len(_BLOCK_SEPARATOR) * len(blocks)
            offsets.append(before + len(_DOCUMENT_HEAD.format(name=document.name)))
            blocks.append(DOCUMENT_FORMAT.format(name=document.name, text=document.text))
        return _BLOCK_SEPARATOR.join(blocks), tuple(offsets)

    @property
    def system(self) -> str:
        """The system message content: the prompt, then each document (DOCUMENT_FORMAT)."""
        return self._system[0]

    @property
    def document_offsets(self) -> tuple[int, ...]:
        """Where each document's text starts in `system`."""
        return self._system[1]

    def template_messages(self, upto: int | None = None) -> list[dict]:
        """Chat-template input: the system message (when non-empty) + the first `upto` messages."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        chosen = self.messages if upto is None else self.messages[:upto]
        return head + [{"role": role, "content": content} for role, content in chosen]

    def plus(self, role: str, content: str) -> "Conversation":
        return Conversation(self.system_prompt, self.documents, (*self.messages, (role, content)))

    def with_document(self, document: AttachedDocument) -> "Conversation":
        return Conversation(self.system_prompt, (*self.documents, document), self.messages)


@dataclass(frozen=True, slots=True)
class SegmentRange:
    """Document segment `segment` of `conversation.documents[document]` at token positions [start, end)."""

    document: int
    segment: DocumentSegment
    start: int
    end: int


@dataclass(frozen=True)
class Rendering:
    """A conversation as token ids, and where its prefix, messages and document segments lie.

    `starts[i]` is the character (of the template's text) where token i starts;
    `document_chars[d]` where document d's text starts in that text (-1: the template
    does not show the system message verbatim, so no document position is known)."""

    ids: tuple[int, ...]
    starts: tuple[int, ...]
    prefix_len: int
    message_ends: tuple[int, ...]
    segments: tuple[SegmentRange, ...]
    document_chars: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def prefix_ids(self) -> list[int]:
        return list(self.ids[: self.prefix_len])

    def token_at(self, document: int, char: int) -> int:
        """How many tokens start before character `char` of document `document`'s text."""
        return bisect.bisect_left(self.starts, self.document_chars[document] + char)


class Renderer:
    """Renders conversations with one engine's chat template (`engine.chat_text`, `engine.token_offsets`).

    The last few renderings are memoised: a turn renders the same conversation several
    times (the prompt, then the conversation with its reply)."""

    def __init__(self, engine, memo_size: int = _MEMO_SIZE):
        self.engine = engine
        self._render = functools.lru_cache(maxsize=memo_size)(self._render_uncached)

    def render(self, conversation: Conversation, *, generation_prompt: bool) -> Rendering:
        """The conversation, optionally followed by the assistant generation prompt."""
        return self._render(conversation, generation_prompt)

    def prompt(self, conversation: Conversation) -> Rendering:
        """What the engine is asked to continue: the conversation + the generation prompt."""
        return self.render(conversation, generation_prompt=True)

    def full(self, conversation: Conversation) -> Rendering:
        """The conversation as it is cached once a reply is stored (no generation prompt)."""
        return self.render(conversation, generation_prompt=False)

    def _render_uncached(self, conversation: Conversation, generation_prompt: bool) -> Rendering:
        messages = conversation.template_messages()
        if not messages:
            return Rendering((), (), 0, (), (), ())
        text = self.engine.chat_text(messages, add_generation_prompt=generation_prompt)
        ids, starts = self.engine.token_offsets(text)
        boundary = functools.partial(_boundary, text, starts)
        prefix_len = 0
        if conversation.system:
            prefix_len = boundary(self._text(conversation, 0)) or 0
        ends, floor = [], prefix_len
        for index in range(len(conversation.messages)):
            end = boundary(self._text(conversation, index + 1))
            floor = max(floor, end or floor)
            ends.append(floor)
        document_chars, segments = _documents(conversation, text, starts)
        return Rendering(tuple(ids), tuple(starts), prefix_len, tuple(ends), segments, document_chars)

    def _text(self, conversation: Conversation, upto: int) -> str:
        return self.engine.chat_text(conversation.template_messages(upto), add_generation_prompt=False)


def _boundary(text: str, starts: list[int], head: str) -> int | None:
    """The number of tokens of `text` that render `head`, when `head` is a prefix of `text`
    ending on a token boundary; else None."""
    if not text.startswith(head):
        return None
    n = bisect.bisect_left(starts, len(head))
    return n if n == len(starts) or starts[n] == len(head) else None


def _documents(conversation: Conversation, text: str, starts: list[int]):
    """(where each document's text starts in `text`, the token range of every segment)."""
    base = text.find(conversation.system) if conversation.documents else -1
    if base < 0:
        return tuple(-1 for _ in conversation.documents), ()
    chars = tuple(base + offset for offset in conversation.document_offsets)
    ranges = []
    for index, (document, at) in enumerate(zip(conversation.documents, chars)):
        for piece in document.segments:
            start = bisect.bisect_left(starts, at + piece.char_start)
            end = bisect.bisect_left(starts, at + piece.char_end)
            if end > start:
                ranges.append(SegmentRange(index, piece, start, end))
    return chars, tuple(ranges)
