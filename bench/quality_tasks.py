"""Held-out text, perplexity through the decode path, and the needle-in-a-haystack grid.

Shape legend: T tokens, V vocabulary.

Both tasks follow the decode-path rule (reference/peers-and-evaluation.md §5): the material
is prefilled densely once, then what the method must answer from is fed one token at a time
through its sparse policy. The dense prefill is shared: each method decodes from a copy of
the same K/V with its own key codes (quality_methods.cache_for).
"""
from __future__ import annotations

import torch

from spotlight.attention import DenseDecode, SpotlightDecode
from spotlight.cache import KVCache
from spotlight.corpus import essays

from .quality_methods import cache_for

NEEDLE = "The special magic number for the city of Lisbon is 7481."
QUESTION = "What is the special magic number for the city of Lisbon?"
ANSWER = "7481"
_PREFILL_CHUNK = 512


def essay_ids(engine) -> list[int]:
    """Every Paul Graham essay (held out from training), in file order, as one token stream."""
    return engine.encode("\n\n".join(doc.text for doc in essays()))


def prefill(model, ids: list[int], capacity: int, policy=None) -> KVCache:
    """Dense chunked prefill into a fresh cache without codes (a policy only listens)."""
    cache = KVCache(model.args, capacity, dtype=model.tok_embeddings.weight.dtype)
    with torch.inference_mode():
        for start in range(0, len(ids), _PREFILL_CHUNK):
            model(torch.tensor(ids[start : start + _PREFILL_CHUNK]), cache, policy or DenseDecode())
    return cache


def policy_for(method, config):
    return DenseDecode() if method is None else SpotlightDecode(config, method.selector)


# ----------------------------------------------------------------------------- perplexity


def perplexity(model, docs: list[list[int]], prefix: int, runs: dict, per_doc: list | None = None) -> dict:
    """Mean NLL per run over the tokens after `prefix` of each doc, fed one at a time.

    runs: name -> (Method or None for dense attention, SpotlightConfig). Every doc holds
    prefix + T + 1 tokens; the T predictions come from decode steps only (the prefill's
    last logits are not scored). `per_doc`, when given, receives each doc's mean NLL per run.
    """
    nll = dict.fromkeys(runs, 0.0)
    count = 0
    for doc in docs:
        before = dict(nll)
        base = prefill(model, doc[:prefix], len(doc) + 8)
        targets = torch.tensor(doc[prefix + 1 :])  # (T,)
        for name, (method, config) in runs.items():
            cache = cache_for(method, base, len(doc) + 8)
            policy = policy_for(method, config)
            with torch.inference_mode():
                for t, token in enumerate(doc[prefix:-1]):
                    logits = model(torch.tensor([token]), cache, policy)  # (V,)
                    nll[name] += float(torch.logsumexp(logits, -1) - logits[targets[t]])
        count += len(targets)
        if per_doc is not None:
            per_doc.append({name: (nll[name] - before[name]) / len(targets) for name in runs})
    return {name: total / count for name, total in nll.items()}


# ----------------------------------------------------------------------------- needle


def needle_prompt(engine, hay: list[int], length: int, depth: float) -> tuple[list[int], list[int]]:
    """(prefix, suffix) token ids of a chat prompt of `length` tokens with the needle at `depth`.

    prefix = template head + haystack with the needle (prefilled densely); suffix = the
    question and the template's tail up to the assistant turn (decoded through the policy).
    """
    head_ids, tail_ids = chat_frame(engine, QUESTION)
    needle_ids = engine.encode(" " + NEEDLE + " ")
    room = length - len(head_ids) - len(tail_ids) - len(needle_ids)
    body = hay[:room]
    at = sentence_start(engine, body, int(depth * len(body)))
    return head_ids + body[:at] + needle_ids + body[at:], tail_ids


def chat_frame(engine, question: str) -> tuple[list[int], list[int]]:
    """(head, tail) token ids of a one-turn chat prompt "<document>\n\n<question>": the template
    before the document, and from the end of the document to the assistant turn."""
    marker = "@@HAYSTACK@@"
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": f"{marker}\n\n{question}"}],
                                                tokenize=False, add_generation_prompt=True)
    head, tail = text.split(marker)
    return engine.encode(head), engine.encode(tail)


def sentence_start(engine, ids: list[int], at: int) -> int:
    """The first position at or before `at` that follows a token ending a sentence."""
    while at > 0 and not engine.tokenizer.decode(ids[at - 1 : at]).rstrip().endswith((".", "?", "!")):
        at -= 1
    return at


def answer(model, engine, base: KVCache, suffix: list[int], method, config, new_tokens: int) -> str:
    """Feed the suffix one token at a time, then decode greedily; the generated text."""
    cache = cache_for(method, base, base.length + len(suffix) + new_tokens + 8)
    policy = policy_for(method, config)
    eos = engine.eos_ids
    out: list[int] = []
    with torch.inference_mode():
        for token in suffix:
            logits = model(torch.tensor([token]), cache, policy)  # (V,)
        for _ in range(new_tokens):
            token = int(logits.argmax())
            if token in eos:
                break
            out.append(token)
            logits = model(torch.tensor([token]), cache, policy)
    return engine.decode(out)


def needle_grid(engine, lengths, depths, methods: dict, config, new_tokens: int, log) -> list[dict]:
    """One row per (length, depth, method): whether the answer holds the magic number.
    `methods`: name -> method, or name -> (method, its own SpotlightConfig) for budget sweeps."""
    hay = essay_ids(engine)
    rows = []
    for length in lengths:
        for depth in depths:
            prefix, suffix = needle_prompt(engine, hay, length - new_tokens, depth)
            base = prefill(engine.model, prefix, len(prefix) + 1)
            for name, method in methods.items():
                method, own = method if isinstance(method, tuple) else (method, config)
                text = answer(engine.model, engine, base, suffix, method, own, new_tokens)
                rows.append({"length": length, "depth": depth, "method": name, "found": ANSWER in text,
                             "answer": text.strip().replace("\n", " ")[:60]})
                log(f"needle {length} {depth:.1f} {name}: {ANSWER in text} {text.strip()[:60]!r}")
    return rows
