"""Command line: `python -m spotlight chat` and `python -m spotlight generate`.

Errors the user can fix are printed as one clear line (exit code 2), never a traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

from .config import (ACTIVATIONS, ACTIVATIONS_HELP, FAR_PRODUCTS, FAR_PRODUCTS_HELP, KERNEL_THREADS_HELP, KV_DTYPE_HELP, KV_DTYPES, QUANTIZE, QUANTIZE_HELP, WEIGHTS,
                     WEIGHTS_HELP, EngineConfig, SamplingConfig, SpotlightConfig, default_home)
from .errors import SpotlightError
from .loading import DEFAULT_MODEL
from .packaged import MODELS

EPILOG = """examples:
  python -m spotlight chat
  python -m spotlight chat --model ~/models/Qwen2.5-0.5B-Instruct --temperature 0.7
  echo "Once upon a time" | python -m spotlight generate --raw --max-new-tokens 40
  python -m spotlight generate --prompt-file question.txt

data directory: $SPOTLIGHT_HOME (default ~/.cache/spotlight-chat) holds your models folder (models/)
and the converted and joined models (cache/models/)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m spotlight",
        description="Spotlight Chat engine: chat with or generate from a local Llama-family model, offline.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="{chat,generate}")
    chat = sub.add_parser("chat", help="multi-turn chat in the terminal, streamed", epilog=EPILOG,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    chat.add_argument("--system", default=None, help="system prompt (default: the model template's)")
    gen = sub.add_parser("generate", help="one completion for a prompt from a file or stdin", epilog=EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    gen.add_argument("--prompt-file", type=Path, help="read the prompt from this UTF-8 file (default: stdin)")
    gen.add_argument("--raw", action="store_true", help="plain completion: do not wrap the prompt in the chat template")
    for command in (chat, gen):
        _add_common(command)
    return p


def _add_common(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument("--model", metavar="NAME|PATH", help="a packaged model's name (" + ", ".join(MODELS) + "), a GGUF "
                   "file or a Hugging Face directory (default: " + DEFAULT_MODEL + ")")
    m.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    m.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    m.add_argument("--kernel-threads", type=int, default=None, help=KERNEL_THREADS_HELP)
    m.add_argument("--weights", choices=WEIGHTS, default=EngineConfig.weights, help=WEIGHTS_HELP)
    m.add_argument("--quantize", choices=QUANTIZE, default=EngineConfig.quantize, help=QUANTIZE_HELP)
    m.add_argument("--activations", choices=ACTIVATIONS, default=EngineConfig.activations, help=ACTIVATIONS_HELP)
    m.add_argument("--kv-dtype", choices=KV_DTYPES, default=EngineConfig.kv_dtype, help=KV_DTYPE_HELP)
    m.add_argument("--far-products", choices=FAR_PRODUCTS, default=EngineConfig.far_products, help=FAR_PRODUCTS_HELP)
    m.add_argument("--prefill-chunk", type=int, default=EngineConfig.prefill_chunk,
                   help=f"tokens per prefill chunk (default: {EngineConfig.prefill_chunk})")
    a = p.add_argument_group("Spotlight attention")
    a.add_argument("--no-spotlight", action="store_true", help="decode with dense attention over every cached token")
    a.add_argument("--ratio", type=float, default=SpotlightConfig.ratio,
                   help=f"share of cached tokens retrieved per step (default: {SpotlightConfig.ratio})")
    a.add_argument("--bits", type=int, default=SpotlightConfig.bits, help=f"code bits (default: {SpotlightConfig.bits})")
    a.add_argument("--encoders", default=None,
                   help="encoder checkpoint (default: the shipped one when it matches the model, else untrained)")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=256, help="reply length limit (default: 256)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default: 1.0 = off)")
    s.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0 = off)")
    s.add_argument("--repetition-penalty", type=float, default=1.1, help="1.0 = off (default: 1.1)")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--seed", type=int, default=None, help="random seed for sampling")


def _configs(args) -> tuple[EngineConfig, SamplingConfig, SpotlightConfig]:
    threads = {} if args.kernel_threads is None else {"kernel_threads": args.kernel_threads}
    engine = EngineConfig(model_path=args.model, device=args.device, threads=args.threads,
                          weights=args.weights, quantize=args.quantize,
                          activations=args.activations, kv_dtype=args.kv_dtype, far_products=args.far_products,
                          prefill_chunk=args.prefill_chunk, encoder_path=args.encoders,
                          packages_dir=os.environ.get("SPOTLIGHT_PACKAGES"), **threads)
    spotlight = SpotlightConfig(enabled=not args.no_spotlight, ratio=args.ratio, bits=args.bits)
    sampling = SamplingConfig(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        repetition_penalty=args.repetition_penalty, max_new_tokens=args.max_new_tokens,
        stop_strings=tuple(args.stop), seed=args.seed,
    )
    return engine, sampling, spotlight


def _load(engine_config: EngineConfig, spotlight: SpotlightConfig):
    from .engine import Engine

    print("loading model…", file=sys.stderr, flush=True)
    engine = Engine.load(engine_config, default_home(), spotlight)
    for warning in engine.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return engine


def _read_prompt(path: Path | None) -> str:
    try:
        data = path.read_bytes() if path else sys.stdin.buffer.read()
    except OSError as exc:
        raise SpotlightError(f"cannot read the prompt file {str(path)!r}: {exc.strerror or exc}") from exc
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        where = f"{str(path)!r}" if path else "stdin"
        raise SpotlightError(
            f"the prompt in {where} is not valid UTF-8 (byte {exc.start}); convert it, e.g. `iconv -t UTF-8`"
        ) from exc
    if not text.strip():
        raise SpotlightError("the prompt is empty; pass --prompt-file or pipe text on stdin")
    return text


def _print_stream(engine, context, ids, sampling, cancel) -> str:
    reply = []
    for step in engine.stream(context, ids, sampling, cancel=cancel):
        sys.stdout.write(step.text)
        sys.stdout.flush()
        reply.append(step.text)
        if step.finish:
            st = step.stats
            print(f"\n[{step.finish}; {st.cached_tokens} cached + {st.prefill_tokens} new prompt tokens at "
                  f"{st.prefill_tps:.0f} tok/s; {st.decode_tokens} generated at {st.decode_tps:.1f} tok/s]",
                  file=sys.stderr)
    return "".join(reply)


def cmd_generate(args) -> None:
    engine_config, sampling, spotlight = _configs(args)
    prompt = _read_prompt(args.prompt_file)
    engine = _load(engine_config, spotlight)
    ids = engine.encode(prompt) if args.raw else engine.chat_ids([{"role": "user", "content": prompt}])
    _print_stream(engine, engine.new_context(), ids, sampling, threading.Event())
    print()


def cmd_chat(args) -> None:
    engine_config, sampling, spotlight = _configs(args)
    engine = _load(engine_config, spotlight)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    context = engine.new_context()
    print("type a message; /reset starts over, /quit or Ctrl-D leaves, Ctrl-C stops a reply", file=sys.stderr)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return
        if line in ("/quit", "/exit"):
            return
        if line == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        cancel = threading.Event()
        sys.stdout.write("bot> ")
        try:
            reply = _print_stream(engine, context, engine.chat_ids(messages), sampling, cancel)
        except KeyboardInterrupt:
            cancel.set()
            reply = "(stopped)"
            print()
        except SpotlightError as exc:
            messages.pop()
            print(f"error: {exc}", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": reply})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        {"chat": cmd_chat, "generate": cmd_generate}[args.command](args)
    except SpotlightError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # configuration values (SamplingConfig, EngineConfig)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
