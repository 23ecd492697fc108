"""Display values for the web UI, computed from the chat service's records. Pure functions.

No Gradio here (app.py owns the components): these turn `SessionInfo`, `ChatMessage`,
`DocumentInfo` and `Turn` into the strings, HTML and message dicts the components show,
and a settings form into a new `AppConfig` plus notes on what the change costs.

The context gauge counts documents by their stored token numbers and the conversation with
the model's tokenizer plus a fixed allowance per message for the chat template's markup:
within a few tokens of what the engine caches, and current even before the first reply.
"""
from __future__ import annotations

import html
import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from .config import MB, AppConfig
from spotlight import DEFAULT_MODEL, InstalledModel, packaged_model_names
from spotlight.config import EngineConfig, SamplingConfig, SpotlightConfig

from .errors import ConversationTooLong
from .records import ChatMessage, DocumentInfo, SessionInfo, Turn

SUMMARIZE_PROMPT = "Summarize the document."
EMPTY_CHAT = (
    "### Ask about a long document\n"
    "Attach a **.txt, .md, .pdf or .docx** file, then ask a question, or press **Summarize**. "
    "The whole document stays in the model's context, and this conversation resumes instantly "
    "later, even after a restart. Nothing leaves this machine.\n\n"
    "**Enter** sends · **Shift+Enter** new line · **Esc** stops · **Ctrl+Shift+R** regenerates"
)
TEMPLATE_TOKENS = 5  # "<|im_start|>role\n ... <|im_end|>\n" around each message (ChatML-style templates)
DOCUMENT_WRAPPER_TOKENS = 12  # '<document name="...">' ... '</document>' around each document (chat/render.py)
NO_SESSIONS = "No conversations yet: press + New chat, or just type a message."
NO_DOCUMENTS = "No document attached yet: <b>Attach</b> adds one (several are fine)."
READING = "reading the conversation…"  # the status line while a prompt is prefilled
STALE_EDIT = "This conversation changed (another tab?); it was reloaded. Edit the message again."
NOTHING_CHANGED = "Nothing changed."
INTERRUPTED = "Reply interrupted — the app stopped before it finished"  # a question whose reply was never stored
INTERRUPTED_HINT = "Press **Regenerate the reply** to answer it."
_TITLE_SLUG = re.compile(r"[^A-Za-z0-9]+")
# Speeds over fewer tokens than these measure call overhead, not the model: not shown.
SPEED_MIN_PREFILL = 64
SPEED_MIN_DECODE = 8
SIDEBAR_TITLE_CHARS = 48  # a title in the conversation list (the heading shows it whole)
# Markdown's syntax characters get a backslash (CommonMark shows `\X` as X), `& < >` become
# entities and URL starts are broken (a GFM autolink would swallow the backslashes after it):
# user and document text then shows character for character, with no live HTML, image or link.
_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
_ENTITY = re.compile(r"&(amp|lt|gt);")
_MARKDOWN_ANYWHERE = re.compile(r"([\\`*_\[\]|~$@])")
_AUTOLINK_START = re.compile(r"\b(https?|ftp|www)([:.])", re.IGNORECASE)
_MARKDOWN_LINE_START = re.compile(r"^([ \t]*)([#=+-]|\d+[.)])", re.MULTILINE)
_ESCAPED = re.compile(r"\\([\\`*_\[\]|~$@#=+.):-])")
# Code in a reply (fenced blocks, also unclosed while streaming, and inline spans): shown as is.
_REPLY_CODE = re.compile(r"(^[ \t]*```[\s\S]*?(?:^[ \t]*```|\Z)|^[ \t]*~~~[\s\S]*?(?:^[ \t]*~~~|\Z)|`[^`\n]+`)",
                         re.MULTILINE)


# ----------------------------------------------------------------------------- sessions


def session_choices(sessions: list[SessionInfo], now: float | None = None) -> list[tuple[str, str]]:
    """(label, id) pairs for the conversation list: title and how long ago it changed."""
    now = time.time() if now is None else now
    return [(f"{ellipsized(s.title, SIDEBAR_TITLE_CHARS)} · {ago(now - s.updated)}", s.id) for s in sessions]


