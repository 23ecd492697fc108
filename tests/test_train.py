"""Encoder training (Bradley–Terry ranking loss), its checkpoints and its input checks. Issue #4."""
import pytest
import torch

from conftest import TEST_HOME, TEST_MODEL, tiny_pair
from spotlight import corpus
from spotlight.errors import ContextTooLong, CorpusEmpty, EncoderMismatch, TooMuchMemory
from spotlight.hashing import EncoderSpec, Encoders, load_encoders
from spotlight.train import (LayerMLP, LayerwiseTraining, TrainConfig, check_memory, code_recall, main,
                             memory_estimate, parse_layers, record, tie_hyperplanes)

# A tiny random model: 2 layers, 4 query / 2 KV heads, head dim 16, 512 positions.
TINY = dict(seq_len=256, sequences=4, min_query=96, sinks=4, window=16, stride=2, top_fraction=0.05,
            queries=32, tops=8, others=64, hard_others=0, mined_others=0, bits=32, width=32, lr=1e-2,
            beta=1.0,  # 32-bit codes: the paper's scale shows progress within the few steps a test runs
            top_distance_power=0.0)  # uniform tops: random tokens have no distant facts to favour


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is fastest, and immune to a busy second core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny():
    """(model, recordings of 24 training sequences, of 2 held-out ones): random tokens."""
    _, model = tiny_pair("llama", max_position_embeddings=512)
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(211, (256,), generator=generator).tolist() for _ in range(26)]
    config = TrainConfig(**TINY)
    layers = tuple(range(model.args.n_layers))
    return model, record(model, sequences[:24], config, layers), record(model, sequences[24:], config, layers)


def new_training(model, data, **overrides) -> LayerwiseTraining:
    config = TrainConfig(**{**TINY, **overrides})
    spec = EncoderSpec.for_model(model.args, config.bits, depth=config.depth, width=config.width)
    encoders = tie_hyperplanes(Encoders(spec, seed=config.seed, model_fingerprint="tiny-model"))
    return LayerwiseTraining(encoders, data, config)


def recall(training: LayerwiseTraining, data) -> torch.Tensor:
    encoders = training.finished_encoders()
    layers = data.layers
    return code_recall(LayerMLP(encoders.query, layers), LayerMLP(encoders.key, layers), data, training.config)


def test_recording_holds_post_rope_qk_and_exact_targets(tiny):
    model, data, _ = tiny
    config = TrainConfig(**TINY)
    S, L, H, Pn, D = data.q.shape
    assert (S, L, H, D) == (24, 2, 4, 16) and data.k.shape == (24, 2, 2, 256, 16)
    assert data.ranked.shape == (24, 2, 2, Pn, config.ranked)
    # Every ranked key lies in the query's middle: after the sinks, before its window.
    pos = data.positions[:, None, None, :, None]  # (S, 1, 1, Pn, 1)
    assert bool((data.ranked >= config.sinks).all()) and bool((data.ranked.long() <= pos - config.window).all())


def test_loss_decreases_in_a_few_steps(tiny):
    model, data, _ = tiny
    history = new_training(model, data, steps=100, group=0).run()
    first, last = sum(history.loss[:10]) / 10, sum(history.loss[-10:]) / 10
    assert last < 0.75 * first, (first, last)  # observed 0.295 -> 0.176
    assert sum(history.misordered[-10:]) < sum(history.misordered[:10])


def test_trained_encoder_beats_untrained_on_held_out_recall(tiny):
    model, data, held_out = tiny
    training = new_training(model, data, steps=150, group=0)
    before = recall(training, held_out)
    training.run()
    after = recall(training, held_out)
    assert float(after.mean()) > float(before.mean()) + 0.025, (before, after)  # observed 0.367 -> 0.413


