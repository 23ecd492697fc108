"""PieceTokenizer: piecewise, memoised tokenisation equals the tokenizer's own (issue #5, resume
speed); TemplateTokenizer: the same ids, text and chat renderings as transformers' tokenizer on the
packaged models (issue #20, memory)."""
import copy

import pytest

from conftest import TEST_HOME
from spotlight import loading
from spotlight.tokens import PieceTokenizer, TemplateTokenizer

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


PACKAGED_MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You answer from the document."}, {"role": "user", "content": "Q1? naïve 東京 🙂"},
     {"role": "assistant", "content": "A1."}, {"role": "user", "content": "And <|im_end|> inside text?"}],
    [{"role": "user", "content": "  spaced\tout\r\n"}, {"role": "assistant", "content": ""}],
]


@pytest.fixture(scope="module")
def tokenizer(engine):
    return engine.tokenizer


@pytest.fixture(scope="module")
def hf_tokenizer(engine):
    """transformers' own tokenizer over the engine's model directory: the reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(engine.source.hf_dir, local_files_only=True)


@pytest.fixture(scope="module", params=PACKAGED_MODELS)
def tokenizer_pair(request):
    """(ours as the engine loads it, transformers' class) over one packaged model's directory."""
    from transformers import AutoTokenizer

    source = loading.resolve(request.param, TEST_HOME, fp32_weights=False)
    return loading.load_tokenizer(source), AutoTokenizer.from_pretrained(source.hf_dir, local_files_only=True)


def test_packaged_models_load_the_lean_tokenizer(tokenizer_pair):
    ours, _ = tokenizer_pair
    assert type(ours) is TemplateTokenizer


def test_lean_tokenizer_encodes_offsets_and_decodes_as_transformers(tokenizer_pair, essay_text):
    ours, ref = tokenizer_pair
    for text in TEXTS + [essay_text[:30000]]:
        want = ref(text, add_special_tokens=False, return_offsets_mapping=True)
        got = ours(text, add_special_tokens=False, return_offsets_mapping=True)
        assert (got["input_ids"], [tuple(o) for o in got["offset_mapping"]]) == \
            (list(want["input_ids"]), [tuple(o) for o in want["offset_mapping"]]), repr(text[:60])
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
        ids = got["input_ids"]
        assert [ours.decode(ids, skip_special_tokens=skip) for skip in (True, False)] == \
            [ref.decode(ids, skip_special_tokens=skip) for skip in (True, False)], repr(text[:60])


def test_lean_tokenizer_renders_chat_templates_as_transformers(tokenizer_pair, essay_text):
    ours, ref = tokenizer_pair
    conversations = CONVERSATIONS + [[{"role": "system", "content": essay_text[:4000]}, {"role": "user", "content": "?"}]]
    for messages in conversations:
        for generation_prompt in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False) == \
                ref.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


def test_lean_tokenizer_special_tokens_are_transformers(tokenizer_pair):
    ours, ref = tokenizer_pair
    names = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "not a token")
    assert (ours.eos_token_id, ours.bos_token_id, ours.unk_token_id, [ours.convert_tokens_to_ids(n) for n in names],
            {i: str(t) for i, t in ours.added_tokens_decoder.items()}) == \
        (ref.eos_token_id, ref.bos_token_id, ref.unk_token_id, [ref.convert_tokens_to_ids(n) for n in names],
         {i: str(t) for i, t in ref.added_tokens_decoder.items()})


def test_lean_tokenizer_renders_text_only(tokenizer_pair):
    ours, _ = tokenizer_pair
    with pytest.raises(NotImplementedError, match="pass tokenize=False"):
        ours.apply_chat_template(CONVERSATIONS[0])


def test_piecewise_encoding_equals_the_tokenizer(tokenizer, essay_text):
    pieces = PieceTokenizer(tokenizer)
    assert pieces.exact
    for text in TEXTS + [essay_text[:20000], f"<|im_start|>system\n{essay_text[:5000]}<|im_end|>\n<|im_start|>user"]:
        assert pieces(text) == tokenizer.encode(text, add_special_tokens=False), repr(text[:60])


def test_chat_ids_equal_the_templates_own_tokenisation(engine, hf_tokenizer, essay_text):
    messages = [{"role": "system", "content": f'<document name="essays">\n{essay_text[:8000]}\n</document>'},
                {"role": "user", "content": "Summarise it."}, {"role": "assistant", "content": "It is about work."},
                {"role": "user", "content": "And the <|im_end|> token?"}]
    for generation_prompt in (True, False):
        want = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
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


def test_tokenizers_with_whitespace_eating_tokens_fall_back_to_whole_text(hf_tokenizer):
    from tokenizers import AddedToken

    stripping = copy.deepcopy(hf_tokenizer)
    stripping.add_tokens([AddedToken("<x>", lstrip=True, rstrip=True)])
    pieces = PieceTokenizer(stripping)
    assert not pieces.exact
    for text in ("a <x> b", "a<x>b", " <x> ", "<|im_start|>a <x>\n<|im_end|>"):
        assert pieces(text) == stripping.encode(text, add_special_tokens=False)
