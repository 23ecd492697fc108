"""Spotlight Chat: the Gradio front end. Handlers only adapt values and call chat/.

    python app.py [--host 127.0.0.1] [--port 7860] [--model PATH] [--max-new-tokens N] [--password SECRET]
                  [--max-upload-mb 20] [--max-document-tokens N]

Everything the UI shows comes from the chat service (conversations, messages, documents
and their numbers live in the store under SPOTLIGHT_HOME), so a reload or a server restart
shows the same conversations. Display values are computed in chat/ui_model.py, uploads in
chat/documents.py. Every event that uses the model shares `concurrency_id="engine"`;
Stop sets the conversation's cancel flag, so generation stops within one decode step.

The shape: `layout` creates the components (a `Components`), `Handlers` holds the service
(in a `ServiceRef`, which Settings -> Apply swaps) and returns a `View` (or a `Reply`:
a view plus the message box) per event, and `events` is the one table `wire` attaches.
"""
from __future__ import annotations

import argparse
import functools
import inspect
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gradio as gr  # noqa: E402

from chat import documents as uploads  # noqa: E402
from chat import ui_model as ui  # noqa: E402
from chat import web_guard  # noqa: E402
from chat.api import ApiConfig  # noqa: E402
from chat.errors import ChatError, ConversationChanged, ModelUnavailable, NotFoundError  # noqa: E402
from chat.http_api import ApiServer, api_routes  # noqa: E402
from chat.service import ChatService  # noqa: E402
from chat.config import (ACTIVATIONS, ACTIVATIONS_HELP, FAR_PRODUCTS, FAR_PRODUCTS_HELP, KERNEL_THREADS_HELP, KV_DTYPE_HELP, KV_DTYPES, GB, MB, QUANTIZE, QUANTIZE_HELP, WEIGHTS,  # noqa: E402
                         WEIGHTS_HELP, AppConfig, EngineConfig, SpotlightConfig, UploadLimits)

# Gradio's own sweep of its temporary folder (every 10 minutes, files older than an hour): a backstop
# for what chat/ does not delete itself (uploads are deleted once read, exports at the next export)
FILE_CLEANUP = (600, 3600)
POLL_SECONDS = 2.0  # how often a tab asks whether its conversation changed elsewhere (one indexed read)
STREAM_EVERY = 0.08  # seconds between UI updates while streaming (~12 Hz: long answers stay smooth)
ENGINE = {"concurrency_id": "engine", "concurrency_limit": 1}  # one model, one queue for all its events
STREAMING = {**ENGINE, "show_progress": "minimal"}  # plus show_progress_on the status line: no overlay
PASSWORD_ENV = "SPOTLIGHT_PASSWORD"
PACKAGES_ENV = "SPOTLIGHT_PACKAGES"  # a folder of packaged models' package folders (EngineConfig.packages_dir)
API_KEY_ENV = "SPOTLIGHT_API_KEY"
# Local font stacks only: the default theme fonts come from Google Fonts, and nothing may leave this machine.
THEME = gr.themes.Soft(font=("ui-sans-serif", "system-ui", "sans-serif"),
                       font_mono=("ui-monospace", "SFMono-Regular", "Consolas", "monospace"))

CSS = """
#sessions .wrap { flex-direction: column; gap: 2px; }
#sessions label { width: 100%; overflow-wrap: anywhere; }
#versions-row:not(:has(#versions)) { display: none; }  /* no versions: no arrows (Dropdown visible=False is not rendered) */
#export-file tr.file { flex-wrap: wrap; }  /* the whole download name on a line of its own, then its size */
#export-file td.filename { flex: 1 0 100%; display: block; overflow-wrap: anywhere; }
#export-file td.filename span { white-space: normal; }
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
.toast-wrap { top: auto !important; bottom: 150px; }  /* toasts above the message box, off Attach and Summarize */
#turn-stats { font-size: 0.85em; color: var(--body-text-color-subdued); min-height: 1.5em; }
"""

