"""Encoder training as a background job: `python -m spotlight.train` in a child process, resumable.

    job = EncoderTraining.start(model_ref, home, bits=128)   # starts, or resumes the saved state
    job.progress()                  # TrainingProgress: running / paused / done / failed, step k of N, time left
    job.cancel()                    # SIGINT: the child saves its state and exits; start() again resumes it
    EncoderTraining.pending(home)   # the unfinished jobs (running, or paused with or without a saved state)

One job per model and code width, named `<model-name>-<bits>b`; its files, all under `home`:

    <home>/encoders/<name>.safetensors       the checkpoint: train.py writes it once, at the end, through a
                                              temporary file and a rename; Engine.load finds it (encoder_dirs)
    <home>/train-state/<name>.state.pt       the training state (train.py's place), written every
                                              `save_every` steps and on SIGINT; the next start resumes it
    <home>/train-cache/                      the model's recorded q/k, so a resumed run skips the prefill
    <home>/train-jobs/<name>/job.json        what was started: model, bits, command, the child's pid
    <home>/train-jobs/<name>/progress.json   train.py --progress (ProgressFile): phase, step, total, time left
    <home>/train-jobs/<name>/log.txt         the child's own output

The child runs niced, on `threads` torch threads. Whether it still runs is asked of the process
this one started, or, after this process restarted, of the pid in job.json (checked against the
process's start time, so a reused pid is not mistaken for it). A child that died without saying
why (killed, the machine stopped) is paused: its last saved state continues it. One training runs
at a time per home: starting another raises `TrainingRunning`.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .config import TrainingJobConfig
from .digests import read_json, write_json
from .errors import TrainingRunning
from .loading import DEFAULT_MODEL

_ROOT = Path(__file__).resolve().parent.parent  # the child runs `python -m spotlight.train` from here
_INTERRUPTED = (130, -signal.SIGINT)  # the child's exit after SIGINT: train.py's, or the signal's own
_lock = threading.Lock()  # start, cancel: one at a time in this process
_children: dict[Path, subprocess.Popen] = {}  # job folder -> the child this process started


@dataclass(frozen=True)
class TrainingProgress:
    """Where a job stands. status: "none" (never started), "running", "paused" (cancelled or
    interrupted: start resumes it), "done" (the checkpoint is written) or "failed" (`message`
    says why). The rest is train.py's ProgressFile as last written."""

    status: str
    phase: str = ""  # loading, recording, training, writing, done, interrupted, failed
    step: int = 0  # optimizer steps done, over every layer group
    total: int = 0
    start_step: int = 0  # where the latest run began (a resumed run: its saved state's step)
    saved_step: int | None = None  # the step of the last saved state
    recorded: int = 0  # sequences recorded (phase "recording") ...
    sequences: int = 0  # ... of these
    elapsed: float = 0.0  # seconds of the latest run
    seconds_left: float | None = None  # estimated from the latest run's pace; None until a step ran
    message: str = ""
    checkpoint: Path | None = None

    @classmethod
    def from_fields(cls, status: str, fields: dict, checkpoint: Path, message: str = "") -> "TrainingProgress":
        """From train.py's progress JSON (`fields`; {} when there is none yet)."""
        return cls(status, fields.get("phase", ""), int(fields.get("step", 0)), int(fields.get("total", 0)),
                   int(fields.get("start_step", 0)), fields.get("saved_step"), int(fields.get("done", 0)),
                   int(fields.get("of", 0)), float(fields.get("elapsed", 0.0)), fields.get("left"),
                   message or fields.get("message", ""), checkpoint)


def job_name(model_ref: str | None, bits: int) -> str:
    """`<model-name>-<bits>b`: the model file's or folder's name, lower case, without .gguf."""
    name = DEFAULT_MODEL if not model_ref else Path(model_ref).name.removesuffix(".gguf")
    slug = re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-.") or "model"
    return f"{slug}-{bits}b"


