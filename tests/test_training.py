"""Encoder training in the background (spotlight/training.py, chat/encoders.py): issue #22.

Each job runs a real `python -m spotlight.train` child on a tiny random model written to disk
(tests/tiny_model.py): a few seconds of interpreter start, then milliseconds a step.
"""
import json
import time

import pytest
import torch

from chat import ui_model as ui
from chat.config import AppConfig, EngineConfig, SamplingConfig, SpotlightConfig
from chat.encoders import EncoderStatus
from chat.service import ChatService
from spotlight import loading
from spotlight.config import TrainingJobConfig
from spotlight.engine import encoder_dirs, trained_encoders
from spotlight.errors import TrainingRunning
from spotlight.train import ProgressFile
from spotlight.training import EncoderTraining, TrainingProgress, job_name
from tiny_model import TINY_RUN, write_corpus, write_tiny_model

BITS = 32
STEPS = 150  # per layer group (2 layers, one group each): long enough to be cancelled mid-way


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model folder, training options): a tiny random model and its corpus on disk."""
    root = tmp_path_factory.mktemp("tiny-training")
    model = write_tiny_model(root / "tiny-llama")
    options = (*TINY_RUN, "--corpus", str(write_corpus(root / "corpus")))
    return model, options


def job_config(options, steps: int = STEPS, save_every: int = 10) -> TrainingJobConfig:
    return TrainingJobConfig(threads=1, save_every=save_every, options=(*options, "--steps", str(steps)),
                             cancel_seconds=60)


def wait_for(job: EncoderTraining, done, timeout: float = 120) -> TrainingProgress:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        progress = job.progress()
        if done(progress):
            return progress
        time.sleep(0.02)
    raise AssertionError(f"timed out; last progress {job.progress()}; log:\n{job.log_path.read_text()[-2000:]}")


def saved_step(state_path) -> int:
    """The global step a training state continues from (what LayerwiseTraining.step gives after load)."""
    state = torch.load(state_path, map_location="cpu", weights_only=False)
    within = state["trainer"]["step"] if state["trainer"] is not None else 0
    return state["group"] * state["config"]["steps"] + within


def test_an_interrupted_encoder_training_resumes(tiny, tmp_path):
    model, options = tiny
    home, config = tmp_path / "home", job_config(options)
    job = EncoderTraining.start(str(model), home, BITS, config)
    assert job.name == "tiny-llama-32b" and job.checkpoint == home / "encoders" / "tiny-llama-32b.safetensors"
    first = wait_for(job, lambda p: p.saved_step is not None and p.saved_step > 0)
    assert first.status == "running" and first.total == 2 * STEPS
    with pytest.raises(TrainingRunning, match="one training at a time"):
        EncoderTraining.start(str(model), home, BITS * 2, config)  # another job of the same home

    paused = job.cancel()
    assert (paused.status, paused.phase) == ("paused", "interrupted")
    assert 0 < paused.saved_step < paused.total
    assert saved_step(job.state_path) == paused.saved_step  # the state written on SIGINT
    assert not job.checkpoint.exists() and list(job.checkpoint.parent.iterdir()) == []  # nothing half-written
    assert EncoderTraining.pending(home) == [job]

    again = EncoderTraining.start(str(model), home, BITS, config)
    assert again == job
    done = wait_for(job, lambda p: p.status != "running")
    assert (done.status, done.phase, done.start_step, done.step) == ("done", "done", paused.saved_step, 2 * STEPS)
    assert f"resumed at step {paused.saved_step} of {2 * STEPS}" in job.log_path.read_text()
    fingerprint = loading.resolve(str(model), home).fingerprint
    assert trained_encoders(fingerprint, BITS, encoder_dirs(home)) == job.checkpoint
    assert EncoderTraining.pending(home) == []


def test_cancel_before_the_first_saved_state_leaves_no_checkpoint(tiny, tmp_path):
    model, options = tiny
    job = EncoderTraining.start(str(model), tmp_path, BITS, job_config(options))
    paused = job.cancel()  # while the child still starts: no state yet
    assert (paused.status, paused.saved_step) == ("paused", None)
    assert not job.checkpoint.exists() and not job.state_path.exists()
    assert not (tmp_path / "encoders" / "tiny-llama-32b.safetensors.tmp").exists()


def test_cancel_interrupts_a_child_started_by_an_app_that_ignores_sigint(tiny, tmp_path):
    """An app started as a background job of a non-interactive shell (`make run &`) ignores
    SIGINT, and so would its training child: Cancel still pauses it, right after the start
    (no state yet) and mid-way (the state saved on SIGINT)."""
    import signal

    model, options = tiny
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the app's own disposition, inherited
    try:
        job = EncoderTraining.start(str(model), tmp_path, BITS, job_config(options))
        early = job.cancel()
        assert (early.status, early.saved_step) == ("paused", None)
        job = EncoderTraining.start(str(model), tmp_path, BITS, job_config(options))
        wait_for(job, lambda p: p.saved_step is not None and p.saved_step > 0)
        paused = job.cancel()
        assert (paused.status, paused.phase) == ("paused", "interrupted") and 0 < paused.saved_step < paused.total
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_service_reports_untrained_then_training_then_trained(tiny, tmp_path):
    model, options = tiny
    config = AppConfig(home=tmp_path, engine=EngineConfig(model_path=str(model), weights="fp32"),
                       sampling=SamplingConfig(max_new_tokens=2),
                       spotlight=SpotlightConfig(bits=BITS, dense_layers=(0,), dense_below=16, k_min=8, window=8),
                       training=job_config(options, steps=20))
    service = ChatService(config)
    service.load_model()
    untrained = service.encoder_status()
    assert (untrained.state, untrained.checkpoint, untrained.progress.status) == ("untrained", None, "none")
    session = service.create()
    _, first = _finish(service.send(session.id, "When does the courier come?"))

    assert service.train_encoders().state == "training"
    job = EncoderTraining.of(str(model), tmp_path, BITS)
    wait_for(job, lambda p: p.status != "running")
    checkpoint = tmp_path / "encoders" / "tiny-llama-32b.safetensors"
    assert service.encoder_status() == EncoderStatus("ready", checkpoint, job.progress(), trained_here=True)

    trained = service.with_trained_encoders()
    assert trained is not service and trained.engine.model is service.engine.model  # the model is kept
    assert trained.engine.uses_trained_encoders and not service.engine.uses_trained_encoders
    assert trained.encoder_status() == EncoderStatus("trained", checkpoint, job.progress(), trained_here=True)
    assert trained.with_trained_encoders() is trained  # nothing newer
    _, second = _finish(trained.send(session.id, "And on Sunday?"))
    assert any("other Spotlight encoders" in notice for notice in second.notices)  # recomputed, not reused
    trained.close()


def _finish(turns):
    last = None
    for last in turns:
        pass
    return last.text, last


# ----------------------------------------------------------------------------- progress


def test_progress_file_reports_steps_saves_and_time_left(tmp_path):
    path = tmp_path / "progress.json"
    progress = ProgressFile(path, tmp_path / "out.safetensors", every=3600)
    assert json.loads(path.read_text())["phase"] == "loading"
    progress.training(40, 100, resumed=True)
    progress.step(41, saved=False)  # within `every`: not written
    assert json.loads(path.read_text())["step"] == 40
    time.sleep(0.05)
    progress.step(50, saved=True)  # a save is written at once
    fields = json.loads(path.read_text())
    assert {k: fields[k] for k in ("phase", "step", "total", "start_step", "saved_step")} == {
        "phase": "training", "step": 50, "total": 100, "start_step": 40, "saved_step": 50}
    # 10 steps took the time since training() began: 50 more take 5 times that
    assert fields["left"] == pytest.approx(5 * fields["elapsed"], rel=0.5)
    parsed = TrainingProgress.from_fields("running", fields, tmp_path / "out.safetensors")
    assert (parsed.step, parsed.total, parsed.saved_step, parsed.seconds_left) == (50, 100, 50, fields["left"])


def test_progress_reads_as_step_k_of_n_and_minutes_left():
    progress = TrainingProgress("running", "training", step=1200, total=72000, seconds_left=1530.0)
    assert ui.training_line(progress) == "step 1,200 of 72,000, about 26 min left"
    assert ui.minutes_left(None) == "estimating the time left"
    assert ui.minutes_left(30) == "less than a minute left"
    assert ui.minutes_left(7500) == "about 2 h 5 min left"
    recording = TrainingProgress("running", "recording", recorded=2, sequences=6)
    assert ui.training_line(recording) == "recording the model's attention on the training text (sequence 3 of 6)…"
    panel = ui.encoders_panel(EncoderStatus("training", progress=progress))
    assert (panel.train_label, panel.cancel, panel.reload) == (None, True, "")
    assert panel.text.endswith("Training them: step 1,200 of 72,000, about 26 min left")
    paused = ui.encoders_panel(EncoderStatus("paused", progress=TrainingProgress("paused", saved_step=500, total=72000)))
    assert (paused.train_label, paused.cancel) == ("Resume training", False)
    assert "Training paused at step 500 of 72,000" in paused.text


def test_job_names_come_from_the_model_file():
    assert job_name(None, 128) == "qwen2.5-coder-0.5b-instruct-128b"  # the default model
    assert job_name("/models/Qwen2.5-0.5B-Instruct-Q8_0.gguf", 64) == "qwen2.5-0.5b-instruct-q8-0-64b"
    assert job_name("/models/My Model/", 128) == "my-model-128b"


def test_after_a_restart_the_job_is_found_running_by_its_pid_and_start_time(tmp_path):
    """A job started by an earlier process: its pid counts only with the start time it had."""
    import os

    import psutil

    job = EncoderTraining(tmp_path, "tiny-llama-32b")
    job.folder.mkdir(parents=True)
    me = psutil.Process(os.getpid())
    job.job_path.write_text(json.dumps({"model": "tiny-llama", "bits": 32, "pid": me.pid, "started": me.create_time()}))
    assert job.running() and job.progress().status == "running"
    assert EncoderTraining.pending(tmp_path) == [job]
    job.job_path.write_text(json.dumps({"model": "tiny-llama", "bits": 32, "pid": me.pid, "started": 1.0}))
    assert not job.running() and job.progress().status == "paused"  # a reused pid is not the job's