def test_checkpoint_round_trip_carries_fingerprint_and_provenance(tiny, tmp_path):
    model, data, _ = tiny
    training = new_training(model, data, steps=5)
    training.run()
    encoders = training.finished_encoders()
    encoders.provenance = {"trained": True, "steps": 5, "corpus": "random tokens"}
    path = tmp_path / "tiny.safetensors"
    encoders.save(path, dtype=torch.float16)
    back = load_encoders(path, model_fingerprint="tiny-model", bits=32)
    assert back.spec == encoders.spec and back.trained
    assert back.provenance == {"trained": True, "steps": 5, "corpus": "random tokens"}
    assert back.model_fingerprint == "tiny-model"
    for (name, a), (_, b) in zip(encoders.state_dict().items(), back.state_dict().items()):
        torch.testing.assert_close(b, a.half().float(), rtol=0, atol=0, msg=name)  # exactly the fp16 values
    with pytest.raises(EncoderMismatch, match="trained for model 'tiny-model'"):
        load_encoders(path, model_fingerprint="another-model")


def test_every_layer_is_trained_and_written_back(tiny):
    model, data, _ = tiny
    training = new_training(model, data, steps=3, group=1)
    untrained = {k: v.clone() for k, v in training.encoders.state_dict().items()}
    training.run()
    encoders = training.finished_encoders()
    for layer in range(2):
        assert not torch.equal(encoders.query.w_out[layer], untrained["query.w_out"][layer])
        assert not torch.equal(encoders.key.w1[layer], untrained["key.w1"][layer])