class EncoderTraining:
    """One model's encoder training under `home` (see the module docstring for its files)."""

    def __init__(self, home: Path, name: str):
        self.home, self.name = Path(home), name
        self.folder = self.home / "train-jobs" / name
        self.checkpoint = self.home / "encoders" / f"{name}.safetensors"
        self.state_path = self.home / "train-state" / f"{name}.state.pt"
        self.progress_path = self.folder / "progress.json"
        self.log_path = self.folder / "log.txt"
        self.job_path = self.folder / "job.json"

    def __eq__(self, other) -> bool:
        return isinstance(other, EncoderTraining) and (self.home, self.name) == (other.home, other.name)

    def __repr__(self) -> str:
        return f"EncoderTraining({str(self.home)!r}, {self.name!r})"

    @classmethod
    def of(cls, model_ref: str | None, home: Path, bits: int) -> "EncoderTraining":
        """The job for this model at `bits` (started or not)."""
        return cls(home, job_name(model_ref, bits))

    @classmethod
    def jobs(cls, home: Path) -> list["EncoderTraining"]:
        """Every job ever started under `home`."""
        folder = Path(home) / "train-jobs"
        return [cls(home, p.name) for p in sorted(folder.glob("*")) if (p / "job.json").is_file()]

    @classmethod
    def pending(cls, home: Path) -> list["EncoderTraining"]:
        """The jobs not finished: running, paused or failed (`resume` continues one)."""
        return [job for job in cls.jobs(home) if job.progress().status in ("running", "paused", "failed")]

    @classmethod
    def start(cls, model_ref: str | None, home: Path, bits: int,
              config: TrainingJobConfig = TrainingJobConfig()) -> "EncoderTraining":
        """Start training this model's encoders, resuming the saved state when there is one.
        A job that runs or is done already is returned as it is; another job running under
        `home` raises `TrainingRunning`."""
        job = cls.of(model_ref, home, bits)
        with _lock:
            running = [other for other in cls.jobs(home) if other != job and other.running()]
            if running:
                raise TrainingRunning(f"encoders are being trained for {running[0].name} already (one training "
                                      "at a time); wait for it to finish or cancel it first")
            if not (job.running() or job.checkpoint.exists()):
                job._launch(model_ref, bits, config)
        return job

    def resume(self, config: TrainingJobConfig = TrainingJobConfig()) -> "EncoderTraining":
        """Start this job again for the model and bits it was started with."""
        started = self._job()
        return EncoderTraining.start(started.get("model"), self.home, int(started["bits"]), config)

    def _launch(self, model_ref: str | None, bits: int, config: TrainingJobConfig) -> None:
        for folder in (self.folder, self.checkpoint.parent, self.state_path.parent):
            folder.mkdir(parents=True, exist_ok=True)
        self.progress_path.unlink(missing_ok=True)  # the last run's; the child writes its own at once
        command = [sys.executable, "-m", "spotlight.train", "--out", str(self.checkpoint), "--bits", str(bits),
                   "--threads", str(config.threads), "--save-every", str(config.save_every),
                   "--state", str(self.state_path), "--progress", str(self.progress_path), *config.options]
        if model_ref:
            command += ["--model", str(model_ref)]
        if self.state_path.exists():
            command.append("--resume")
        env = {**os.environ, "SPOTLIGHT_HOME": str(self.home), "OMP_NUM_THREADS": str(config.threads),
               "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as log:
            log.write(f"\n$ {' '.join(command)}\n".encode())
            log.flush()
            child = subprocess.Popen(command, cwd=_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT)
        if config.nice and hasattr(os, "setpriority"):
            try:
                os.setpriority(os.PRIO_PROCESS, child.pid, config.nice)
            except OSError:  # already gone: its progress says why
                pass
        _children[self.folder] = child
        self._write_job({"model": model_ref, "bits": bits, "command": command, "pid": child.pid,
                         "started": _start_time(child.pid), "cancelled": False})

    # ------------------------------------------------------------------ state

    def running(self) -> bool:
        """Whether the child of this job runs now (started by this process or an earlier one)."""
        child = _children.get(self.folder)
        if child is not None:
            return child.poll() is None
        job = self._job()
        return job.get("started") is not None and _start_time(job.get("pid")) == job["started"]

    def progress(self) -> TrainingProgress:
        """The job's status and train.py's last progress report."""
        if not self.job_path.is_file():
            return TrainingProgress("done" if self.checkpoint.exists() else "none", checkpoint=self.checkpoint)
        fields = self._fields()
        if self.running():
            return TrainingProgress.from_fields("running", fields, self.checkpoint)
        if self.checkpoint.exists():
            return TrainingProgress.from_fields("done", fields, self.checkpoint)
        child = _children.get(self.folder)
        if fields.get("phase") == "failed":
            return TrainingProgress.from_fields("failed", fields, self.checkpoint)
        if child is not None and child.returncode not in (0, *_INTERRUPTED) and not self._job().get("cancelled"):
            return TrainingProgress.from_fields("failed", fields, self.checkpoint, self._last_log_line())
        return TrainingProgress.from_fields("paused", fields, self.checkpoint)

    def cancel(self, timeout: float | None = None) -> TrainingProgress:
        """Interrupt the child (SIGINT: it saves its state, then exits) and wait for it to exit;
        one that has not exited after `timeout` seconds (default TrainingJobConfig().cancel_seconds)
        is killed, its last saved state kept. Returns the progress after it stopped."""
        timeout = TrainingJobConfig().cancel_seconds if timeout is None else timeout
        with _lock:
            if self.running():
                job = self._job()
                self._write_job({**job, "cancelled": True})
                pid = job["pid"]
                self._wait_for_progress(timeout)  # SIGINT before the child takes it could be lost
                os.kill(pid, signal.SIGINT)
                if not self.wait(timeout):
                    os.kill(pid, signal.SIGKILL)
                    self.wait(timeout)
        return self.progress()

    def _wait_for_progress(self, timeout: float) -> None:
        """Until the child's progress file exists (train.py takes SIGINT before it writes it) or the
        child has exited, at most `timeout` seconds: an app whose SIGINT is ignored (a background
        job) starts its child ignoring it, and a SIGINT sent in the child's first moments is lost."""
        deadline = time.monotonic() + timeout
        while not self.progress_path.exists() and self.running() and time.monotonic() < deadline:
            time.sleep(0.05)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the child exits (at most `timeout` seconds); True when it has."""
        child = _children.get(self.folder)
        if child is not None:
            try:
                child.wait(timeout)
            except subprocess.TimeoutExpired:
                return False
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.running():
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    # ------------------------------------------------------------------ files

    def _job(self) -> dict:
        return read_json(self.job_path, {})

    def _write_job(self, values: dict) -> None:
        write_json(self.job_path, values)

    def _fields(self) -> dict:
        return read_json(self.progress_path, {})  # {} until train.py's first write

    def _last_log_line(self) -> str:
        try:
            lines = [line.strip() for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "the training stopped without saying why"
        return lines[-1] if lines else "the training stopped without saying why"


def _start_time(pid: int | None) -> float | None:
    """The process's start time (seconds since the epoch), None when no such process runs."""
    if not pid:
        return None
    import psutil

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process.create_time()
    except psutil.Error:
        return None