# Keyboard shortcuts, the remembered dark-mode choice (Enter sends: the textbox's submit), and a sidebar
# that starts closed below NARROW_PX (Gradio's open sidebar takes the whole width of a phone).
NARROW_PX = 700
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
  window.spotlightFitSidebar = () => {  // a narrow screen opens on the chat: the open sidebar would cover it all
    if (window.innerWidth < NARROW_PX) { document.querySelector('.sidebar.open .toggle-button')?.click(); }
  };
  window.spotlightDarkLabel = () => {  // the button names the mode it switches to
    const button = document.querySelector('#dark-btn');
    const text = button && [...button.childNodes].find((n) => n.nodeType === Node.TEXT_NODE && n.nodeValue.trim());
    if (text) { text.nodeValue = document.body.classList.contains('dark') ? 'Light mode' : 'Dark mode'; }
  };
  const dark = localStorage.getItem('spotlight-dark');
  if (dark !== null) {
    const apply = () => document.body.classList.toggle('dark', dark === '1');
    document.readyState === 'loading' ? document.addEventListener('DOMContentLoaded', apply) : apply();
  }
})();
</script>
""".replace("NARROW_PX", str(NARROW_PX))
DARK_JS = """() => {
  const on = document.body.classList.toggle('dark');
  localStorage.setItem('spotlight-dark', on ? '1' : '0');
  window.spotlightDarkLabel?.();
}"""
# on load: the remembered (or system) mode is on by now, and the sidebar is rendered
LOAD_JS = "() => { window.spotlightDarkLabel?.(); window.spotlightFitSidebar?.(); }"
# The address names the open conversation (?session=ID, read by `open_initial`), so a reload keeps the place.
ADDRESS_JS = """(session) => {
  if (!session) { return; }
  const url = new URL(window.location.href);
  url.searchParams.set('session', session);
  window.history.replaceState(window.history.state, '', url);
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


# ----------------------------------------------------------------------------- the service


class ServiceRef:
    """The chat service every handler uses. Settings -> Apply swaps in a reconfigured one;
    events that start after the swap see it (one attribute: readers never see half a swap)."""

    def __init__(self, service: ChatService):
        self._service = service

    def get(self) -> ChatService:
        """The service in use."""
        return self._service

    def replace(self, new: ChatService) -> None:
        """Use `new` from the next `get` on."""
        self._service = new


def model_facts(service: ChatService) -> ui.ModelFacts:
    """What the display needs from the model (`window` None while the model cannot be loaded)."""
    try:
        return ui.ModelFacts(service.context_window(), service.decodes_densely(), service.count_tokens,
                             service.model_window())
    except ChatError:
        return ui.ModelFacts(None, False, service.count_tokens)


# ----------------------------------------------------------------------------- views


class View(NamedTuple):
    """What an event shows of the open conversation: one value per output, each field named
    as the component of `Components` it goes to (gr.skip() leaves that component as it is)."""

    session: str | None  # the open conversation (None: a new, empty one)
    seen: int | None  # the version of it shown (ChatService.version); mutating events send it back
    sessions: gr.Radio
    title: str
    chat: list[dict]
    chips: str
    gauge: str
    status: str  # turn numbers, or the last error
    versions: gr.Dropdown
    resume_btn: gr.Button  # shown under a question whose reply was interrupted
    continue_btn: gr.Button  # shown when the conversation filled the model's window


class Reply(NamedTuple):
    """A streaming event's outputs: the view, then the message box's value (cleared while a
    reply runs, the typed text put back after an error, gr.skip() to leave it alone)."""

    view: View
    msg: str | dict


def view_of(session_id: str | None, screen: ui.Screen, seen: int | None = None) -> View:
    """The outputs that show `screen`, with conversation `session_id` open at version `seen`."""
    return View(session_id, seen,
                gr.Radio(choices=screen.session_choices, value=session_id, info=screen.sessions_info),
                screen.title, screen.messages, screen.chips, screen.gauge, screen.status,
                gr.Dropdown(choices=screen.version_choices, value=screen.version, visible=bool(screen.version_choices)),
                gr.Button(visible=screen.interrupted), gr.Button(visible=screen.window_full))


def live_view(session_id: str, chat: list[dict], status: str) -> View:
    """The outputs while a reply streams: the chat and the status line change, the rest stays."""
    skip = gr.skip()
    return View(session_id, skip, skip, skip, chat, skip, skip, status, skip, gr.Button(visible=False), skip)


def unchanged_view() -> View:
    """Outputs that leave every component as it is."""
    return View(*[gr.skip()] * len(View._fields))


def gradio_values(result, n_outputs: int):
    """A handler's result as Gradio takes it: a View or a Reply becomes the tuple of its values
    in output order (the one place where views turn positional); anything else is kept."""
    if isinstance(result, Reply):
        values = (*result.view, result.msg)
    elif isinstance(result, View):
        values = tuple(result)
    else:
        return result
    assert len(values) == n_outputs, f"a {type(result).__name__} of {len(values)} values for {n_outputs} outputs"
    return values


# ----------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Components:
    """Every component an event of `events` is triggered by, reads or writes."""

    demo: gr.Blocks
    session: gr.State  # the open conversation's id, per browser tab
    seen: gr.State  # the version of it the tab shows
    timer: gr.Timer  # asks every POLL_SECONDS whether the conversation changed in another tab
    # the sidebar
    new_btn: gr.Button
    search: gr.Textbox
    sessions: gr.Radio
    rename_box: gr.Textbox
    rename_btn: gr.Button
    export_md_btn: gr.Button
    export_json_btn: gr.Button
    export_file: gr.File
    import_btn: gr.UploadButton
    delete_btn: gr.Button
    confirm_row: gr.Row
    confirm_btn: gr.Button
    cancel_btn: gr.Button
    dark_btn: gr.Button
    # the Chat tab
    title: gr.Markdown
    upload_btn: gr.UploadButton
    summarize_btn: gr.Button
    chips: gr.HTML
    gauge: gr.HTML
    chat: gr.Chatbot
    resume_btn: gr.Button
    status: gr.Markdown
    msg: gr.Textbox
    send_btn: gr.Button
    stop_btn: gr.Button
    regen_btn: gr.Button
    undo_btn: gr.Button
    continue_btn: gr.Button
    versions: gr.Dropdown
    older_btn: gr.Button
    newer_btn: gr.Button
    edit_id: gr.Textbox  # the API path of edit: (message id, new text)
    edit_text: gr.Textbox
    edit_btn: gr.Button
    # the Settings tab
    settings: tuple  # one input per field of ui.SettingsForm, in its order
    apply_btn: gr.Button
    settings_note: gr.Markdown
    models: "ModelsGroup"  # the Settings tab's Models group
    encoders: "EncoderComponents"  # the Settings tab's Encoders group

    def view(self) -> list:
        """The outputs of an event that returns a `View`, in its field order."""
        return [getattr(self, name) for name in View._fields]

    def reply(self) -> list:
        """The outputs of an event that returns a `Reply`: the view's, then the message box."""
        return self.view() + [self.msg]


class ModelsGroup(NamedTuple):
    """The Settings tab's Models group: what is installed, and a choice that fills in the model path."""

    table: gr.HTML
    choice: gr.Dropdown


def models_group(config: AppConfig) -> ModelsGroup:
    """The Models group (inside the Settings tab being built); filled in by the page's load event."""
    with gr.Group(elem_id="models-group"):
        gr.Markdown("### Models")
        table = gr.HTML(elem_id="models-table")
        choice = gr.Dropdown(choices=[], value=None, label="Installed models", elem_id="model-choice",
                             info="Choosing one fills in the model path below; Apply settings loads it.")
        gr.Markdown(ui.models_hint(config), elem_id="models-hint")
    return ModelsGroup(table, choice)


def layout(demo: gr.Blocks, config: AppConfig) -> Components:
    """Create the sidebar, the Chat tab and the Settings tab inside `demo` (being built);
    the settings show `config`, the rest starts empty until the page's load event."""
    form = ui.settings_form(config)
    session, seen, timer = gr.State(None), gr.State(None), gr.Timer(POLL_SECONDS)
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
        chat = gr.Chatbot(elem_id="chat", editable="user", placeholder=ui.EMPTY_CHAT, height="52vh",
                          buttons=["copy"], show_label=False)
        resume_btn = gr.Button("Regenerate the reply", variant="primary", size="sm", visible=False,
                               elem_id="resume-btn")
        status = gr.Markdown("", elem_id="turn-stats")
        with gr.Row(equal_height=True):
            msg = gr.Textbox(placeholder="Ask about your document…", show_label=False, lines=1, max_lines=8,
                             scale=8, elem_id="msg", autofocus=True)
            send_btn = gr.Button("Send", variant="primary", scale=1, min_width=80, elem_id="send-btn")
            stop_btn = gr.Button("Stop", variant="stop", scale=1, min_width=80, elem_id="stop-btn")
        with gr.Row():
            regen_btn = gr.Button("Regenerate", size="sm", elem_id="regen-btn")
            undo_btn = gr.Button("Undo", size="sm", elem_id="undo-btn")
            continue_btn = gr.Button("Continue in a new chat (keeps the documents)", size="sm", visible=False,
                                     elem_id="continue-btn")
        with gr.Row(equal_height=True, elem_id="versions-row"):
            versions = gr.Dropdown(choices=[], label="Versions (edits and regenerations are kept)",
                                   visible=False, scale=4, elem_id="versions")
            older_btn = gr.Button("◀ Older", size="sm", scale=0, min_width=90, elem_id="older-btn")
            newer_btn = gr.Button("Newer ▶", size="sm", scale=0, min_width=90, elem_id="newer-btn")
        edit_id = gr.Textbox(visible=False)
        edit_text = gr.Textbox(visible=False)
        edit_btn = gr.Button(visible=False)
    with gr.Tab("Settings"):
        models = models_group(config)
        settings = (
            gr.Textbox(form.model_path, label="Model path", placeholder="empty: the packaged " + ui.DEFAULT_MODEL,
                       info="A packaged model's name, a .gguf file or a Hugging Face directory (Llama, Qwen2, "
                            "Mistral); the Models list above fills it in. Weights (--weights): "
                            + WEIGHTS_HELP + ". --quantize " + QUANTIZE_HELP + ". --activations " + ACTIVATIONS_HELP + "."),
            gr.Slider(0.0, 2.0, form.temperature, step=0.05, label="Temperature (0 = greedy)"),
            gr.Slider(0.05, 1.0, form.top_p, step=0.05, label="Top-p"),
            gr.Slider(1, 2048, form.max_new_tokens, step=1, label="Max reply tokens"),
            gr.Slider(1.0, 2.0, form.repetition_penalty, step=0.05, label="Repetition penalty"),
            gr.Textbox(form.system_prompt, label="System prompt (new conversations)", lines=3),
            gr.Checkbox(form.spotlight_enabled, label="Spotlight attention"),
            gr.Slider(0.005, 0.5, form.spotlight_ratio, step=0.005, label="Spotlight budget (share retrieved)"),
        )
        apply_btn = gr.Button("Apply settings", variant="primary", elem_id="apply-btn")
        settings_note = gr.Markdown("Changing the model, the system prompt or turning Spotlight on or off means a "
                                    "new cache: the note after applying says what is recomputed.",
                                    elem_id="settings-note")
        encoders = encoders_group()
    return Components(
        demo=demo, session=session, seen=seen, timer=timer, new_btn=new_btn, search=search, sessions=sessions, rename_box=rename_box,
        rename_btn=rename_btn, export_md_btn=export_md_btn, export_json_btn=export_json_btn,
        export_file=export_file, import_btn=import_btn, delete_btn=delete_btn, confirm_row=confirm_row,
        confirm_btn=confirm_btn, cancel_btn=cancel_btn, dark_btn=dark_btn,
        title=title, upload_btn=upload_btn, summarize_btn=summarize_btn, chips=chips, gauge=gauge, chat=chat,
        resume_btn=resume_btn, status=status, msg=msg, send_btn=send_btn, stop_btn=stop_btn, regen_btn=regen_btn,
        undo_btn=undo_btn, continue_btn=continue_btn,
        versions=versions, older_btn=older_btn, newer_btn=newer_btn, edit_id=edit_id, edit_text=edit_text,
        edit_btn=edit_btn, settings=settings, apply_btn=apply_btn, settings_note=settings_note,
        models=models, encoders=encoders,
    )


class EncoderComponents(NamedTuple):
    """The Settings tab's Encoders group: the model's Spotlight encoders and their training."""

    note: gr.Markdown
    train_btn: gr.Button  # Train encoders / Resume training
    cancel_btn: gr.Button
    reload: gr.State  # the trained checkpoint to load now ("" when none): its change runs the reload

    def outputs(self) -> list:
        return list(self)


def encoders_group() -> EncoderComponents:
    """Create the Encoders group (inside the Settings tab being built); the timer fills it in."""
    with gr.Group(elem_id="encoders"):
        note = gr.Markdown("Spotlight encoders: …", elem_id="encoders-note")
        with gr.Row():
            train_btn = gr.Button("Train encoders", size="sm", visible=False, elem_id="train-encoders-btn")
            cancel_btn = gr.Button("Cancel training", size="sm", variant="stop", visible=False,
                                   elem_id="cancel-training-btn")
    return EncoderComponents(note, train_btn, cancel_btn, gr.State(""))


def encoders_view(panel: ui.EncodersPanel) -> tuple:
    """The Encoders group's outputs for `panel`."""
    return (panel.text, gr.Button(value=panel.train_label or "Train encoders", visible=panel.train_label is not None),
            gr.Button(visible=panel.cancel), panel.reload)


# ----------------------------------------------------------------------------- handlers


def refreshing(handler):
    """`handler` (a Handlers method whose first argument is the open conversation), except that
    when the conversation changed since the tab showed it (`ConversationChanged`) the tab is
    shown the conversation as it is now, with the warning, and its message box is left alone."""
    @functools.wraps(handler)
    def wrapper(self, session_id, *args, **kwargs):
        try:
            return handler(self, session_id, *args, **kwargs)
        except ConversationChanged as error:
            view = self.failed(session_id, error)
            return Reply(view, gr.skip()) if inspect.signature(handler).return_annotation == "Reply" else view
    return wrapper


class Handlers:
    """The event handlers. Each converts Gradio values to domain values, calls the chat
    service, and returns what its outputs show: a `View`, a `Reply`, or one component's value.
    A ValueError raised here is a user-facing message (see `adapted`)."""

    def __init__(self, service: ServiceRef):
        self._service = service

    @property
    def service(self) -> ChatService:
        """The service in use now (Settings -> Apply may have swapped it)."""
        return self._service.get()

    def view(self, session_id: str | None, near: str | None = None) -> View:
        """The list and the open conversation (None: a new, empty one; also for a conversation
        deleted in another tab). `near`: see `ui.screen`."""
        service = self.service
        try:  # the version first: a change made while the rest is read shows as newer, never as seen
            seen = service.version(session_id) if session_id else None
            info, history, documents = ((service.get(session_id), service.history(session_id),
                                         service.documents(session_id)) if session_id else (None, [], []))
            interrupted = bool(session_id) and service.reply_interrupted(session_id)
        except NotFoundError:  # deleted in another tab
            return self.view(None)
        return view_of(session_id, ui.screen(service.list_sessions(), info, history, documents, service.config,
                                             model_facts(service), near, interrupted), seen)

    def failed(self, session_id: str | None, error: ChatError) -> View:
        """The conversation as stored now, with `error` toasted and in the status line; a
        conversation that filled the window also offers to continue in a new chat."""
        view = self.view(session_id)
        offer = gr.Button(visible=True) if ui.offers_new_chat(error) else view.continue_btn
        return view._replace(status=warn(error), continue_btn=offer)

    def poll(self, session_id: str | None, seen: int | None) -> View:
        """The conversation again when it changed since this tab showed it (another tab, the
        API), else nothing (the timer's tick: one version read)."""
        changed = session_id is not None and self.service.changed(session_id, seen)
        return self.view(session_id) if changed else unchanged_view()

    def stream(self, session_id: str, plan, restore: str | None = None):
        """Replies while a turn runs, then the stored conversation. `plan(history)` gives (the
        messages above the reply, the service's Turn iterator). `restore`: the typed text,
        cleared at once and put back on an error, so nothing is lost (None: leave the box)."""
        box = gr.skip() if restore is None else ""
        try:
            shown, turns = plan(self.service.history(session_id))
            yield Reply(live_view(session_id, shown + [ui.pending_message()], ui.READING), box)
            turn = None
            for turn in throttled(turns, STREAM_EVERY):
                yield Reply(live_view(session_id, shown + [ui.live_message(turn)], ui.live_line(turn)), box)
        except ChatError as error:  # the view is reloaded: no half-shown message stays
            yield Reply(self.failed(session_id, error), gr.skip() if restore is None else restore)
            return
        except GeneratorExit:  # Gradio closed the event: stop the engine too
            self.service.stop(session_id)
            raise
        for notice in turn.notices if turn else ():
            gr.Info(ui.toast_text(notice))
        yield Reply(self.view(session_id), box)

    # ------------------------------------------------------------------ conversations

    def open_initial(self, request: gr.Request) -> View:
        """The conversation the address names (?session=...), else the latest one."""
        wanted = request.query_params.get("session") if request else None
        listed = self.service.list_sessions(limit=1)
        return self.view(wanted or (listed[0].id if listed else None))

    def open_session(self, session_id: str) -> View:
        """The conversation picked in the list."""
        return self.view(session_id)

    def refresh(self, session_id: str | None) -> View:
        """The open conversation again (after Settings -> Apply: the gauge's reply budget)."""
        return self.view(session_id)

    def new_session(self) -> View:
        """A new, empty conversation, open."""
        return self.view(self.service.create().id)

    def search_sessions(self, query: str, session_id: str | None) -> gr.Radio:
        """The conversations matching `query` (all of them for an empty one)."""
        service = self.service
        choices, value = ui.search_choices(service.search(query) if query.strip() else service.list_sessions(),
                                           session_id)
        return gr.Radio(choices=choices, value=value, info=ui.search_info(query, choices))

    @refreshing
    def rename(self, session_id: str | None, title: str, seen: int | None = None) -> View:
        """The open conversation, renamed."""
        if not session_id:
            raise ValueError("Open or start a conversation first, then rename it.")
        self.service.rename(session_id, title, seen=seen)
        return self.view(session_id)

    @refreshing
    def delete(self, session_id: str | None, seen: int | None = None) -> View:
        """Delete the open conversation; the latest other one opens."""
        if session_id:
            self.service.delete(session_id, seen=seen)
        listed = self.service.list_sessions(limit=1)
        return self.view(listed[0].id if listed else None)

    def export_markdown(self, session_id: str | None) -> gr.File:
        """The open conversation as a Markdown file to download."""
        return self._export(session_id, ".md")

    def export_json(self, session_id: str | None) -> gr.File:
        """The open conversation as a JSON file to download (and to import again)."""
        return self._export(session_id, ".json")

    def _export(self, session_id: str | None, suffix: str) -> gr.File:
        if not session_id:
            raise ValueError("There is nothing to export yet: open a conversation first.")
        service = self.service
        path = service.export_file(session_id, ui.export_filename(service.get(session_id).title, suffix))
        return gr.File(value=str(path), visible=True)

    def import_json(self, path: str) -> View:
        """A conversation exported as JSON, imported as a new one and opened (the upload is deleted)."""
        return self.view(self.service.import_file(path).id)

    @refreshing
    def upload(self, session_id: str | None, paths: list[str] | None, seen: int | None = None,
               progress=gr.Progress(), request: gr.Request = None) -> View:
        """Attach the files (to a new conversation when none is open) and read them into the cache;
        closing the tab stops the reading (`tab_closed`)."""
        if session_id:
            self.service.check_current(session_id, seen)
        session_id, report = uploads.upload(self.service, session_id or None, paths or [],
                                            lambda f, text: progress(f, desc=text),
                                            tab=request.session_hash if request else None)
        if refusal := ui.upload_refusal(report):
            raise ValueError(refusal)
        toast(*ui.upload_notices(report))
        return self.view(session_id)

    def tab_closed(self, request: gr.Request) -> None:
        """A browser tab was closed or reloaded: stop the work it started."""
        if request and request.session_hash:
            self.service.tab_closed(request.session_hash)

    # ------------------------------------------------------------------ turns

    def send(self, session_id: str | None, text: str, seen: int | None = None):
        """Ask `text` in the open conversation (a new one when none is open); streams Replies."""
        session_id = session_id or self.service.create().id
        yield from self.stream(session_id, lambda history: (ui.chat_messages(history)[0] + [ui.user_message(text)],
                                                            self.service.send(session_id, text, seen=seen)),
                               restore=text)

    def summarize(self, session_id: str | None, seen: int | None = None):
        """A summary of the attached documents; streams Replies."""
        if not session_id or not self.service.documents(session_id):
            raise ValueError("Attach a document first, then press Summarize.")
        if not hasattr(self.service, "summarize"):  # a service without the documents issue's summary
            yield from self.send(session_id, ui.SUMMARIZE_PROMPT)
            return
        yield from self.stream(session_id, lambda history: (ui.chat_messages(history)[0],
                                                            self.service.summarize(session_id, seen=seen)))

    def regenerate(self, session_id: str | None, seen: int | None = None):
        """A new version of the last reply (the old one is kept), or the reply an interrupted
        question never got; streams Replies."""
        if not session_id:
            raise ValueError("There is no reply to regenerate yet: send a message first.")
        yield from self.stream(session_id, lambda history: (ui.chat_messages(ui.without_last_reply(history))[0],
                                                            self.service.regenerate(session_id, seen=seen)))

    def edit(self, session_id: str | None, message_id: str, text: str, seen: int | None = None):
        """A new version of a question (the old one is kept), answered again; streams Replies."""
        if not session_id:
            raise ValueError("There is no message to edit yet: send a message first.")
        yield from self.stream(session_id, lambda history: (ui.chat_messages(ui.before(history, message_id))[0]
                                                            + [ui.user_message(text)],
                                                            self.service.edit(session_id, message_id, text,
                                                                              seen=seen)),
                               restore=text)

    def edit_in_chat(self, session_id: str, shown: list[dict], seen: int | None, data: gr.EditData):
        """`edit` for a question edited in the chat, unless the chat shown is stale."""
        index = data.index if isinstance(data.index, int) else data.index[0]
        message_id = ui.edited_message_id(self.service.history(session_id), history_from_gradio(shown), index)
        if message_id is None:
            gr.Warning(ui.STALE_EDIT)
            yield Reply(self.view(session_id), gr.skip())
            return
        yield from self.edit(session_id, message_id, ui.from_text(text_of(data.value)), seen)

    @refreshing
    def undo(self, session_id: str | None, seen: int | None = None) -> Reply:
        """Hide the last exchange; its question goes back into the message box."""
        if not session_id:
            raise ValueError("There is nothing to undo yet.")
        text = self.service.undo(session_id, seen=seen)
        return Reply(self.view(session_id), text)

    @refreshing
    def older_version(self, session_id: str | None, message_id: str | None, seen: int | None = None) -> View:
        """Show the previous version of the message picked in Versions."""
        return self._switch_version(session_id, message_id, -1, seen)

    @refreshing
    def newer_version(self, session_id: str | None, message_id: str | None, seen: int | None = None) -> View:
        """Show the next version of the message picked in Versions."""
        return self._switch_version(session_id, message_id, +1, seen)

    def _switch_version(self, session_id: str | None, message_id: str | None, step: int, seen: int | None) -> View:
        if not (session_id and message_id):
            raise ValueError("Nothing to switch: edit or regenerate a message first, then pick it here.")
        place = ui.parent_of(self.service.history(session_id), message_id)
        self.service.switch_version(session_id, message_id, step, seen=seen)
        return self.view(session_id, place)

    def continue_in_new_chat(self, session_id: str | None) -> View:
        """A new chat with the open conversation's documents and no messages, open."""
        if not session_id:
            raise ValueError("Open a conversation first.")
        return self.view(self.service.continue_in_new_chat(session_id).id)

    def stop(self, session_id: str | None) -> None:
        """Stop the reply running in the conversation (within one decode step)."""
        if session_id:
            self.service.stop(session_id)

    # ------------------------------------------------------------------ settings and API

    def apply_settings(self, *values) -> str:
        """Use the settings form's values (one per ui.SettingsForm field); returns the note."""
        service, form = self.service, ui.SettingsForm(*values)
        config, notes = ui.apply_settings(service.config, form)
        if config == service.config:
            return ui.NOTHING_CHANGED
        self._service.replace(service.reconfigured(config))  # a model that fails to load raises ModelUnavailable
        self.service.save_settings(ui.settings_values(form))  # kept for the next start
        warnings = ui.load_warnings(service.config, config, self.service.warnings())  # e.g. untrained encoders
        toast(warnings, [])
        return ui.settings_note(notes + ui.warning_notes(warnings))

    # ------------------------------------------------------------------ models

    def models_view(self) -> tuple[str, gr.Dropdown]:
        """The installed models' table and the model dropdown (Settings -> Models)."""
        service = self.service
        models, current = service.installed_models(), service.config.engine.model_path
        return (ui.models_table_html(models, current),
                gr.Dropdown(choices=ui.model_choices(models), value=ui.model_choice(models, current)))

    def choose_model(self, ref: str | None) -> str:
        """The model path box's new value for a model chosen in the dropdown."""
        return ref or ""

    # ------------------------------------------------------------------ Spotlight encoders (Settings)

    def encoders(self) -> tuple:
        """The Encoders group as the model's encoders and their training stand now (the timer's tick)."""
        return encoders_view(ui.encoders_panel(self.service.encoder_status()))

    def train_encoders(self) -> tuple:
        """Start (or resume) training the model's encoders in the background."""
        return encoders_view(ui.encoders_panel(self.service.train_encoders()))

    def cancel_encoder_training(self) -> tuple:
        """Stop the training; its state is saved for Resume."""
        return encoders_view(ui.encoders_panel(self.service.cancel_encoder_training()))

    def use_trained_encoders(self, checkpoint: str) -> tuple:
        """Swap in a service decoding with the newly trained encoders (in the model's queue, so
        never under a running reply); the service stays when there are none new."""
        self._service.replace(self.service.with_trained_encoders())
        return self.encoders()

    def history_api(self, session_id: str) -> list[dict]:
        """The visible conversation with message ids and turn stats (API only)."""
        return [{"id": m.id, "role": m.role, "content": m.content, "stats": m.stats,
                 "branch": m.branch, "branches": m.branches} for m in self.service.history(session_id)]


def show_confirm() -> gr.Row:
    """Show the "really delete?" buttons."""
    return gr.Row(visible=True)


def hide_confirm() -> gr.Row:
    """Hide the "really delete?" buttons."""
    return gr.Row(visible=False)


def toast(warnings: list[str], notes: list[str]) -> None:
    """Show each warning, then each note, as a toast."""
    for text in warnings:
        gr.Warning(ui.toast_text(text))
    for text in notes:
        gr.Info(ui.toast_text(text))


def warn(error: Exception) -> str:
    """Toast a user-facing error; returns the text for the status line under the chat."""
    text = ui.error_text(error)
    gr.Warning(ui.toast_text(text))
    return f"⚠ {ui.as_text(text)}"


# ----------------------------------------------------------------------------- events


class Event(NamedTuple):
    """One row of the events table: `handler` runs on each of `triggers`."""

    triggers: list
    handler: Callable | None
    inputs: list
    outputs: list
    options: dict


def model_events(c: Components, h: Handlers) -> list[Event]:
    """The Models group's events: listed when the page opens and again after Apply (queued after
    it on the engine's queue, so it marks the model now in use); a choice fills in the model path."""
    group, private = c.models, {"api_visibility": "private"}
    listing = [group.table, group.choice]
    return [
        Event([c.demo.load], h.models_view, [], listing, {"show_progress": "hidden", **private}),
        Event([c.apply_btn.click], h.models_view, [], listing, {**ENGINE, "show_progress": "hidden", **private}),
        Event([group.choice.input], h.choose_model, [group.choice], [c.settings[0]], {"queue": False, **private}),
    ]


def events(c: Components, h: Handlers) -> list[Event]:
    """The events table. Every event that uses the model shares concurrency_id "engine"."""
    view, reply = c.view(), c.reply()
    streaming = {**STREAMING, "show_progress_on": [c.status]}  # queue position and timer, under the chat
    private = {"api_visibility": "private"}
    return model_events(c, h) + [
        Event([c.demo.load], h.open_initial, [], view, {}),
        Event([c.timer.tick], h.poll, [c.session, c.seen], view, {"show_progress": "hidden", **private}),
        Event([c.new_btn.click, c.chat.clear], h.new_session, [], view, {"api_name": "new_session"}),
        Event([c.sessions.input], h.open_session, [c.sessions], view, {"api_name": "open_session"}),
        Event([c.search.submit, c.search.change], h.search_sessions, [c.search, c.session], [c.sessions],
              {"api_name": "search", "trigger_mode": "always_last", "show_progress": "hidden"}),
        Event([c.rename_btn.click, c.rename_box.submit], h.rename, [c.session, c.rename_box, c.seen], view,
              {"api_name": "rename"}),
        Event([c.delete_btn.click], show_confirm, [], [c.confirm_row], private),
        Event([c.cancel_btn.click], hide_confirm, [], [c.confirm_row], private),
        Event([c.confirm_btn.click], h.delete, [c.session, c.seen], view, {"api_name": "delete"}),
        Event([c.confirm_btn.click], hide_confirm, [], [c.confirm_row], private),
        Event([c.export_md_btn.click], h.export_markdown, [c.session], [c.export_file], {"api_name": "export_markdown"}),
        Event([c.export_json_btn.click], h.export_json, [c.session], [c.export_file], {"api_name": "export_json"}),
        Event([c.import_btn.upload], h.import_json, [c.import_btn], view, {"api_name": "import_json"}),
        Event([c.upload_btn.upload], h.upload, [c.session, c.upload_btn, c.seen], view,
              {**ENGINE, "api_name": "upload", "show_progress_on": [c.chips]}),  # the progress bar and ETA
        Event([c.msg.submit, c.send_btn.click], h.send, [c.session, c.msg, c.seen], reply,
              {**streaming, "api_name": "send", "trigger_mode": "always_last"}),
        Event([c.summarize_btn.click], h.summarize, [c.session, c.seen], reply, {**streaming, "api_name": "summarize"}),
        Event([c.regen_btn.click, c.chat.retry, c.resume_btn.click], h.regenerate, [c.session, c.seen], reply,
              {**streaming, "api_name": "regenerate"}),
        Event([c.edit_btn.click], h.edit, [c.session, c.edit_id, c.edit_text, c.seen], reply,
              {**streaming, "api_name": "edit"}),
        Event([c.chat.edit], h.edit_in_chat, [c.session, c.chat, c.seen], reply, {**streaming, **private}),
        Event([c.undo_btn.click, c.chat.undo], h.undo, [c.session, c.seen], reply, {**ENGINE, "api_name": "undo"}),
        Event([c.older_btn.click], h.older_version, [c.session, c.versions, c.seen], view,
              {**ENGINE, "api_name": "older_version"}),
        Event([c.newer_btn.click], h.newer_version, [c.session, c.versions, c.seen], view,
              {**ENGINE, "api_name": "newer_version"}),
        Event([c.continue_btn.click], h.continue_in_new_chat, [c.session], view, {"api_name": "continue_in_new_chat"}),
        Event([c.stop_btn.click], h.stop, [c.session], [], {"queue": False, "api_name": "stop"}),
        Event([c.apply_btn.click], h.apply_settings, list(c.settings), [c.settings_note],
              {**ENGINE, "api_name": "apply_settings", "show_progress": "minimal"}),
        # NOTE: queued after apply_settings in the same one-at-a-time queue, so it shows the new settings
        Event([c.apply_btn.click], h.refresh, [c.session], view, {**ENGINE, **private}),
        *encoder_events(c, h),
        Event([c.dark_btn.click], None, [], [], {"js": DARK_JS, **private}),
        Event([c.demo.load], None, [], [], {"js": LOAD_JS, **private}),
        Event([c.sessions.change], None, [c.sessions], [], {"js": ADDRESS_JS, **private}),
    ]


def encoder_events(c: Components, h: Handlers) -> list[Event]:
    """The Encoders group's events: its status at load and every tick, Train / Resume, Cancel,
    and the reload of newly trained encoders (in the model's queue: after the running reply)."""
    e, quiet = c.encoders, {"show_progress": "hidden", "api_visibility": "private"}
    return [
        Event([c.demo.load, c.timer.tick], h.encoders, [], e.outputs(), quiet),
        Event([e.train_btn.click], h.train_encoders, [], e.outputs(), quiet),
        Event([e.cancel_btn.click], h.cancel_encoder_training, [], e.outputs(), quiet),
        Event([e.reload.change], h.use_trained_encoders, [e.reload], e.outputs(), {**ENGINE, **quiet}),
    ]


def wire(c: Components, h: Handlers) -> None:
    """Attach every event of the table, the history API, and the tab-closed hook (inside the
    Blocks being built)."""
    for triggers, handler, inputs, outputs, options in events(c, h):
        gr.on(triggers, adapted(handler, outputs, [c.status, c.settings_note, c.encoders.note]), inputs, outputs, **options)
    gr.api(h.history_api, api_name="history")
    c.demo.unload(h.tab_closed)


def build_ui(service: ChatService, *, holder: ServiceRef | None = None) -> gr.Blocks:
    """The whole app over one chat service (see `serve` for launching it with its style);
    `holder`, when given, holds it (and, after Settings -> Apply, the service in use)."""
    handlers = Handlers(holder or ServiceRef(service))
    with gr.Blocks(title="Spotlight Chat", fill_height=True, delete_cache=FILE_CLEANUP) as demo:
        wire(layout(demo, service.config), handlers)
    return demo


def adapted(handler, outputs: list, status: list):
    """`handler` as Gradio calls it: its View or Reply becomes the outputs' values
    (`gradio_values`), and a user-facing error (`ChatError`, a document's `DocumentError`, a
    bad setting: ValueErrors whose message says the fix, STYLE rule 14) becomes a toast plus
    the same text in the status output, every other output left as it was. (Raising gr.Error
    instead would put Gradio's error badge over every output, hiding the chat.)"""
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
            results = handler(*args, **kwargs)
            try:
                for result in results:
                    yield gradio_values(result, len(outputs))
            except ValueError as error:
                yield fallback(error)
            finally:  # NOTE: when Gradio closes this generator, the handler's must close too (it stops the engine)
                results.close()
    else:
        @functools.wraps(handler)
        def wrapper(*args, **kwargs):
            try:
                return gradio_values(handler(*args, **kwargs), len(outputs))
            except ValueError as error:
                return fallback(error)
    return wrapper


def serve(service: ChatService, host: str = "127.0.0.1", port: int = 7860, *, password: str | None = None,
          api: ApiConfig | None = None, holder: ServiceRef | None = None, **launch_options):
    """Build the UI and launch it with its style, shortcuts and (optional) password, behind
    chat/web_guard.py (the Content-Security-Policy, the login back-off); with `api`, the
    OpenAI-compatible API (chat/http_api.py) is served at /v1 on the same server. Gradio's
    temporary folder (uploads, exports) is the data directory's short-lived files folder, emptied
    now (memory/scratch.py), not the system's temp directory that other instances share."""
    service.clear_scratch()  # opens the store first: a second server on the same data directory stops here
    os.environ["GRADIO_TEMP_DIR"] = str(service.scratch.gradio_dir)  # read by the Blocks and the server below
    demo = build_ui(service, holder=holder).queue(default_concurrency_limit=4)
    auth = web_guard.password_check(password) if password else None
    throttle = web_guard.LoginThrottle()  # failed logins: the middleware counts them, the login page explains
    routes = api_routes(service, api) if api is not None else []
    demo.launch(server_name=host, server_port=port, auth=auth, css=CSS, head=HEAD,
                theme=THEME, footer_links=["api"],
                app_kwargs={"middleware": web_guard.middleware(throttle), "routes": routes},
                auth_message=web_guard.login_message(throttle), **launch_options)
    return demo


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Start the Spotlight Chat web app (offline, local).")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=7860, help="port (default: 7860)")
    p.add_argument("--model", default=None, metavar="NAME|PATH",
                   help=ui.model_help())
    p.add_argument("--weights", choices=WEIGHTS, default=EngineConfig.weights, help=WEIGHTS_HELP)
    p.add_argument("--quantize", choices=QUANTIZE, default=EngineConfig.quantize, help=QUANTIZE_HELP)
    p.add_argument("--activations", choices=ACTIVATIONS, default=EngineConfig.activations, help=ACTIVATIONS_HELP)
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=EngineConfig.kv_dtype, help=KV_DTYPE_HELP)
    p.add_argument("--far-products", choices=FAR_PRODUCTS, default=EngineConfig.far_products, help=FAR_PRODUCTS_HELP)
    p.add_argument("--kernel-threads", type=int, default=None, help=KERNEL_THREADS_HELP)
    p.add_argument("--max-new-tokens", type=int, default=None, help="longest reply in tokens (default: 256)")
    p.add_argument("--max-upload-mb", type=float, default=UploadLimits.max_bytes / MB,
                   help=f"largest file an upload may be, in MB (default: {UploadLimits.max_bytes / MB:g}); "
                   "larger files are refused before they are read")
    p.add_argument("--max-document-tokens", type=int, default=None,
                   help="most tokens one document may have (default: what the model's context window holds)")
    p.add_argument("--max-context-tokens", type=int, default=SpotlightConfig.max_context,
                   help=f"most tokens a conversation may hold with Spotlight on, documents included (default: "
                   f"{SpotlightConfig.max_context:,}; never below the model's own window, and at most what half "
                   "this machine's memory holds of its cache); past the model's window it is read through Spotlight")
    p.add_argument("--disk-budget-gb", type=float, default=AppConfig.disk_budget_bytes / GB,
                   help=f"disk the cache files may use, in GB (default: {AppConfig.disk_budget_bytes / GB:.1f}); the "
                   "least recently used conversations' caches are dropped beyond it (and recomputed when "
                   "needed), and a document whose cache would not fit is refused before it is read")
    p.add_argument("--password", default=os.environ.get(PASSWORD_ENV),
                   help=f"require this password (any user name); default: ${PASSWORD_ENV}. Use it on a LAN")
    p.add_argument("--api-only", action="store_true", help="serve only the OpenAI-compatible API at /v1, no UI")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"the API's bearer key; default: ${API_KEY_ENV}, else the password")
    p.add_argument("--api-allow-remote", action="store_true",
                   help="answer API requests from other machines even without a key (default: loopback only)")
    p.add_argument("--api-cors", action="append", default=[], metavar="ORIGIN",
                   help="allow browser front ends at ORIGIN to call the API (repeatable; default: none)")
    return p.parse_args(argv)


