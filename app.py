"""Spotlight Chat: the Gradio front end. Handlers only adapt values and call chat/.

    python app.py [--host 127.0.0.1] [--port 7860] [--model PATH] [--max-new-tokens N] [--password SECRET]

Everything the UI shows comes from the chat service (conversations, messages, documents
and their numbers live in the store under SPOTLIGHT_HOME), so a reload or a server restart
shows the same conversations. Display values are computed in chat/ui_model.py, uploads in
chat/documents.py. Every event that uses the model shares `concurrency_id="engine"`;
Stop sets the conversation's cancel flag, so generation stops within one decode step.
"""
from __future__ import annotations

import argparse
import functools
import inspect
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gradio as gr  # noqa: E402

from chat import documents as uploads  # noqa: E402
from chat import ui_model as ui  # noqa: E402
from chat.errors import ChatError, NotFoundError  # noqa: E402
from chat.service import ChatService  # noqa: E402
from chat.config import AppConfig, EngineConfig  # noqa: E402

STREAM_EVERY = 0.08  # seconds between UI updates while streaming (~12 Hz: long answers stay smooth)
ENGINE = {"concurrency_id": "engine", "concurrency_limit": 1}  # one model, one queue for all its events
STREAMING = {**ENGINE, "show_progress": "minimal"}  # plus show_progress_on the status line: no overlay
VIEW_STATUS = 6  # index of the status line (turn numbers, or the last error) in a view's values
PASSWORD_ENV = "SPOTLIGHT_PASSWORD"
# Local font stacks only: the default theme fonts come from Google Fonts, and nothing may leave this machine.
THEME = gr.themes.Soft(font=("ui-sans-serif", "system-ui", "sans-serif"),
                       font_mono=("ui-monospace", "SFMono-Regular", "Consolas", "monospace"))

CSS = """
#sessions .wrap { flex-direction: column; gap: 2px; }
#sessions label { width: 100%; }
.chips { display: flex; flex-wrap: wrap; gap: 6px; }
.chip { border: 1px solid var(--border-color-primary); border-radius: 999px; padding: 2px 10px;
        background: var(--background-fill-secondary); font-size: 0.9em; }
.chip small, .chips-empty, .gauge-legend, .gauge-empty { color: var(--body-text-color-subdued); }
.gauge-bar { display: flex; height: 10px; border-radius: 5px; overflow: hidden;
             background: var(--background-fill-secondary); border: 1px solid var(--border-color-primary); }
.g-doc, .k-doc { background: #6366f1; color: #6366f1; }
.g-hist, .k-hist { background: #f59e0b; color: #f59e0b; }
.k-doc, .k-hist, .k-free { background: none; }
.k-free { color: var(--background-fill-secondary); }
.gauge-legend { font-size: 0.85em; margin-top: 2px; }
.gauge-warn .gauge-legend { color: #dc2626; }
#turn-stats { font-size: 0.85em; color: var(--body-text-color-subdued); min-height: 1.5em; }
"""

# Keyboard shortcuts and the remembered dark-mode choice (Enter sends: the textbox's submit).
HEAD = """
<script>
(() => {
  const click = (id) => document.querySelector('#' + id)?.click();
  document.addEventListener('keydown', (event) => {
    if (event.key === 'Escape') { click('stop-btn'); }
    if (event.ctrlKey && event.shiftKey && event.key.toLowerCase() === 'r') {
      event.preventDefault(); click('regen-btn');
    }
  }, true);
  const dark = localStorage.getItem('spotlight-dark');
  if (dark !== null) {
    const apply = () => document.body.classList.toggle('dark', dark === '1');
    document.readyState === 'loading' ? document.addEventListener('DOMContentLoaded', apply) : apply();
  }
})();
</script>
"""
DARK_JS = """() => {
  const on = document.body.classList.toggle('dark');
  localStorage.setItem('spotlight-dark', on ? '1' : '0');
}"""


