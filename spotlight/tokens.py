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


class TemplateTokenizer:
    """A model directory's fast tokenizer and chat template without transformers: the Rust
    `tokenizers.Tokenizer` of its tokenizer.json and the template rendered by jinja2 in the same
    sandbox and with the same helpers as transformers' `apply_chat_template`. It answers what the
    engine asks of a Hugging Face tokenizer (encode, decode, offsets, the chat template, the special
    tokens) with the same ids and text (tests/test_tokens.py holds it to transformers' tokenizer on
    the packaged models), and holds about 100 MiB less memory: transformers' Qwen2Tokenizer over
    Qwen2.5's 151,646-token vocabulary keeps ~130 MiB resident after loading, this ~45 (issue #20).

    `loading.load_tokenizer` builds one where the directory's tokenizer_config.json asks for
    nothing it does not do (`plain_config`), else loads transformers' class as before."""

    is_fast = True  # PieceTokenizer's exact, piece-by-piece path applies

    def __init__(self, tokenizer, chat_template: str | None, special_tokens: dict[str, str]):
        self._tokenizer = tokenizer  # a tokenizers.Tokenizer
        self._template_text = chat_template
        self.special_tokens_map = dict(special_tokens)  # {"eos_token": "<|im_end|>", ...}: the template sees these
        self.eos_token_id = self._id_of("eos_token")
        self.bos_token_id = self._id_of("bos_token")
        self.unk_token_id = self._id_of("unk_token")

    def _id_of(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self._tokenizer.token_to_id(token)

    @property
    def added_tokens_decoder(self) -> dict:
        return self._tokenizer.get_added_tokens_decoder()

    def convert_tokens_to_ids(self, token: str) -> int | None:
        """The id of one token's text; the unknown token's id (None where there is none) when absent."""
        found = self._tokenizer.token_to_id(token)
        return self.unk_token_id if found is None else found

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = False, return_offsets_mapping: bool = False) -> dict:
        encoded = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if return_offsets_mapping:
            return {"input_ids": encoded.ids, "offset_mapping": encoded.offsets}
        return {"input_ids": encoded.ids}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs) -> str:
        """The conversation rendered as text (tokenize=False, the only form the engine asks for)."""
        if tokenize:
            raise NotImplementedError("TemplateTokenizer renders text only: pass tokenize=False and encode the text")
        if self._template_text is None:
            raise ValueError("this model has no chat template; give its directory a chat_template.jinja "
                             "or a chat_template entry in tokenizer_config.json")
        return self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **{**self.special_tokens_map, **kwargs})

    @functools.cached_property
    def _template(self):
        return compile_template(self._template_text)


def compile_template(source: str):
    """A chat template compiled as transformers compiles it: a jinja2 immutable sandbox with
    trim_blocks, lstrip_blocks and loop controls, a `tojson` that keeps non-ASCII characters, and
    the `raise_exception` and `strftime_now` helpers the published templates call."""
    import datetime
    import json

    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
    return env.from_string(source)


SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# tokenizer_config.json keys TemplateTokenizer reproduces (or that change nothing it does); any
# other key, or one of these with another value than it assumes, keeps transformers' class
PLAIN_CONFIG_KEYS = frozenset(SPECIAL_TOKEN_NAMES) | {
    "tokenizer_class", "backend", "model_max_length", "is_local", "local_files_only", "chat_template",
    "add_prefix_space", "clean_up_tokenization_spaces", "added_tokens_decoder", "padding_side",
    "split_special_tokens",
}


def plain_config(config: dict) -> dict[str, str] | None:
    """The special tokens ({"eos_token": text, ...}) of a tokenizer_config.json that TemplateTokenizer
    reproduces exactly; None where it asks for more (clean-up of decoded spaces, a prefix space,
    special tokens split as text, named chat templates, special tokens with options, keys it does
    not know)."""
    if set(config) - PLAIN_CONFIG_KEYS or config.get("clean_up_tokenization_spaces") or \
            config.get("add_prefix_space") or config.get("split_special_tokens") or \
            not isinstance(config.get("chat_template", ""), str):
        return None
    specials = {name: config[name] for name in SPECIAL_TOKEN_NAMES if config.get(name) is not None}
    if not all(isinstance(token, str) for token in specials.values()):  # AddedToken dicts: transformers' class
        return None
    return specials
