"""Tokenising chat renderings without tokenising the same long text twice.

Every turn renders the whole conversation through the chat template and tokenises it again
(chat/render.py): with an 8K-token document in the system message that is ~0.1 s per rendering,
several renderings per turn. A fast (Rust) Hugging Face tokenizer splits its input on the added
tokens (`<|im_start|>`, ...) *before* anything else and then normalises, pre-tokenises and
encodes each piece on its own, so the ids of a text are the concatenation of the ids of its
pieces. `PieceTokenizer` does that split itself and memoises each piece's ids: the document
is tokenised once per process, a new message costs only its own text.

Exactness needs the tokenizer's added tokens to match the raw text with no side effects:
none may strip neighbouring whitespace (`lstrip` / `rstrip`), need word boundaries
(`single_word`) or match normalised text (`normalized`). Otherwise, or for a slow tokenizer,
it falls back to tokenising the whole text (`exact` says which); tests/test_tokens.py
checks both paths against the tokenizer itself.
"""
from __future__ import annotations

import functools
import re

MEMO_SIZE = 256  # pieces remembered: documents, system prompts, messages of the open conversations


class PieceTokenizer:
    """`pieces(text)` == `tokenizer.encode(text, add_special_tokens=False)`, memoised per piece."""

    def __init__(self, tokenizer, memo_size: int = MEMO_SIZE):
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.exact = bool(getattr(tokenizer, "is_fast", False)) and all(
            not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added.values()
        )
        self._ids = {t.content: i for i, t in added.items()}
        contents = sorted(self._ids, key=len, reverse=True)  # longest first: the library's leftmost-longest match
        self._split = re.compile("(" + "|".join(map(re.escape, contents)) + ")") if contents else None
        self._piece = functools.lru_cache(maxsize=memo_size)(self._encode_piece)

    def _encode_piece(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def __call__(self, text: str) -> list[int]:
        if not self.exact or self._split is None:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        ids: list[int] = []
        for piece in self._split.split(text):  # odd positions are added tokens, even ones the text between
            if not piece:
                continue
            token = self._ids.get(piece)
            if token is not None:
                ids.append(token)
            else:
                ids.extend(self._piece(piece))
        return ids
