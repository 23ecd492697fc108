"""How a conversation becomes the exact token ids the KV cache holds.

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

Every turn the whole visible conversation is rendered again through the chat template
and the engine reuses the longest common prefix with what its cache holds. The stored
spans therefore hold *template-rendered* ids: the prefix is `ids[:prefix_len]`, and
message i owns `ids[end(i-1):end(i)]` where `end(i)` is the length of the rendering of
the conversation up to and including message i (the generation prompt
"<|im_start|>assistant\n" belongs to the assistant message that follows it). A template
that re-renders history differently (a non-prefix-stable template) gets empty parts
for the messages it rewrote, and their tokens go to the next message that is stable.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

_MEMO_SIZE = 8  # renderings kept: a turn needs ~4 distinct ones
DOCUMENT_FORMAT = '<document name="{name}">\n{text}\n</document>'


def system_text(system_prompt: str, documents: list[tuple[str, str]]) -> str:
    """The system message content: the prompt, then each (name, text) document."""
    blocks = [system_prompt.strip()] if system_prompt.strip() else []
    blocks += [DOCUMENT_FORMAT.format(name=name, text=text) for name, text in documents]
    return "\n\n".join(blocks)


@dataclass(slots=True, frozen=True)
class Conversation:
    """What is rendered: the system content and the visible messages as (role, content)."""

    system: str
    messages: tuple[tuple[str, str], ...]

    def template_messages(self, upto: int | None = None) -> list[dict]:
        """Chat-template input: the system message (when non-empty) + the first `upto` messages."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        chosen = self.messages if upto is None else self.messages[:upto]
        return head + [{"role": role, "content": content} for role, content in chosen]

    def plus(self, role: str, content: str) -> "Conversation":
        return Conversation(self.system, (*self.messages, (role, content)))


class Renderer:
    """Renders conversations with one engine's chat template (`engine.chat_ids`).

    The last few renderings are memoised (a turn renders the same conversation several
    times, and the system message with its documents every turn); callers get copies."""

    def __init__(self, engine, memo_size: int = _MEMO_SIZE):
        self.engine = engine
        self._render = functools.lru_cache(maxsize=memo_size)(self._render_uncached)

    def ids(self, conversation: Conversation, *, generation_prompt: bool, upto: int | None = None) -> list[int]:
        """Token ids of the conversation (its first `upto` messages), optionally followed by
        the assistant generation prompt."""
        return list(self._render(conversation, generation_prompt, upto))

    def _render_uncached(self, conversation: Conversation, generation_prompt: bool, upto: int | None) -> tuple:
        messages = conversation.template_messages(upto)
        if not messages:
            return ()
        return tuple(self.engine.chat_ids(messages, add_generation_prompt=generation_prompt))

    def prompt(self, conversation: Conversation) -> list[int]:
        """What the engine is asked to continue: the conversation + the generation prompt."""
        return self.ids(conversation, generation_prompt=True)

    def full(self, conversation: Conversation) -> list[int]:
        """The conversation as it will be cached once a reply is stored (no generation prompt)."""
        return self.ids(conversation, generation_prompt=False)

    def prefix_len(self, conversation: Conversation, full: list[int]) -> int:
        """Length of the rendered system message inside `full` (0: no system content, or a
        template that does not render it as a stable prefix)."""
        if not conversation.system:
            return 0
        prefix = self.ids(Conversation(conversation.system, ()), generation_prompt=False)
        return len(prefix) if full[: len(prefix)] == prefix else 0

    def message_end(self, conversation: Conversation, index: int, full: list[int], floor: int) -> int:
        """End position of message `index` in `full`: the length of the rendering up to and
        including it, or `floor` when that rendering is not a prefix of `full`."""
        ids = self.ids(conversation, generation_prompt=False, upto=index + 1)
        if len(ids) < floor or full[: len(ids)] != ids:
            return floor
        return len(ids)