def startup_config(args, saved: dict) -> AppConfig:
    """What the app starts with: the defaults, the settings saved from the Settings tab over them
    (`saved`, ChatService.saved_settings), and what the command line names over those.
    ValueError for an impossible upload limit, context cap or disk budget."""
    uploads = UploadLimits(max_bytes=round(args.max_upload_mb * MB), max_tokens=args.max_document_tokens)
    engine = EngineConfig(weights=args.weights, quantize=args.quantize, activations=args.activations,
                          kv_dtype=args.kv_dtype, far_products=args.far_products,
                          packages_dir=os.environ.get(PACKAGES_ENV))
    if args.kernel_threads is not None:
        engine = replace(engine, kernel_threads=args.kernel_threads)
    config = ui.saved_config(AppConfig(engine=engine, host=args.host, port=args.port, uploads=uploads,
                                       spotlight=SpotlightConfig(max_context=args.max_context_tokens),
                                       disk_budget_bytes=round(args.disk_budget_gb * GB)),
                             saved)
    if args.model is not None:
        config = config.with_(engine=replace(config.engine, model_path=args.model))
    if args.max_new_tokens is not None:
        config = config.with_(sampling=replace(config.sampling, max_new_tokens=args.max_new_tokens))
    return config


def with_saved_settings(service: ChatService, config: AppConfig) -> ChatService:
    """The service reconfigured for `config` (`startup_config` with the saved settings), its model
    loaded; when the saved model does not load, with `service`'s model and a warning (so a model
    moved away never keeps the app from starting)."""
    try:
        return service.reconfigured(config)
    except ModelUnavailable as error:
        if config.engine == service.config.engine:
            raise
        print(f"warning: the model chosen in Settings could not be loaded ({error}); starting with "
              f"{service.config.engine.model_path or 'the bundled model'}", file=sys.stderr)
        return service.reconfigured(config.with_(engine=service.config.engine))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        first = startup_config(args, {})
    except ValueError as error:  # an impossible upload limit, context cap or disk budget on the command line
        print(f"error: {error}", file=sys.stderr)
        return 2
    service = ChatService(first)
    try:
        saved = service.saved_settings()  # opens the store: a second server on the same data directory stops here
        # load (and on first use convert) the model before serving: fail here, clearly
        service = with_saved_settings(service, startup_config(args, saved))
    except ChatError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    config = service.config
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.password:
        print(f"warning: serving on {args.host} without a password; set --password or ${PASSWORD_ENV}", file=sys.stderr)
    api = ApiConfig(api_key=args.api_key or args.password, allow_remote=args.api_allow_remote,
                    cors_origins=tuple(args.api_cors))
    if args.api_only:
        print(f"Spotlight Chat API on http://{args.host}:{args.port}/v1 (data in {config.home})", file=sys.stderr)
        ApiServer(service, api, args.host, args.port).run()
        return 0
    print(f"Spotlight Chat on http://{args.host}:{args.port} (data in {config.home})", file=sys.stderr)
    serve(service, args.host, args.port, password=args.password, api=api)
    return 0


if __name__ == "__main__":
    sys.exit(main())