def test_batched_layers_compute_what_the_encoders_compute(tiny):
    model, data, _ = tiny
    training = new_training(model, data, steps=3, group=0)
    training.run()
    encoders = training.finished_encoders()
    x = torch.randn(2, 4, 7, 16)  # (L, H, T, D)
    batched = LayerMLP(encoders.query, (0, 1))(x)
    for layer in range(2):
        torch.testing.assert_close(encoders.query_bits(layer, x[layer]), batched[layer], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stop", [7, 10, 13])  # inside the first group, at its end, inside the second
def test_resume_gives_the_same_result_as_an_uninterrupted_run(tiny, tmp_path, stop):
    model, data, _ = tiny
    straight = new_training(model, data, steps=10, group=1)
    straight.run()
    interrupted = new_training(model, data, steps=10, group=1)
    interrupted.run(stop_at=stop)
    interrupted.save_state(tmp_path / "state.pt")
    resumed = new_training(model, data, steps=10, group=1)
    resumed.load_state(tmp_path / "state.pt")
    assert resumed.step == stop
    resumed.run()
    assert resumed.history == straight.history
    for (name, a), (_, b) in zip(straight.finished_encoders().state_dict().items(),
                                 resumed.finished_encoders().state_dict().items()):
        assert torch.equal(a, b), name


def test_resume_with_other_settings_is_refused(tiny, tmp_path):
    model, data, _ = tiny
    training = new_training(model, data, steps=20)
    training.run(stop_at=2)
    training.save_state(tmp_path / "state.pt")
    other = new_training(model, data, steps=20, lr=5e-3)
    with pytest.raises(EncoderMismatch, match="other settings"):
        other.load_state(tmp_path / "state.pt")


def test_linear_baseline_trains_only_its_projection(tiny):
    model, data, _ = tiny
    training = new_training(model, data, steps=10, depth=0, group=0)
    training.run(stop_at=1)
    assert [name for name, _ in training.trainer.query.named_parameters()] == ["w_out"]
    training.run()
    encoders = training.finished_encoders()
    assert torch.equal(encoders.query.w2, torch.zeros_like(encoders.query.w2))  # unused by depth 0, left alone


def test_tied_hyperplanes_make_simhash_codes_of_equal_vectors_agree():
    spec = EncoderSpec(bits=128, head_dim=16, n_layers=2, n_heads=4, n_kv_heads=2, depth=0, init="random")
    encoders = tie_hyperplanes(Encoders(spec, seed=3))
    x = torch.randn(2, 5, 16)  # the same vectors as keys of both KV heads
    q = x.repeat_interleave(2, dim=0)  # (H, T, D): each query head sees its KV head's vectors
    keys = encoders.key_bits(1, x) > 0  # (Hkv, T, C)
    assert torch.equal(encoders.query_bits(1, q) > 0, keys.repeat_interleave(2, dim=0))


# ----------------------------------------------------------------------------- bad input


def test_memory_estimate_refuses_with_a_suggestion():
    _, model = tiny_pair("llama")
    estimate = memory_estimate(model.args, TrainConfig(seq_len=8192, sequences=512), n_layers=2)
    with pytest.raises(TooMuchMemory, match="lower --sequences or --seq-len"):
        check_memory(estimate, available=4 * 2**30)
    check_memory(memory_estimate(model.args, TrainConfig(**TINY), n_layers=2), available=4 * 2**30)


def test_corpus_without_usable_text_is_refused(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.md").write_text("too short")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00\x81" * 100)
    with pytest.raises(CorpusEmpty, match="no usable text"):
        corpus.load_corpus(str(tmp_path))
    with pytest.raises(CorpusEmpty, match="does not exist"):
        corpus.load_corpus(str(tmp_path / "missing"))


def test_packaged_corpora_are_read_as_files():
    plays = corpus.shakespeare()
    assert len(plays) == 42 and all(d.source.endswith("_gut.txt") for d in plays)  # modern spelling only
    books = corpus.kjv()
    assert len(books) == 66 and books[0].text.startswith("Genesis")
    assert len(corpus.essays()) == 49


def test_token_windows_alternate_parts_and_are_deterministic():
    parts = {"a": [corpus.Document("a1", "a1", "x" * 300), corpus.Document("a2", "a2", "y" * 300)],
             "b": [corpus.Document("b1", "b1", "z" * 900)]}
    encode = lambda text: [ord(c) for c in text]  # noqa: E731
    windows, sources = corpus.token_windows(parts, encode, 3, 250, seed=5)
    assert [s["part"] for s in sources] == ["a", "b", "a"]
    assert all(len(w) == 250 for w in windows)
    assert corpus.token_windows(parts, encode, 3, 250, seed=5) == (windows, sources)
    with pytest.raises(CorpusEmpty, match="reaches 1000 tokens"):
        corpus.token_windows(parts, encode, 1, 1000, seed=5)


def test_bad_layer_lists_are_refused():
    assert parse_layers("2-4,7", 8) == (2, 3, 4, 7)
    with pytest.raises(ValueError, match="layers 0-7"):
        parse_layers("6-9", 8)
    with pytest.raises(ValueError, match="write layers like"):
        parse_layers("two", 8)


@pytest.mark.model
@pytest.mark.parametrize("argv,message", [
    (["--seq-len", "9000"], "exceeds the model's context window of 8192"),
    (["--sequences", "100000", "--seq-len", "8192"], "lower --sequences or --seq-len"),
    (["--corpus", "{empty}"], "no usable text"),
    (["--top-distance-power", "-1"], "top_distance_power must be >= 0"),
])
def test_cli_refuses_bad_input_before_long_work(argv, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("SPOTLIGHT_HOME", str(TEST_HOME))
    argv = [a.replace("{empty}", str(tmp_path / "empty")) for a in argv]
    assert main(["--model", TEST_MODEL, "--out", str(tmp_path / "x.safetensors"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()


def test_context_too_long_is_a_value_error():
    assert issubclass(ContextTooLong, ValueError) and issubclass(TooMuchMemory, ValueError)
    assert issubclass(CorpusEmpty, ValueError)


def test_layer_mlp_of_depth_zero_is_the_projection():
    spec = EncoderSpec(bits=32, head_dim=16, n_layers=3, n_heads=4, n_kv_heads=2, depth=0, init="random")
    encoders = Encoders(spec)
    mlp = LayerMLP(encoders.key, (0, 2))
    x = torch.randn(2, 2, 5, 16)
    torch.testing.assert_close(mlp(x)[1], encoders.key_bits(2, x[1]))


def test_rope_shift_gives_the_vectors_of_later_positions():
    from spotlight.model import apply_rope, rope_table
    from spotlight.train import rope_shift

    inv_freq = 1.0 / (1e4 ** (torch.arange(0, 16, 2).float() / 16))
    cos, sin = rope_table(inv_freq, 600)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([0, 3, 40, 100, 255])
    shifted = rope_shift(apply_rope(x, cos[positions], sin[positions]), 300, inv_freq)
    # fp32 angles near position 555 are rounded to ~3e-5 rad, so two rotations differ from one by that much
    torch.testing.assert_close(shifted, apply_rope(x, cos[positions + 300], sin[positions + 300]), rtol=0, atol=1e-4)


def test_training_with_position_shifts_runs_and_learns(tiny):
    model, data, _ = tiny
    history = new_training(model, data, steps=60, group=0, max_position=512).run()
    assert sum(history.loss[-10:]) < sum(history.loss[:10])


def test_training_with_distance_weighted_tops_runs_and_learns(tiny):
    model, data, _ = tiny
    history = new_training(model, data, steps=60, group=0, top_distance_power=1.5).run()
    assert sum(history.loss[-10:]) < sum(history.loss[:10])


def in_top_sets(data, config, batch, keys: torch.Tensor) -> torch.Tensor:
    """keys (L, Hkv, Q, X) -> bool (L, Hkv, Q, X): the key is in its query's exact top set."""
    m = config.top_count(data.positions[batch.seq, batch.query] + 1).view(1, 1, -1, 1)
    ranked = data.ranked[batch.seq][:, :, batch.query].long()  # (L, Hkv, Q, M)
    rank = torch.arange(ranked.shape[-1]).view(1, 1, 1, -1)
    return ((ranked.unsqueeze(-2) == keys.unsqueeze(-1)) & (rank < m).unsqueeze(-2)).any(-1)


def test_sampled_pairs_respect_the_top_sets(tiny):
    from spotlight.train import sample_batch

    _, data, _ = tiny
    config = TrainConfig(**{**TINY, "hard_others": 4})
    batch = sample_batch(data, config, torch.Generator().manual_seed(0))
    n = data.positions[batch.seq, batch.query] + 1  # (Q,)
    in_top = lambda keys: in_top_sets(data, config, batch, keys)  # noqa: E731
    assert bool(in_top(batch.top).all()), "every top key is in its query's top set"
    assert not bool(in_top(batch.hard).any()), "hard others rank below the top set"
    shared = batch.shared.view(1, 1, 1, -1).expand_as(batch.valid)
    assert torch.equal(batch.valid, ~in_top(shared)), "a shared key is a valid other exactly when it is no top key"
    assert bool((batch.shared < int(n[0]) - config.window).all()) and bool((batch.shared >= config.sinks).all())


def test_distance_power_draws_distant_top_keys_more_often_and_only_from_the_top_sets(tiny):
    from spotlight.train import sample_batch

    _, data, _ = tiny

    def draws(power):
        config = TrainConfig(**{**TINY, "top_distance_power": power})
        generator = torch.Generator().manual_seed(0)
        batches = [sample_batch(data, config, generator) for _ in range(20)]
        for batch in batches:
            assert bool(in_top_sets(data, config, batch, batch.top).all()), \
                f"power {power}: every top key is in its query's top set"
        distance = [(data.positions[b.seq, b.query].view(1, 1, -1, 1) - b.top).float().mean() for b in batches]
        return float(torch.stack(distance).mean())

    uniform, far = draws(0.0), draws(2.0)
    assert far > 1.2 * uniform, (far, uniform)


def test_mined_others_are_the_codes_best_keys_outside_the_near_and_forced_ones(tiny):
    from spotlight.train import mine_others, sample_batch

    model, data, _ = tiny
    config = TrainConfig(**{**TINY, "mined_others": 5})
    training = new_training(model, data, mined_others=5)
    layers = data.layers
    query, key = LayerMLP(training.encoders.query, layers), LayerMLP(training.encoders.key, layers)
    batch = sample_batch(data, config, torch.Generator().manual_seed(0))
    mined = mine_others(query, key, data, batch, config, "cpu")  # (L, Hkv, Q, Pm)
    L, Hkv, Q, M = data.ranked[batch.seq][:, :, batch.query].shape
    assert mined.shape == (L, Hkv, Q, 5)
    # Brute force: every middle key outside the ranked M, scored by group-summed matching sign bits.
    q = data.q[batch.seq][:, :, batch.query].float()  # (L, H, Q, D)
    sq = torch.sign(query(q)).view(L, Hkv, -1, Q, config.bits).sum(2)  # (L, Hkv, Q, C)
    sk = torch.sign(key(data.k[batch.seq].float()))  # (L, Hkv, T, C)
    last = data.positions[batch.seq, batch.query]  # (Q,)
    for layer in range(L):
        for head in range(Hkv):
            for i in range(Q):
                near = 4 * int(config.top_count(last[i] + 1))  # the top set and the ranks just below it
                ranked = set(data.ranked[batch.seq, layer, head, batch.query[i], :near].tolist())
                allowed = [j for j in range(config.sinks, int(last[i]) - config.window + 1) if j not in ranked]
                scores = {j: float(sq[layer, head, i] @ sk[layer, head, j]) for j in allowed}
                picked = mined[layer, head, i].tolist()
                assert len(set(picked)) == 5 and set(picked) <= set(allowed)
                best_left_out = max(s for j, s in scores.items() if j not in picked)
                assert min(scores[j] for j in picked) >= best_left_out


def test_training_with_mined_others_runs_and_learns(tiny):
    model, data, _ = tiny
    history = new_training(model, data, steps=40, group=0, mined_others=4).run()
    assert sum(history.loss[-10:]) < sum(history.loss[:10])


def test_more_mined_others_than_the_first_query_can_have_is_refused():
    # the first query sees 513 tokens: less the window 256, the sinks 4 and its best 4 * 10 keys
    with pytest.raises(ValueError, match="--mined-others 1000 exceeds the 213 keys"):
        TrainConfig(mined_others=1000)


# (checkpoint, the command it records, the model's window, its layers): SmolLM2's was trained
# when it was the default (no --model), Qwen2.5's with --model named
SHIPPED = [
    ("smollm2-135m-instruct-128b.safetensors", "python -m spotlight.train --out spotlight/checkpoints/", 8192, 30),
    ("qwen2.5-coder-0.5b-instruct-128b.safetensors",
     "python -m spotlight.train --model qwen2.5-coder-0.5b-instruct --out spotlight/checkpoints/", 32768, 24),
]


@pytest.mark.parametrize("name, command, window, layers", SHIPPED)
def test_the_shipped_checkpoint_is_what_the_documented_command_trains(name, command, window, layers):
    """docs/DECISIONS.md names one command with every option at its default: the shipped file's
    recorded settings must be those defaults (retrain after changing one), on the training corpora only."""
    import json
    from dataclasses import asdict
    from pathlib import Path

    from safetensors import safe_open

    path = Path(__file__).resolve().parent.parent / "spotlight" / "checkpoints" / name
    with safe_open(str(path), "pt") as f:
        provenance = json.loads(f.metadata()["provenance"])
    # the two settings the command resolves from the model: its context window and its layers
    expected = json.loads(json.dumps(asdict(TrainConfig(max_position=window, layers=tuple(range(layers))))))
    assert provenance["config"] == expected
    assert provenance["command"].startswith(command)
    assert provenance["corpus"] == "shakespeare,kjv"
    training = {d.name for d in corpus.shakespeare() + corpus.kjv()}
    assert set(provenance["documents"]) <= training  # no held-out essay among them
    assert not training & {d.name for d in corpus.essays()}
    assert provenance["steps"] == layers * TrainConfig().steps
