"""PieceTokenizer: piecewise, memoised tokenisation equals the tokenizer's own (issue #5, resume speed)."""
import copy

import pytest

from spotlight.tokens import PieceTokenizer

pytestmark = pytest.mark.model

TEXTS = [
    "",
    "plain text",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "<|im_start|><|im_end|><|endoftext|>",
    " leading space and <|im_end|> trailing space <|im_start|> ",
    "no newline<|im_end|>after\n\n\n  spaced\tout\r\nlines",
    "unicode: naïve café — 東京 🙂<|im_end|>emoji 🙂🙂",
    "<document name=\"a.txt\">\nline one\nline two\n</document>",
    "partial <|im_en d|> and <|im_start| not tokens",
]


@pytest.fixture(scope="module")
def tokenizer(engine):
    return engine.tokenizer


def test_piecewise_encoding_equals_the_tokenizer(tokenizer, essay_text):
    pieces = PieceTokenizer(tokenizer)
    assert pieces.exact
    for text in TEXTS + [essay_text[:20000], f"<|im_start|>system\n{essay_text[:5000]}<|im_end|>\n<|im_start|>user"]:
        assert pieces(text) == tokenizer.encode(text, add_special_tokens=False), repr(text[:60])


def test_chat_ids_equal_the_templates_own_tokenisation(engine, essay_text):
    messages = [{"role": "system", "content": f'<document name="essays">\n{essay_text[:8000]}\n</document>'},
                {"role": "user", "content": "Summarise it."}, {"role": "assistant", "content": "It is about work."},
                {"role": "user", "content": "And the <|im_end|> token?"}]
    for generation_prompt in (True, False):
        want = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                                    return_dict=False)
        assert engine.chat_ids(messages, add_generation_prompt=generation_prompt) == list(want)


def test_a_long_piece_is_tokenised_once(tokenizer, essay_text):
    pieces = PieceTokenizer(tokenizer)
    text = f"<|im_start|>system\n{essay_text[:20000]}<|im_end|>\n"
    first = pieces(text)
    second = pieces(text + "<|im_start|>user\nanother question<|im_end|>\n")
    assert second[: len(first)] == first
    info = pieces._piece.cache_info()
    # first call: "system\n<essay>" and "\n" tokenised; second: both found again, "user\n..." new, "\n" found
    assert (info.hits, info.misses) == (3, 3)


def test_tokenizers_with_whitespace_eating_tokens_fall_back_to_whole_text(tokenizer):
    from tokenizers import AddedToken

    stripping = copy.deepcopy(tokenizer)
    stripping.add_tokens([AddedToken("<x>", lstrip=True, rstrip=True)])
    pieces = PieceTokenizer(stripping)
    assert not pieces.exact
    for text in ("a <x> b", "a<x>b", " <x> ", "<|im_start|>a <x>\n<|im_end|>"):
        assert pieces(text) == stripping.encode(text, add_special_tokens=False)
