"""The OpenAI-compatible API: time to first token with prompt memory, and concurrent streaming.

    python -m bench.api [--quick] [--json PATH] [--no-results]

One request carries a document (Paul Graham essays, ~7.6K tokens; 1.5K with --quick) in its
system message and a question; it is streamed with the official `openai` client from an
`ApiServer` (chat/http_api.py) on loopback over SmolLM2-135M (bench.common.SMALL_MODEL). TTFT = request sent to
the first content delta:
  first     the data directory is empty: the whole prompt is prefilled;
  repeated  the same request again: it matches the stored API conversation (warm in RAM);
  restart   the same request after the server and its ChatService are closed and reopened
            on the same data directory (nothing in RAM: spans are read from disk). The model
            object is reused (the process is not restarted: loading it is not part of TTFT).
Beside it, when `make bench-deps` built llama.cpp's server (.bench-cache/llama-build/bin/
llama-server, or $LLAMA_SERVER): the same requests to `llama-server` on the same GGUF (one slot,
its prompt cache on, every core): first, repeated (its in-RAM prompt cache), after a restart of
the server process without slot files, and after a restart with `--slot-save-path` (the slot
saved before the kill and restored after the start; the restore's own time is added to TTFT).
Then 4 clients stream at once, each a different question over the same document (a fresh
conversation each: the content-addressed prefix is reused): total generated tokens per
second over the wall time, and p50 / p95 of their TTFTs (two rounds).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from bench.common import ROOT, SMALL_MODEL, Target, finish, log, parser, small_gguf

CLIENTS = 4
QUESTIONS = ("Summarise the first essay in one sentence.", "Which essay is the longest?",
             "Name one idea they share.", "Any advice for founders?", "What is the tone?",
             "Who is the audience?", "Give a title for the collection.", "What surprised you?")


def stream_ttft(client, messages, max_tokens: int) -> tuple[float, int, int]:
    """(seconds to the first content delta, completion tokens, cached prompt tokens)."""
    started, first, usage = time.perf_counter(), None, None
    for chunk in client.chat.completions.create(model="spotlight", messages=messages, max_tokens=max_tokens,
                                                stream=True, stream_options={"include_usage": True}):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
        usage = chunk.usage or usage
    return first if first is not None else time.perf_counter() - started, usage.completion_tokens, \
        usage.prompt_tokens_details.cached_tokens


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, engine, home: Path):
        import openai

        from chat.api import ApiConfig
        from chat.config import AppConfig
        from chat.http_api import ApiServer
        from chat.service import ChatService

        self.service = ChatService(AppConfig(home=home), _engine=engine)
        self.server = ApiServer(self.service, ApiConfig(), port=free_port()).start()
        self.client = openai.OpenAI(base_url=self.server.url, api_key="unused", max_retries=0, timeout=600)

    def close(self):
        self.server.close()
        self.service.close()


def llama_server_binary() -> Path | None:
    """llama.cpp's server as `make bench-deps` builds it (or $LLAMA_SERVER), if present."""
    path = Path(os.environ.get("LLAMA_SERVER", ROOT / ".bench-cache" / "llama-build" / "bin" / "llama-server"))
    return path if path.is_file() and os.access(path, os.X_OK) else None


class LlamaServer:
    """`llama-server` on the packaged GGUF in its own process: one slot, slot files under `slots`."""

    def __init__(self, binary: Path, gguf: Path, slots: Path, context: int):
        import httpx
        import openai

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [str(binary), "-m", str(gguf), "-c", str(context), "-np", "1", "-t", str(os.cpu_count()),
             "--host", "127.0.0.1", "--port", str(self.port), "--slot-save-path", str(slots), "--no-webui"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(600):  # the model loads in a second or two; /health answers 200 once it has
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            self.close()
            raise RuntimeError(f"llama-server did not start on port {self.port}")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=600)

    def slot(self, action: str) -> float:
        """Save or restore slot 0 to/from one file; the seconds it took."""
        import httpx

        started = time.perf_counter()
        response = httpx.post(f"{self.url}/slots/0?action={action}", json={"filename": "bench.bin"}, timeout=600)
        response.raise_for_status()
        return time.perf_counter() - started

    def close(self):
        self.process.kill()
        self.process.wait()