def ellipsized(text: str, limit: int) -> str:
    """`text` if it has at most `limit` characters, else its first `limit - 1` and "…"."""
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def ago(seconds: float) -> str:
    """'just now', '5 min ago', '3 h ago', '2 d ago'."""
    if seconds < 60:
        return "just now"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{int(seconds // size)} {unit} ago"
    return "just now"  # unreachable; keeps type checkers calm


def export_filename(title: str, suffix: str) -> str:
    """A safe file name for an export: 'Trip to Lisbon' -> 'Trip-to-Lisbon.md'."""
    stem = _TITLE_SLUG.sub("-", title).strip("-")[:60] or "conversation"
    return f"{stem}{suffix}"


def search_info(query: str, choices: list) -> str:
    """The hint under the conversation list after a search ("" for none)."""
    if choices:
        return ""
    return f"No conversation matches “{query.strip()}”." if query.strip() else NO_SESSIONS


def search_choices(sessions: list[SessionInfo], session_id: str | None) -> tuple[list[tuple[str, str]], str | None]:
    """The conversation list for a search, and the open conversation if the list shows it."""
    choices = session_choices(sessions)
    return choices, session_id if any(value == session_id for _, value in choices) else None


# ----------------------------------------------------------------------------- the screen


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the display needs from the model."""

    window: int | None  # the most tokens a conversation holds; None while the model cannot be loaded
    dense: bool  # the engine decodes densely whatever the settings say
    count_tokens: Callable[[str], int]
    model_window: int = 0  # the model's own window; past it Spotlight reads (0: the same as `window`)


@dataclass(frozen=True, slots=True)
class Screen:
    """Everything the sidebar and the chat tab show for one open conversation."""

    session_choices: list[tuple[str, str]]
    sessions_info: str | None  # the hint under an empty conversation list
    title: str
    messages: list[dict]
    chips: str
    gauge: str
    status: str
    version_choices: list[tuple[str, str]]
    version: str | None
    interrupted: bool  # the last question's reply was never stored: offer to regenerate it
    window_full: bool  # the conversation leaves less room than a reply: offer a new chat with the documents


def fitted_spotlight(spotlight: SpotlightConfig, model: ModelFacts) -> SpotlightConfig:
    """`spotlight` as the engine runs it for `model`: dense_below at most the model's own window
    (spotlight.beyond.fitted_config), so a context past the window is never called dense."""
    window = model.model_window or model.window
    return replace(spotlight, dense_below=min(spotlight.dense_below, window)) if window else spotlight


def screen(sessions: list[SessionInfo], info: SessionInfo | None, history: list[ChatMessage],
           documents: list[DocumentInfo], config: AppConfig, model: ModelFacts, near: str | None = None,
           interrupted: bool = False) -> Screen:
    """The display values of the conversation `info` (None: a new, empty one) in the list
    `sessions`. `near`: the parent of a place whose version was just switched (keeps it selected);
    `interrupted`: the service found the last question without its reply (`reply_interrupted`)."""
    budget = config.sampling.max_new_tokens
    use = None if not model.window else ContextUse(model.window, 0, 0, budget, model.model_window) if info is None \
        else context_use(model.window, documents, history, budget, model.count_tokens, info.system_prompt,
                         model.model_window)
    choices, chosen = version_choices(history, near)
    messages = chat_messages(history)[0] + ([interrupted_message()] if interrupted else [])
    status = f"⚠ {INTERRUPTED}. {INTERRUPTED_HINT}" if interrupted else \
        turn_line(last_stats(history), fitted_spotlight(config.spotlight, model), model.window is not None and model.dense)
    return Screen(session_choices(sessions), None if sessions else NO_SESSIONS,
                  f"### {as_text(info.title) if info else 'New conversation'}", messages,
                  chips_html(documents), gauge_html(use), status, choices, chosen, interrupted,
                  bool(history) and use is not None and use.room < use.reply_budget)


def offers_new_chat(error: Exception) -> bool:
    """Whether an error means the conversation filled the window and a new chat with its documents would fit."""
    return isinstance(error, ConversationTooLong) and error.fresh_chat_fits


# ----------------------------------------------------------------------------- messages


def chat_messages(history: list[ChatMessage]) -> tuple[list[dict], list[str | None]]:
    """Chatbot messages for the visible conversation, and the message id of each entry
    (None for entries the UI adds, such as a "Sources" block under an answer)."""
    messages: list[dict] = []
    ids: list[str | None] = []
    for message in history:
        messages.append({"role": message.role, "content": message_content(message.role, message.content)})
        ids.append(message.id)
        sources = message_sources(message)
        if sources:
            messages.append(sources_message(sources))
            ids.append(None)
    return messages, ids


def version_choices(history: list[ChatMessage], near: str | None = None) -> tuple[list[tuple[str, str]], str | None]:
    """Dropdown choices (label, message id) for the shown messages that have other versions
    (edits, regenerations), and the one to select: the message whose parent is `near` (the
    place just switched), else the last one; (no choices, None) when nothing has versions."""
    choices, chosen, counts = [], None, {"user": 0, "assistant": 0}
    for message in history:
        counts[message.role] = counts.get(message.role, 0) + 1
        if message.branches > 1:
            kind = "Question" if message.role == "user" else "Reply"
            sampled = message.stats.get("regenerated_at")
            how = f" (regenerated at temperature {sampled:g})" if sampled is not None else ""
            choices.append((f"{kind} {counts[message.role]}: version {message.branch + 1} of {message.branches}{how}",
                            message.id))
            if near is not None and message.parent_id == near:
                chosen = message.id
    return choices, chosen or (choices[-1][1] if choices else None)


def edited_message_id(history: list[ChatMessage], shown: list[dict], index: int) -> str | None:
    """The id of the message at chat entry `index` that the user edited in `shown` (the chat
    as the browser had it, contents flattened to text), or None when that entry is no stored
    message or the chat above it no longer matches the stored conversation (another tab)."""
    messages, ids = chat_messages(history)
    if index >= len(ids) or ids[index] is None or _plain(shown[:index]) != _plain(messages[:index]):
        return None
    return ids[index]


def _plain(messages: list[dict]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in messages]


def parent_of(history: list[ChatMessage], message_id: str) -> str | None:
    """The parent id of a shown message (None when it is the first or not shown)."""
    return next((m.parent_id for m in history if m.id == message_id), None)


def without_last_reply(history: list[ChatMessage]) -> list[ChatMessage]:
    """The history above a reply being regenerated."""
    return history[:-1] if history and history[-1].role == "assistant" else history


def before(history: list[ChatMessage], message_id: str) -> list[ChatMessage]:
    """The history above `message_id` (all of it when the message is not shown)."""
    return next((history[:i] for i, m in enumerate(history) if m.id == message_id), history)


def as_text(text: str) -> str:
    """Markdown source that shows `text` exactly as typed: no formatting, no live HTML,
    images or links, no character dropped (see `_MARKDOWN_ANYWHERE`)."""
    escaped = _MARKDOWN_ANYWHERE.sub(r"\\\1", re.sub(r"[&<>]", lambda m: _ENTITIES[m[0]], text))
    escaped = _AUTOLINK_START.sub(r"\1\\\2", escaped)
    return _MARKDOWN_LINE_START.sub(lambda m: m[1] + m[2][:-1] + "\\" + m[2][-1], escaped)


def from_text(shown: str) -> str:
    """The text `as_text` shows (the inverse: a message edited in the chat is its Markdown source)."""
    return _ENTITY.sub(lambda m: {"amp": "&", "lt": "<", "gt": ">"}[m[1]], _ESCAPED.sub(r"\1", shown))


def inert_markdown(text: str) -> str:
    """A model reply's Markdown with its raw HTML and its image syntax shown as text (an
    image would be fetched from wherever it points); code spans and blocks are kept."""
    parts = _REPLY_CODE.split(text)
    return "".join(part if index % 2 else part.replace("<", "&lt;").replace("![", "!\\[")
                   for index, part in enumerate(parts))


def message_content(role: str, text: str) -> str:
    """What the chat shows of a stored message: replies as Markdown (made inert), the rest as text."""
    return inert_markdown(text) if role == "assistant" else as_text(text)


def user_message(text: str) -> dict:
    return {"role": "user", "content": as_text(text)}


def assistant_message(text: str) -> dict:
    return {"role": "assistant", "content": inert_markdown(text)}


def interrupted_message() -> dict:
    """The notice in place of a reply that was never stored (the app stopped while generating it)."""
    return {"role": "assistant", "content": INTERRUPTED_HINT, "metadata": {"title": INTERRUPTED, "status": "done"}}


def pending_message(title: str = "Reading the conversation…") -> dict:
    """A spinner in place of the reply while the prompt is prefilled."""
    return {"role": "assistant", "content": "", "metadata": {"title": title, "status": "pending"}}


def message_sources(message) -> list:
    """Source passages of an answer, if the service provides them (the documents issue adds
    `sources` to messages and turns: a list of dicts with text / document / page, or strings)."""
    sources = getattr(message, "sources", None)
    if sources is None and isinstance(getattr(message, "stats", None), dict):
        sources = message.stats.get("sources")
    return list(sources or [])


def sources_message(sources: list) -> dict:
    """A collapsible "Sources" block with each passage, its document and page."""
    lines = []
    for source in sources:
        if isinstance(source, dict):
            where = " · ".join(str(x) for x in (source.get("document") or source.get("name"),
                                                f"p. {source['page']}" if source.get("page") else None) if x)
            text = source.get("text") or source.get("quote") or ""
        else:
            where, text = "", str(source)
        quote = as_text(text.strip()).replace("\n", "\n> ")
        lines.append(f"> {quote}" + (f"\n>\n> — *{as_text(where)}*" if where else ""))
    return {"role": "assistant", "content": "\n\n".join(lines),
            "metadata": {"title": f"Sources ({len(sources)})", "status": "done"}}


# ----------------------------------------------------------------------------- numbers


def last_stats(history: list[ChatMessage]) -> dict:
    """Stats of the most recent assistant message ({} before the first reply)."""
    for message in reversed(history):
        if message.role == "assistant" and message.stats:
            return message.stats
    return {}


@dataclass(frozen=True, slots=True)
class ContextUse:
    """How the conversation's room is used, in tokens."""

    window: int  # the most tokens a conversation holds
    documents: int
    history: int  # system prompt, template markup and the conversation so far
    reply_budget: int  # max_new_tokens
    model_window: int = 0  # the model's own window, past which Spotlight reads (0: `window`)

    @property
    def beyond(self) -> int:
        """Tokens past the model's own window: read through Spotlight's retrieval."""
        return max(0, self.used - self.model_window) if self.model_window else 0

    @property
    def used(self) -> int:
        return self.documents + self.history

    @property
    def room(self) -> int:
        return max(0, self.window - self.used)


def context_use(window: int, documents: list[DocumentInfo], history: list[ChatMessage], reply_budget: int,
                count_tokens: Callable[[str], int], system_prompt: str = "", model_window: int = 0) -> ContextUse:
    """Split the context between documents and conversation. Documents count their stored
    token numbers; the conversation is counted now (`count_tokens`) plus the chat template's
    markup per message, so the gauge is right even before the first reply."""
    document_tokens = sum(d.n_tokens if d.n_tokens is not None else count_tokens(d.name) for d in documents)
    markup = TEMPLATE_TOKENS * (len(history) + 1) + DOCUMENT_WRAPPER_TOKENS * len(documents)
    conversation = count_tokens(system_prompt) + sum(count_tokens(m.content) for m in history) + markup
    return ContextUse(window, document_tokens, conversation, reply_budget, model_window)


def gauge_html(use: ContextUse | None) -> str:
    """A three-part bar: document / conversation / free, with the numbers spelled out."""
    if use is None or use.window <= 0:
        return '<div class="gauge-empty">Context window: model not loaded yet</div>'
    parts = [("doc", use.documents), ("hist", use.history)]
    bars = "".join(
        f'<span class="g-{name}" style="width:{min(100.0, 100.0 * n / use.window):.2f}%"></span>' for name, n in parts
    )
    reply_room = min(use.room, use.reply_budget)
    warn = ' gauge-warn' if use.room < use.reply_budget else ''
    return (
        f'<div class="gauge{warn}" title="context window {use.window:,} tokens">'
        f'<div class="gauge-bar">{bars}</div>'
        f'<div class="gauge-legend"><span class="k-doc">■</span> documents {use.documents:,} · '
        f'<span class="k-hist">■</span> conversation {use.history:,} · '
        f'<span class="k-free">■</span> room left {use.room:,} of {use.window:,} tokens '
        f'(reply up to {reply_room:,}){beyond_text(use)}</div></div>'
    )


def beyond_text(use: ContextUse) -> str:
    """The gauge's note on what lies past the model's own window ("" when nothing does)."""
    if not use.beyond:
        return ""
    return (f' · <span class="k-beyond">{use.beyond:,} tokens lie beyond the model\'s {use.model_window:,}-token '
            f'window and are read through Spotlight</span>')


def spotlight_share(spotlight: SpotlightConfig, n_tokens: int, measured: float | None = None,
                    dense_engine: bool = False, measured_spotlight: bool = True) -> str:
    """Share of the context attention reads per decode step: measured when the turn carries
    it (`measured`, the mean over its steps; `measured_spotlight`: whether that turn decoded
    with Spotlight), else estimated from the configured budget; `dense_engine`: the engine
    decodes densely whatever the settings say."""
    if measured is not None:
        if not measured_spotlight:
            return "Spotlight off: every step read the whole context"
        line = f"Spotlight read {100 * measured:.1f}% of the context per step"
        if measured >= 1.0 and n_tokens < spotlight.dense_below:
            line += f" (dense below {spotlight.dense_below:,} tokens)"
        return line
    if not spotlight.enabled:
        return "Spotlight off: every step reads the whole context"
    if n_tokens < spotlight.dense_below:
        return f"Spotlight: dense below {spotlight.dense_below:,} tokens (reads 100%)"
    share = f"≈{100 * spotlight.budget(n_tokens) / n_tokens:.1f}%"
    if dense_engine:
        return f"dense decode: reads 100% per step (Spotlight would read {share}, estimated)"
    return f"Spotlight reads {share} of the context per step (estimated)"


def turn_line(stats: dict | Turn | None, spotlight: SpotlightConfig, dense_engine: bool = False) -> str:
    """One line of numbers for a finished (or running) turn."""
    if stats is None:
        return ""
    if isinstance(stats, Turn):
        stats = stats.stats()
    if not stats or stats.get("finish") is None and not stats.get("decode_tokens"):
        return ""
    cached, computed = stats.get("cached_tokens", 0), stats.get("prefill_tokens", 0)
    restored = stats.get("restored_tokens", 0)
    parts = [f"{cached:,} tokens cached · {computed:,} computed now"]
    if restored:
        parts.append(f"restored {restored:,} tokens from disk")
    if stats.get("prefill_tps") and computed >= SPEED_MIN_PREFILL:
        parts.append(f"prefill {stats['prefill_tps']:,.0f} tok/s")
    if decoded := stats.get("decode_tokens"):
        speed = f" at {stats.get('decode_tps', 0):,.1f} tok/s" if decoded >= SPEED_MIN_DECODE else ""
        parts.append(f"decode {decoded:,} token{'s' if decoded != 1 else ''}{speed}")
    parts.append(spotlight_share(spotlight, cached + computed, stats.get("read_share"), dense_engine,
                                 stats.get("spotlight", True)))
    if stats.get("regenerated_at") is not None:
        parts.append(f"regenerated at temperature {stats['regenerated_at']:g}")
    if stats.get("finish") == "cancelled":
        parts.append("stopped")
    elif stats.get("finish") == "length":
        parts.append("reached the reply limit")
    return " · ".join(parts)


def live_line(turn: Turn) -> str:
    """Numbers while a reply streams, or while the documents are read before it (an upload
    that was stopped or killed part way is read on first): tokens, the measured speed, time left."""
    if turn.reading is None:
        return f"generating… {len(turn.text):,} characters"
    done, total = turn.reading
    line = f"reading the documents on where an earlier reading stopped… {done:,} of {total:,} tokens"
    if turn.reading_tps > 0:
        line += f" ({turn.reading_tps:,.0f} tokens/s, about {math.ceil((total - done) / turn.reading_tps):,} s left)"
    return line


def live_message(turn: Turn) -> dict:
    """The reply's bubble while it streams: the pending one until its first token."""
    return pending_message() if turn.reading is not None else assistant_message(turn.text)


def chips_html(documents: list[DocumentInfo]) -> str:
    """Attachments as chips: name, pages (when known) and tokens; never the text."""
    if not documents:
        return f'<div class="chips-empty">{NO_DOCUMENTS}</div>'
    chips = []
    for document in documents:
        details = []
        pages = document.pages
        if pages:
            details.append(f"{pages} page{'s' if pages != 1 else ''}")
        if document.n_tokens is not None:
            details.append(f"{document.n_tokens:,} tokens")
        else:
            details.append(f"{document.n_chars:,} characters")
        chips.append(
            f'<span class="chip" title="{html.escape(document.name)}">{html.escape(document.name)}'
            f'<small> · {" · ".join(details)}</small></span>'
        )
    return '<div class="chips">' + "".join(chips) + "</div>"


# ----------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True)
class SettingsForm:
    """What the settings panel edits."""

    model_path: str
    temperature: float
    top_p: float
    max_new_tokens: int
    repetition_penalty: float
    system_prompt: str
    spotlight_enabled: bool
    spotlight_ratio: float


def settings_form(config: AppConfig) -> SettingsForm:
    s = config.sampling
    return SettingsForm(config.engine.model_path or "", s.temperature, s.top_p, s.max_new_tokens,
                        s.repetition_penalty, config.system_prompt, config.spotlight.enabled, config.spotlight.ratio)


def apply_settings(config: AppConfig, form: SettingsForm) -> tuple[AppConfig, list[str]]:
    """The config the form asks for, and a note per change about what it invalidates.
    Raises ValueError (from the config dataclasses) for out-of-range values."""
    engine: EngineConfig = replace(config.engine, model_path=model_path(form.model_path))
    sampling: SamplingConfig = replace(
        config.sampling, temperature=float(form.temperature), top_p=float(form.top_p),
        max_new_tokens=int(form.max_new_tokens), repetition_penalty=float(form.repetition_penalty),
    )
    spotlight: SpotlightConfig = replace(config.spotlight, enabled=bool(form.spotlight_enabled),
                                         ratio=float(form.spotlight_ratio))
    new = config.with_(engine=engine, sampling=sampling, spotlight=spotlight, system_prompt=form.system_prompt)
    notes = []
    if engine != config.engine:
        notes.append("**Model changed:** caches computed with the old model are not reused; each conversation "
                     "is read again on its next message (its messages are kept).")
    if form.system_prompt != config.system_prompt:
        notes.append("**System prompt changed:** it applies to new conversations. A new system prompt is a new "
                     "prefix, so their cache is built from scratch; existing conversations keep theirs.")
    if spotlight.enabled != config.spotlight.enabled:
        mode = "with Spotlight" if spotlight.enabled else "densely"
        notes.append(f"**Spotlight changed:** replies now decode {mode}. Caches are keyed by the Spotlight "
                     "encoders (none when off): a conversation without a cache stored for this setting is read "
                     "again on its next message.")
    elif spotlight != config.spotlight:
        notes.append("**Spotlight budget changed:** applies from the next reply; cached context and codes are kept.")
    if sampling != config.sampling:
        notes.append("**Sampling changed:** applies from the next reply; cached context is kept.")
    return new, notes


def settings_values(form: SettingsForm) -> dict:
    """The form as the values the store keeps (field name -> value), to apply at the next start."""
    return asdict(form)


def saved_config(config: AppConfig, saved: dict) -> AppConfig:
    """`config` with the saved settings (`settings_values`) applied over it: fields it does not
    name keep `config`'s values, unknown names are ignored, and values that no longer make a
    valid config leave `config` as it is."""
    fields = {name: saved[name] for name in SettingsForm.__dataclass_fields__ if name in saved}
    if not fields:
        return config
    try:
        return apply_settings(config, replace(settings_form(config), **fields))[0]
    except (ValueError, TypeError):
        return config


def settings_note(notes: list[str]) -> str:
    """The note under the settings after a change was applied."""
    return "\n\n".join(["Settings applied."] + notes)


# ----------------------------------------------------------------------------- models (Settings -> Models)

MODEL_HINT = ("**Your own models:** put GGUF files or Hugging Face directories (config.json + *.safetensors) of "
              "Llama, Qwen2 or Mistral models in `{folder}`; they are listed here (the list is read when the page "
              "opens and after Apply). A model without trained Spotlight encoders runs with untrained codes.")


def model_path(text: str) -> str | None:
    """EngineConfig.model_path for what the Model path box says: None for empty or the default's name."""
    text = text.strip()
    return None if text in ("", DEFAULT_MODEL) else text


def model_help() -> str:
    """--model's help text."""
    return (f"a packaged model's name ({', '.join(packaged_model_names())}), a GGUF file or a Hugging Face "
            f"directory; the Settings tab lists what is installed (default: {DEFAULT_MODEL})")


def models_hint(config: AppConfig) -> str:
    return MODEL_HINT.format(folder=config.home / "models")


def _size_text(size_bytes: int) -> str:
    mb = size_bytes / MB
    return f"{mb:.1f} MB" if mb < 10 else f"{mb:,.0f} MB"


def models_table_html(models: list[InstalledModel], current: str | None) -> str:
    """The installed models as an HTML table (name, window, size, Spotlight encoders, problem);
    `current` (EngineConfig.model_path) marks the row in use."""
    in_use = current or DEFAULT_MODEL
    rows = []
    for m in models:
        name = html.escape(m.name) + (" <b>(in use)</b>" if m.ref == in_use else "")
        window = f"{m.window:,} tokens" if m.window else "unknown"
        encoders = "trained" if m.encoders == "trained" else "untrained codes"
        rows.append(f"<tr><td title=\"{html.escape(m.ref)}\">{name}</td><td>{m.kind}</td><td>{window}</td>"
                    f"<td>{_size_text(m.size_bytes)}</td><td>{encoders}</td><td>{html.escape(m.problem)}</td></tr>")
    head = ("<tr><th>Model</th><th>Kind</th><th>Window</th><th>Size</th><th>Spotlight encoders</th>"
            "<th>Problem</th></tr>")
    body = "".join(rows) or '<tr><td colspan="6">No model installed.</td></tr>'
    return f'<table class="models"><thead>{head}</thead><tbody>{body}</tbody></table>'


def model_choices(models: list[InstalledModel]) -> list[tuple[str, str]]:
    """(label, --model value) of each usable installed model, for the model dropdown."""
    return [(f"{m.name} · {m.window:,} tokens" if m.window else m.name, m.ref) for m in models if not m.problem]


def model_choice(models: list[InstalledModel], current: str | None) -> str | None:
    """The dropdown's value: the model in use when it is listed, else none."""
    in_use = current or DEFAULT_MODEL
    return in_use if any(ref == in_use for _, ref in model_choices(models)) else None


def load_warnings(before: AppConfig, after: AppConfig, warnings: tuple[str, ...]) -> list[str]:
    """The engine's warnings (e.g. untrained Spotlight encoders) to show after Apply: only when
    it changed the model or Spotlight (a new temperature does not repeat them)."""
    changed = before.engine != after.engine or before.spotlight != after.spotlight
    return list(warnings) if changed else []


def warning_notes(warnings: list[str]) -> list[str]:
    """Warnings as notes under the settings."""
    return [f"**Note:** {text[0].upper()}{text[1:]}." for text in warnings]


# ----------------------------------------------------------------------------- uploads


def upload_refusal(report) -> str | None:
    """The error for an upload of which no file could be attached (an `IngestReport` with
    errors and no documents), else None."""
    if report.errors and not report.documents:
        return " ".join(message for _, message in report.errors)
    return None


def upload_notices(report) -> tuple[list[str], list[str]]:
    """(warnings, notes) to toast after an upload: each refused file, then what the reading
    and the prefill report."""
    return ([message for _, message in report.errors],
            report.warnings + (report.resume.notices if report.resume else []))


# ----------------------------------------------------------------------------- errors


def toast_text(text: str) -> str:
    """`text` for a toast, which Gradio shows as HTML: a file name such as "<img src=...>.pdf"
    stays its characters (and fetches nothing)."""
    return html.escape(text, quote=False)


def error_text(error: Exception) -> str:
    """A toast message for a service error (drops hints aimed at programmers)."""
    text = getattr(error, "message", None) or str(error)  # gr.Error keeps its text in .message
    return re.sub(r"\s*\((ChatService|service)\.[a-z_]+\(\)\)", "", text)


# ----------------------------------------------------------------------------- Spotlight encoders (Settings)

TRAINING_COST = ("Training runs in the background on one CPU core, at low priority: the chat stays usable, "
                 "a little slower, while it runs (from about an hour for a small model; the time left shows "
                 "once it has started). Cancel keeps what it learnt; Resume continues from there.")


@dataclass(frozen=True)
class EncodersPanel:
    """What the Settings tab's Encoders group shows: its text, the Train button's label (None:
    hidden), whether Cancel shows, and `reload`: the trained checkpoint the service should load
    now ("" when there is none new; app.py runs that reload in the model's queue)."""

    text: str
    train_label: str | None = None
    cancel: bool = False
    reload: str = ""


def minutes_left(seconds: float | None) -> str:
    """"about 12 min left", "about 2 h 5 min left", "less than a minute left"; while unknown, "estimating the time left"."""
    if seconds is None:
        return "estimating the time left"
    if seconds < 60:
        return "less than a minute left"
    minutes = math.ceil(seconds / 60)
    if minutes < 90:
        return f"about {minutes} min left"
    return f"about {minutes // 60} h {minutes % 60} min left"


def training_line(progress) -> str:
    """A running training's progress (`spotlight.TrainingProgress`), in words."""
    if progress.phase == "recording":
        return (f"recording the model's attention on the training text (sequence {progress.recorded + 1} of "
                f"{progress.sequences})…" if progress.recorded < progress.sequences else "recording done, starting…")
    if progress.phase in ("training", "writing") and progress.total:
        return f"step {progress.step:,} of {progress.total:,}, {minutes_left(progress.seconds_left)}"
    return "starting (loading the model)…"


def encoders_panel(status) -> EncodersPanel:
    """The Encoders group for a `chat.encoders.EncoderStatus`."""
    name = status.checkpoint.name if status.checkpoint is not None else ""
    untrained = "Spotlight encoders: **untrained codes** (retrieval less precise)."
    if status.state == "unloaded":
        return EncodersPanel("Spotlight encoders: the model is not loaded yet.")
    if status.state == "off":
        return EncodersPanel("Spotlight encoders: not used (Spotlight attention is off).")
    if status.state == "trained":
        used = " They are used from the next reply." if status.trained_here else ""
        return EncodersPanel(f"Spotlight encoders: **trained** ({as_text(name)}).{used}")
    if status.state == "ready":
        return EncodersPanel(f"Spotlight encoders: **trained** ({as_text(name)}). They are used from the next reply.",
                             reload=str(status.checkpoint))
    if status.state == "training":
        return EncodersPanel(f"{untrained} Training them: {training_line(status.progress)}", cancel=True)
    if status.state == "paused":
        progress = status.progress
        at = f" at step {progress.saved_step:,} of {progress.total:,}" if progress.saved_step else ""
        return EncodersPanel(f"{untrained} Training paused{at}; Resume continues from there (in the background, "
                             "on one CPU core).", "Resume training")
    if status.state == "failed":
        return EncodersPanel(f"{untrained} Training failed: {as_text(status.progress.message)}", "Train encoders")
    return EncodersPanel(f"{untrained} {TRAINING_COST}", "Train encoders")
