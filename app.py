"""Spotlight Chat: the Gradio front end. Handlers only adapt values and call chat/."""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gradio as gr  # noqa: E402

from chat.errors import ChatError  # noqa: E402
from chat.service import ChatService  # noqa: E402
from spotlight.config import AppConfig, EngineConfig  # noqa: E402

STREAM_EVERY = 0.08  # seconds between UI updates while streaming (throttles re-rendering)


def text_of(content) -> str:
    """Gradio 6 message content (a string or a list of parts) as plain text."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else [content]
    return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in parts)


def history_from_gradio(history: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": text_of(m["content"])} for m in history]


def throttled(items, seconds: float):
    """Yield at most one item per `seconds`, and always the last one."""
    last_time, pending = 0.0, None
    for item in items:
        pending = item
        now = time.monotonic()
        if now - last_time >= seconds:
            last_time, pending = now, None
            yield item
    if pending is not None:
        yield pending


def build_ui(service: ChatService) -> gr.Blocks:
    def respond(message, history, request: gr.Request):
        conversation = request.session_hash if request else "default"
        try:
            turns = service.reply(conversation, history_from_gradio(history), text_of(message))
            for turn in throttled(turns, STREAM_EVERY):
                yield turn.text
        except ChatError as exc:
            raise gr.Error(str(exc)) from exc
        finally:  # Stop in the browser closes this generator: stop the engine too
            service.stop(conversation)

    with gr.Blocks(title="Spotlight Chat") as demo:
        gr.Markdown("# Spotlight Chat\nA private chat with a local model. Nothing leaves this machine.")
        gr.ChatInterface(respond, api_name="chat")
    return demo


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Start the Spotlight Chat web app (offline, local).")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=7860, help="port (default: 7860)")
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2-135M)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    config = AppConfig(engine=EngineConfig(model_path=args.model), host=args.host, port=args.port)
    service = ChatService(config)
    print(f"Spotlight Chat on http://{args.host}:{args.port}", file=sys.stderr)
    build_ui(service).queue(default_concurrency_limit=1).launch(server_name=args.host, server_port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