def text_of(content) -> str:
    """Gradio 6 message content (a string or a list of parts) as plain text."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else [content]
    return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in parts)


def history_from_gradio(history: list[dict]) -> list[dict]:
    """Chatbot value -> [{"role", "content": str}] (the one adapter for Gradio 6's list-of-parts)."""
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
    """The whole app over one chat service (see `serve` for launching it with its style)."""
    export_dir = Path(tempfile.mkdtemp(prefix="spotlight-export-"))

    # ------------------------------------------------------------------ views

    def window() -> int | None:
        try:
            return service.engine.max_context
        except ChatError:
            return None

    def view(session_id, near: str | None = None):
        """Values for VIEW: the list, and the open conversation (None: a new, empty one).
        `near`: the parent of a place whose version was just switched (keeps it selected)."""
        listed = service.list_sessions()
        sessions = gr.Radio(choices=ui.session_choices(listed), value=session_id, info=None if listed else ui.NO_SESSIONS)
        try:
            info, history, docs = (service.get(session_id), service.history(session_id),
                                   service.documents(session_id)) if session_id else (None, [], [])
        except NotFoundError:  # deleted in another tab
            return view(None)
        size = window()
        use = ui.context_use(size, docs, history, service.config.sampling.max_new_tokens,
                             lambda text: len(service.engine.encode(text)), info.system_prompt if info else "") if size else None
        choices, chosen = ui.version_choices(history, near)
        return (session_id, sessions, f"### {info.title if info else 'New conversation'}",
                ui.chat_messages(history)[0], ui.chips_html(docs), ui.gauge_html(use),
                ui.turn_line(ui.last_stats(history), service.config.spotlight, size is not None
                             and ui.decodes_densely(service.engine)),
                gr.Dropdown(choices=choices, value=chosen, visible=bool(choices)))

    def stream(session_id, plan, restore: str | None = None):
        """STREAM values while a reply runs, then the stored conversation. `plan(history)`
        gives (messages to show above the reply, the service's Turn iterator). `restore`:
        the typed text, cleared at once and put back on an error (the view is reloaded),
        so nothing is lost; None leaves the textbox alone."""
        skip = gr.skip()
        box = skip if restore is None else ""
        try:
            shown, turns = plan(service.history(session_id))
            yield session_id, skip, skip, shown + [ui.pending_message()], skip, skip, "reading the conversation…", skip, box
            turn = None
            for turn in throttled(turns, STREAM_EVERY):
                yield (session_id, skip, skip, shown + [ui.assistant_message(turn.text)], skip, skip,
                       ui.live_line(turn), skip, box)
        except ChatError as error:  # the view is reloaded: no half-shown message stays
            values = list(view(session_id)) + [skip if restore is None else restore]
            values[VIEW_STATUS] = warn(error)
            yield tuple(values)
            return
        except GeneratorExit:  # Gradio closed the event: stop the engine too
            service.stop(session_id)
            raise
        for notice in turn.notices if turn else ():
            gr.Info(notice)
        yield *view(session_id), box

    # ------------------------------------------------------------------ handlers

    def open_initial(request: gr.Request):
        wanted = request.query_params.get("session") if request else None
        listed = service.list_sessions(limit=1)
        return view(wanted or (listed[0].id if listed else None))

    def open_session(session_id):
        return view(session_id)

    def new_session():
        return view(service.create().id)

    def search_sessions(query, session_id):
        choices = ui.session_choices(service.search(query) if query.strip() else service.list_sessions())
        return gr.Radio(choices=choices, value=session_id if session_id in dict(map(reversed, choices)) else None)

    def rename(session_id, title):
        if not session_id:
            raise ValueError("Open or start a conversation first, then rename it.")
        service.rename(session_id, title)
        return view(session_id)

    def delete(session_id):
        if session_id:
            service.delete(session_id)
        listed = service.list_sessions(limit=1)
        return view(listed[0].id if listed else None)

    def export(session_id, markdown: bool):
        if not session_id:
            raise ValueError("There is nothing to export yet: open a conversation first.")
        suffix, text = (".md", service.export_markdown(session_id)) if markdown else (".json", service.export_json(session_id))
        path = export_dir / ui.export_filename(service.get(session_id).title, suffix)
        path.write_text(text, encoding="utf-8")
        return gr.File(value=str(path), visible=True)

    def import_json(path):
        return view(service.import_json(Path(path).read_bytes()).id)

    def upload(session_id, paths, progress=gr.Progress()):
        created, session_id = not session_id, session_id or service.create().id
        report = uploads.ingest(service, session_id, paths or [], lambda f, text: progress(f, desc=text))
        if report.errors and not report.documents:
            if created:  # no empty conversation left behind by a failed first upload
                service.delete(session_id)
            raise ValueError(" ".join(message for _, message in report.errors))
        for _, message in report.errors:
            gr.Warning(message)
        for note in report.warnings + (report.resume.notices if report.resume else []):
            gr.Info(note)
        return view(session_id)

    def send(session_id, text):
        session_id = session_id or service.create().id
        yield from stream(session_id, lambda history: (ui.chat_messages(history)[0] + [ui.user_message(text)],
                                                       service.send(session_id, text)), restore=text)

    def summarize(session_id):
        if not session_id or not service.documents(session_id):
            raise ValueError("Attach a document first, then press Summarize.")
        if hasattr(service, "summarize"):  # the documents issue's single-pass / map-reduce summary
            yield from stream(session_id, lambda history: (ui.chat_messages(history)[0], service.summarize(session_id)))
        else:
            yield from send(session_id, ui.SUMMARIZE_PROMPT)

    def regenerate(session_id):
        if not session_id:
            raise ValueError("There is no reply to regenerate yet: send a message first.")
        yield from stream(session_id, lambda history: (ui.chat_messages(ui.without_last_reply(history))[0],
                                                       service.regenerate(session_id)))

    def edit(session_id, message_id, text):
        if not session_id:
            raise ValueError("There is no message to edit yet: send a message first.")
        yield from stream(session_id, lambda history: (ui.chat_messages(ui.before(history, message_id))[0]
                                                       + [ui.user_message(text)],
                                                       service.edit(session_id, message_id, text)), restore=text)

    def edit_in_chat(session_id, shown, data: gr.EditData):
        index = data.index if isinstance(data.index, int) else data.index[0]
        messages, ids = ui.chat_messages(service.history(session_id))
        if index >= len(ids) or ids[index] is None or history_from_gradio(shown)[:index] != history_from_gradio(messages)[:index]:
            gr.Warning("This conversation changed (another tab?); it was reloaded. Edit the message again.")
            yield *view(session_id), gr.skip()
            return
        yield from edit(session_id, ids[index], text_of(data.value))

    def undo(session_id):
        if not session_id:
            raise ValueError("There is nothing to undo yet.")
        text = service.undo(session_id)
        return *view(session_id), text

    def switch_version(session_id, message_id, step: int):
        if not (session_id and message_id):
            raise ValueError("Nothing to switch: edit or regenerate a message first, then pick it here.")
        place = ui.parent_of(service.history(session_id), message_id)
        service.switch_version(session_id, message_id, step)
        return view(session_id, place)

    def stop(session_id):
        if session_id:
            service.stop(session_id)

    def apply_settings(*values):
        nonlocal service
        config, notes = ui.apply_settings(service.config, ui.SettingsForm(*values))
        if config == service.config:
            return "Nothing changed."
        service = service.reconfigured(config)  # a model that fails to load keeps the old one (ModelUnavailable)
        return "\n\n".join(["Settings applied."] + notes)

    def history_api(session_id: str) -> list[dict]:
        """The visible conversation with message ids and turn stats (API only)."""
        return [{"id": m.id, "role": m.role, "content": m.content, "stats": m.stats,
                 "branch": m.branch, "branches": m.branches} for m in service.history(session_id)]

    # ------------------------------------------------------------------ layout

    form = ui.settings_form(service.config)
    with gr.Blocks(title="Spotlight Chat", fill_height=True) as demo:
        session = gr.State(None)
        with gr.Sidebar(label="Conversations", width=300):
            new_btn = gr.Button("+ New chat", variant="primary", elem_id="new-btn")
            search = gr.Textbox(placeholder="Search conversations…", show_label=False, elem_id="search")
            sessions = gr.Radio(choices=[], label="Conversations", info=ui.NO_SESSIONS, elem_id="sessions")
            with gr.Accordion("Rename, delete, export", open=False, elem_id="manage"):
                rename_box = gr.Textbox(placeholder="New title", show_label=False, elem_id="rename-box")
                rename_btn = gr.Button("Rename", size="sm", elem_id="rename-btn")
                with gr.Row():
                    export_md_btn = gr.Button("Export .md", size="sm", elem_id="export-md-btn")
                    export_json_btn = gr.Button("Export .json", size="sm", elem_id="export-json-btn")
                export_file = gr.File(label="Download", visible=False, interactive=False, elem_id="export-file")
                import_btn = gr.UploadButton("Import .json", size="sm", file_types=[".json"], elem_id="import-btn")
                delete_btn = gr.Button("Delete conversation", variant="stop", size="sm", elem_id="delete-btn")
                with gr.Row(visible=False) as confirm_row:
                    confirm_btn = gr.Button("Yes, delete it", variant="stop", size="sm", elem_id="confirm-delete-btn")
                    cancel_btn = gr.Button("Keep it", size="sm", elem_id="cancel-delete-btn")
            dark_btn = gr.Button("Dark mode", size="sm", elem_id="dark-btn")
        with gr.Tab("Chat"):
            with gr.Row(equal_height=True):
                title = gr.Markdown("### New conversation", elem_id="title")
                upload_btn = gr.UploadButton("Attach .txt .md .pdf .docx", file_count="multiple", size="sm",
                                             elem_id="upload-btn", scale=0, min_width=230)
                summarize_btn = gr.Button("Summarize", size="sm", elem_id="summarize-btn", scale=0, min_width=110)
            chips = gr.HTML(ui.chips_html([]), elem_id="chips")
            gauge = gr.HTML(ui.gauge_html(None), elem_id="gauge")
            chatbot = gr.Chatbot(elem_id="chat", editable="user", placeholder=ui.EMPTY_CHAT, height="52vh",
                                 buttons=["copy"], show_label=False)
            stats = gr.Markdown("", elem_id="turn-stats")
            with gr.Row(equal_height=True):
                msg = gr.Textbox(placeholder="Ask about your document…", show_label=False, lines=1, max_lines=8,
                                 scale=8, elem_id="msg", autofocus=True)
                send_btn = gr.Button("Send", variant="primary", scale=1, min_width=80, elem_id="send-btn")
                stop_btn = gr.Button("Stop", variant="stop", scale=1, min_width=80, elem_id="stop-btn")
            with gr.Row():
                regen_btn = gr.Button("Regenerate", size="sm", elem_id="regen-btn")
                undo_btn = gr.Button("Undo", size="sm", elem_id="undo-btn")
            with gr.Row(equal_height=True, elem_id="versions-row"):
                versions = gr.Dropdown(choices=[], label="Versions (edits and regenerations are kept)",
                                       visible=False, scale=4, elem_id="versions")
                older_btn = gr.Button("◀ Older", size="sm", scale=0, min_width=90, elem_id="older-btn")
                newer_btn = gr.Button("Newer ▶", size="sm", scale=0, min_width=90, elem_id="newer-btn")
            edit_id = gr.Textbox(visible=False)  # API path of edit: (message id, new text)
            edit_text = gr.Textbox(visible=False)
            edit_btn = gr.Button(visible=False)
        with gr.Tab("Settings"):
            settings = [
                gr.Textbox(form.model_path, label="Model path", placeholder="empty: the bundled SmolLM2-135M-Instruct",
                           info="A .gguf file or a Hugging Face directory (Llama, Qwen2, Mistral)."),
                gr.Slider(0.0, 2.0, form.temperature, step=0.05, label="Temperature (0 = greedy)"),
                gr.Slider(0.05, 1.0, form.top_p, step=0.05, label="Top-p"),
                gr.Slider(1, 2048, form.max_new_tokens, step=1, label="Max reply tokens"),
                gr.Slider(1.0, 2.0, form.repetition_penalty, step=0.05, label="Repetition penalty"),
                gr.Textbox(form.system_prompt, label="System prompt (new conversations)", lines=3),
                gr.Checkbox(form.spotlight_enabled, label="Spotlight attention"),
                gr.Slider(0.005, 0.5, form.spotlight_ratio, step=0.005, label="Spotlight budget (share retrieved)"),
            ]
            apply_btn = gr.Button("Apply settings", variant="primary", elem_id="apply-btn")
            settings_note = gr.Markdown("Changing the model, the system prompt or turning Spotlight on or off means a "
                                        "new cache: the note after applying says what is recomputed.",
                                        elem_id="settings-note")

        VIEW = [session, sessions, title, chatbot, chips, gauge, stats, versions]
        STREAM = VIEW + [msg]
        streaming = {**STREAMING, "show_progress_on": [stats]}  # queue position and timer, under the chat
        events = [  # (triggers, handler, inputs, outputs, options)
            ([demo.load], open_initial, [], VIEW, {}),
            ([new_btn.click, chatbot.clear], new_session, [], VIEW, {"api_name": "new_session"}),
            ([sessions.input], open_session, [sessions], VIEW, {"api_name": "open_session"}),
            ([search.submit, search.change], search_sessions, [search, session], [sessions],
             {"api_name": "search", "trigger_mode": "always_last", "show_progress": "hidden"}),
            ([rename_btn.click, rename_box.submit], rename, [session, rename_box], VIEW, {"api_name": "rename"}),
            ([delete_btn.click], lambda: gr.Row(visible=True), [], [confirm_row], {"api_visibility": "private"}),
            ([cancel_btn.click], lambda: gr.Row(visible=False), [], [confirm_row], {"api_visibility": "private"}),
            ([confirm_btn.click], delete, [session], VIEW, {"api_name": "delete"}),
            ([confirm_btn.click], lambda: gr.Row(visible=False), [], [confirm_row], {"api_visibility": "private"}),
            ([export_md_btn.click], lambda s: export(s, True), [session], [export_file], {"api_name": "export_markdown"}),
            ([export_json_btn.click], lambda s: export(s, False), [session], [export_file], {"api_name": "export_json"}),
            ([import_btn.upload], import_json, [import_btn], VIEW, {"api_name": "import_json"}),
            ([upload_btn.upload], upload, [session, upload_btn], VIEW,
             {**ENGINE, "api_name": "upload", "show_progress_on": [chips]}),  # the progress bar and ETA
            ([msg.submit, send_btn.click], send, [session, msg], STREAM,
             {**streaming, "api_name": "send", "trigger_mode": "always_last"}),
            ([summarize_btn.click], summarize, [session], STREAM, {**streaming, "api_name": "summarize"}),
            ([regen_btn.click, chatbot.retry], regenerate, [session], STREAM, {**streaming, "api_name": "regenerate"}),
            ([edit_btn.click], edit, [session, edit_id, edit_text], STREAM, {**streaming, "api_name": "edit"}),
            ([chatbot.edit], edit_in_chat, [session, chatbot], STREAM, {**streaming, "api_visibility": "private"}),
            ([undo_btn.click, chatbot.undo], undo, [session], STREAM, {**ENGINE, "api_name": "undo"}),
            ([older_btn.click], lambda s, m: switch_version(s, m, -1), [session, versions], VIEW,
             {**ENGINE, "api_name": "older_version"}),
            ([newer_btn.click], lambda s, m: switch_version(s, m, +1), [session, versions], VIEW,
             {**ENGINE, "api_name": "newer_version"}),
            ([stop_btn.click], stop, [session], [], {"queue": False, "api_name": "stop"}),
            ([apply_btn.click], apply_settings, settings, [settings_note],
             {**ENGINE, "api_name": "apply_settings", "show_progress": "minimal"}),
            ([dark_btn.click], None, [], [], {"js": DARK_JS, "api_visibility": "private"}),
        ]
        for triggers, handler, inputs, outputs, options in events:
            gr.on(triggers, _guarded(handler, outputs, [stats, settings_note]), inputs, outputs, **options)
        gr.api(history_api, api_name="history")
    return demo


def warn(error: Exception) -> str:
    """Toast a user-facing error; returns the text for the status line under the chat."""
    text = ui.error_text(error)
    gr.Warning(text)
    return f"⚠ {text}"


def _guarded(handler, outputs: list, status: list):
    """Run `handler`; a user-facing error (`ChatError`, a document's `DocumentError`, a bad
    setting: ValueErrors whose message says the fix, STYLE rule 14) becomes a toast plus the
    same text in the status output, and every other output is left as it was. (Raising
    gr.Error instead would put Gradio's error badge over every output, hiding the chat.)"""
    if handler is None:
        return None
    where = next((i for i, component in enumerate(outputs) if any(component is s for s in status)), None)

    def fallback(error):
        values = [gr.skip()] * len(outputs)
        text = warn(error)
        if where is not None:
            values[where] = text
        return None if not values else values[0] if len(values) == 1 else tuple(values)

    if inspect.isgeneratorfunction(handler):
        @functools.wraps(handler)
        def wrapper(*args, **kwargs):
            try:
                yield from handler(*args, **kwargs)
            except ValueError as error:
                yield fallback(error)
    else:
        @functools.wraps(handler)
        def wrapper(*args, **kwargs):
            try:
                return handler(*args, **kwargs)
            except ValueError as error:
                return fallback(error)
    return wrapper


def serve(service: ChatService, host: str = "127.0.0.1", port: int = 7860, *, password: str | None = None,
          **launch_options):
    """Build the UI and launch it with its style, shortcuts and (optional) password."""
    demo = build_ui(service).queue(default_concurrency_limit=4)
    auth = (lambda _user, given: given == password) if password else None
    demo.launch(server_name=host, server_port=port, auth=auth, css=CSS, head=HEAD,
                theme=THEME, footer_links=["api"],
                auth_message="Spotlight Chat: any user name, the server's password", **launch_options)
    return demo


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Start the Spotlight Chat web app (offline, local).")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=7860, help="port (default: 7860)")
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2-135M)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="longest reply in tokens (default: 256)")
    p.add_argument("--password", default=os.environ.get(PASSWORD_ENV),
                   help=f"require this password (any user name); default: ${PASSWORD_ENV}. Use it on a LAN")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    config = AppConfig(engine=EngineConfig(model_path=args.model), host=args.host, port=args.port)
    if args.max_new_tokens is not None:
        config = config.with_(sampling=replace(config.sampling, max_new_tokens=args.max_new_tokens))
    service = ChatService(config)
    try:
        service.engine  # load (and on first use convert) the model before serving: fail here, clearly
        service.list_sessions()  # open the store: a second server on the same data directory stops here
    except ChatError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.password:
        print(f"warning: serving on {args.host} without a password; set --password or ${PASSWORD_ENV}", file=sys.stderr)
    print(f"Spotlight Chat on http://{args.host}:{args.port} (data in {config.home})", file=sys.stderr)
    serve(service, args.host, args.port, password=args.password)
    return 0


if __name__ == "__main__":
    sys.exit(main())