def llama_server_rows(binary: Path, messages, context: int) -> list[dict]:
    """first / repeated / after restart without and with slot files, as memory_rows for ours."""

    rows = []
    with tempfile.TemporaryDirectory(prefix="llama-slots-") as slots:
        server = LlamaServer(binary, small_gguf(), Path(slots), context)
        for case in ("first", "repeated"):
            seconds, _, _ = stream_ttft(server.client, messages, 8)
            rows.append({"case": f"llama.cpp {case}", "ttft_s": seconds})
        saved = server.slot("save")
        server.close()
        server = LlamaServer(binary, small_gguf(), Path(slots), context)
        seconds, _, _ = stream_ttft(server.client, messages, 8)
        rows.append({"case": "llama.cpp restart, no slot file", "ttft_s": seconds})
        server.close()
        server = LlamaServer(binary, small_gguf(), Path(slots), context)
        restore = server.slot("restore")
        seconds, _, _ = stream_ttft(server.client, messages, 8)
        rows.append({"case": "llama.cpp restart + slot restore", "ttft_s": restore + seconds,
                     "note": f"restore {restore:.3f} s + request {seconds:.3f} s (save took {saved:.3f} s)"})
        server.close()
    for row in rows:
        row["speedup"] = rows[0]["ttft_s"] / row["ttft_s"]
        log(f"{row['case']}: {row['ttft_s']:.3f} s")
    return rows


def memory_rows(engine, home: Path, messages) -> list[dict]:
    rows = []
    server = Server(engine, home)
    for case in ("first", "repeated"):
        seconds, _, cached = stream_ttft(server.client, messages, 8)
        rows.append({"case": case, "ttft_s": seconds, "cached_tokens": cached})
        log(f"{case}: {seconds:.3f} s, {cached} cached")
    server.close()
    server = Server(engine, home)
    seconds, _, cached = stream_ttft(server.client, messages, 8)
    rows.append({"case": "restart", "ttft_s": seconds, "cached_tokens": cached})
    log(f"restart: {seconds:.3f} s, {cached} cached")
    server.close()
    for row in rows:
        row["speedup"] = rows[0]["ttft_s"] / row["ttft_s"]
    return rows


def concurrent_row(engine, home: Path, system: str, max_tokens: int) -> dict:
    server = Server(engine, home)
    ttfts, tokens = [], []
    lock = threading.Lock()

    def one(question: str):
        result = stream_ttft(server.client, [{"role": "system", "content": system},
                                             {"role": "user", "content": question}], max_tokens)
        with lock:
            ttfts.append(result[0])
            tokens.append(result[1])

    started = time.perf_counter()
    for round_start in range(0, 2 * CLIENTS, CLIENTS):
        threads = [threading.Thread(target=one, args=(q,)) for q in QUESTIONS[round_start:round_start + CLIENTS]]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    wall = time.perf_counter() - started
    server.close()
    ordered = sorted(ttfts)
    return {"case": f"{CLIENTS} concurrent clients", "requests": len(ttfts), "tokens": sum(tokens),
            "tokens_per_s": sum(tokens) / wall, "ttft_p50_s": statistics.median(ordered),
            "ttft_p95_s": ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]}


def main(argv=None) -> int:
    args = parser("api", "OpenAI-compatible API: TTFT with prompt memory (first, repeated, restart), concurrency").parse_args(argv)
    from bench.decode import essay_ids
    from spotlight.config import EngineConfig, default_home
    from spotlight.engine import Engine

    engine = Engine.load(EngineConfig(model_path=SMALL_MODEL), default_home())
    engine.warm_up()
    doc_tokens = 1500 if args.quick else 7600
    system = "Answer from the document.\n\n" + engine.tokenizer.decode(essay_ids(engine.tokenizer, doc_tokens))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[0]}]
    with tempfile.TemporaryDirectory(prefix="spotlight-api-") as tmp:
        rows = memory_rows(engine, Path(tmp) / "home", messages)
        concurrent = concurrent_row(engine, Path(tmp) / "home", system, 16 if args.quick else 32)
    binary = llama_server_binary()
    if binary is None:
        log("llama-server not built (make bench-deps): the llama.cpp rows are left out")
    else:
        rows += llama_server_rows(binary, messages, engine.max_context)
    targets = [Target("repeated TTFT speedup vs first (x)", rows[1]["speedup"], 50),
               Target("after-restart TTFT speedup vs first (x)", rows[2]["speedup"], 50)]
    ours_restart = rows[2]["ttft_s"]
    for row in rows[3:]:
        if row["case"].startswith("llama.cpp restart"):
            row["ours after restart, x faster"] = row["ttft_s"] / ours_restart
    notes = (f"SmolLM2-135M (bench.common.SMALL_MODEL, the app's default decode policy) on CPU, {engine.count_tokens(system):,}-token "
             "document in the system message, streamed with the `openai` client over loopback; max_tokens 8 for the "
             "TTFT rows. restart = server and ChatService closed and reopened on the data directory (the model object "
             "is kept). Concurrent row: 2 rounds of 4 streaming clients, each a new conversation over the same "
             "document (its prefix spans are reused), replies serialised on the one engine.")
    finish("api", args, rows + [concurrent], targets, title="OpenAI-compatible API (prompt memory, concurrency)",
           notes=notes, columns=["case", "ttft_s", "cached_tokens", "speedup", "ours after restart, x faster", "requests",
                                 "tokens", "tokens_per_s", "ttft_p50_s", "ttft_p95_s", "note"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
