"""Generation: greedy parity with transformers, sampling, stop, cancel, truncate. Issue #2."""
import threading

import pytest
import torch

from conftest import tiny_pair
from spotlight.attention import DenseDecode
from spotlight.cache import KVCache
from spotlight.config import SamplingConfig
from spotlight.generate import Context, Sampler, TextStream, stream


class ByteTokenizer:
    """Token i is the character chr(32 + i % 95); enough to drive the text stream."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(32 + i % 95) for i in ids)


def run(model, context, prompt, sampling, **kw):
    steps = list(stream(model, ByteTokenizer(), context, prompt, DenseDecode(), sampling,
                        eos_ids=kw.pop("eos_ids", set()), max_context=kw.pop("max_context", 512), **kw))
    return [s.token for s in steps if s.token is not None], steps[-1]


def new_context(model):
    return Context(KVCache(model.args, 64))


@pytest.mark.model
def test_greedy_generation_equals_transformers_generate(engine, reference_model, essay_text):
    ids = engine.encode(essay_text[:2000])  # plain completion: no early end of turn
    context = engine.new_context()
    sampling = SamplingConfig(max_new_tokens=32)
    ours = [s.token for s in engine.stream(context, ids, sampling) if s.token is not None]
    with torch.inference_mode():
        theirs = reference_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
    assert ours == theirs[0, len(ids):].tolist()
    assert len(ours) == 32


@pytest.mark.model
def test_greedy_with_repetition_penalty_equals_transformers(engine, reference_model):
    ids = engine.chat_ids([{"role": "user", "content": "List the days of the week."}])
    sampling = SamplingConfig(max_new_tokens=24, repetition_penalty=1.3)
    ours = [s.token for s in engine.stream(engine.new_context(), ids, sampling) if s.token is not None]
    with torch.inference_mode():
        theirs = reference_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                          repetition_penalty=1.3)[0, len(ids):].tolist()
    if theirs[-1] in engine.eos_ids:
        theirs = theirs[:-1]  # we do not report the end-of-turn token itself
    assert ours == theirs


def test_truncate_then_regenerate_equals_fresh_generation():
    _, model = tiny_pair("llama", seed=5)
    prompt = list(range(10, 60))
    sampling = SamplingConfig(max_new_tokens=12)
    fresh, _ = run(model, new_context(model), prompt, sampling)
    context = new_context(model)
    run(model, context, prompt + [3, 4, 5, 6], sampling)  # a different turn first
    again, last = run(model, context, prompt, sampling)  # reuses the common prefix, truncates the rest
    assert again == fresh
    assert last.stats.cached_tokens == len(prompt) - 1


def test_cancel_stops_within_one_step():
    _, model = tiny_pair("llama", seed=6)
    cancel = threading.Event()
    context = new_context(model)
    tokens = []
    for step in stream(model, ByteTokenizer(), context, list(range(20)), DenseDecode(),
                       SamplingConfig(max_new_tokens=100), eos_ids=set(), max_context=512, cancel=cancel):
        if step.token is not None:
            tokens.append(step.token)
            if len(tokens) == 3:
                cancel.set()
        last = step
    assert len(tokens) == 3
    assert last.finish == "cancelled"


def test_cancel_between_prefill_chunks_keeps_a_consistent_cache():
    _, model = tiny_pair("llama", seed=7)
    cancel = threading.Event()
    seen = []

    def progress(done, total):
        seen.append(done)
        if done == 16:
            cancel.set()

    context = new_context(model)
    _, last = run(model, context, list(range(64)), SamplingConfig(max_new_tokens=4),
                  chunk=16, cancel=cancel, progress=progress)
    assert last.finish == "cancelled"
    assert seen == [16]
    assert context.cache.length == len(context.tokens) == 16


def test_eos_and_max_new_tokens_and_stop_strings():
    _, model = tiny_pair("llama", seed=8)
    greedy, last = run(model, new_context(model), list(range(30)), SamplingConfig(max_new_tokens=8))
    assert len(greedy) == 8 and last.finish == "length"
    tokens, last = run(model, new_context(model), list(range(30)), SamplingConfig(max_new_tokens=8),
                       eos_ids={greedy[2]})
    assert tokens == greedy[: greedy.index(greedy[2])] and last.finish == "eos"
    stop = ByteTokenizer().decode(greedy[3:5])
    steps = list(stream(model, ByteTokenizer(), new_context(model), list(range(30)), DenseDecode(),
                        SamplingConfig(max_new_tokens=8, stop_strings=(stop,)), eos_ids=set(), max_context=512))
    text = "".join(s.text for s in steps)
    assert steps[-1].finish == "stop"
    assert stop not in text and text == ByteTokenizer().decode(greedy)[: ByteTokenizer().decode(greedy).find(stop)]


def test_prompt_longer_than_context_names_the_limit():
    from spotlight.errors import ContextTooLong

    _, model = tiny_pair("llama")
    with pytest.raises(ContextTooLong, match="at most 40 fit this conversation"):
        run(model, new_context(model), list(range(50)), SamplingConfig(), max_context=40)


def test_sampler_top_k_one_is_greedy_and_seed_is_deterministic():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    top1 = Sampler(SamplingConfig(temperature=1.0, top_k=1, seed=1), 50, [])
    assert [top1(logits) for _ in range(5)] == [int(logits.argmax())] * 5
    draws = [[Sampler(SamplingConfig(temperature=0.8, top_p=0.9, seed=7), 50, [])(logits) for _ in range(3)]
             for _ in range(2)]
    assert draws[0] == draws[1]


def test_sampler_top_p_keeps_only_the_nucleus():
    logits = torch.tensor([5.0, 4.0, -10.0, -10.0])
    sampler = Sampler(SamplingConfig(temperature=1.0, top_p=0.5, seed=0), 4, [])
    assert {sampler(logits) for _ in range(20)} == {0}


def test_repetition_penalty_pushes_seen_tokens_down():
    logits = torch.tensor([2.0, 1.9, -1.0])
    assert Sampler(SamplingConfig(repetition_penalty=2.0), 3, [0])(logits) == 1


def test_text_stream_holds_back_partial_stop_strings():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(ids)

    text = TextStream(Tok(), ("END",))
    shown = [text.add(piece) for piece in ["Hello ", "E", "N", "D"]]
    assert shown == [("Hell", False), ("o", False), (" ", False), ("", True)]
    assert text.text == "Hello "


def test_invalid_sampling_values_are_rejected_with_the_fix():
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingConfig(temperature=-1)
