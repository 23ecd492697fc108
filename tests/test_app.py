"""app.py's adapters, the display values of chat/ui_model.py, the upload glue of chat/documents.py,
and one real-model flow over HTTP. Issue: "The Gradio app: a long-document chat people enjoy,
tested in a real browser" (flows on the fake engine: test_app_flows.py; browser: test_browser.py).
"""
import dataclasses
import os
from dataclasses import replace
from pathlib import Path

import gradio as gr
import pytest

import app
from app import Components, Handlers, Reply, ServiceRef, View, history_from_gradio, text_of, throttled
from chat import documents, ui_model as ui
from chat.errors import ConversationTooLong
from chat.records import ChatMessage, DocumentInfo, SessionInfo, Turn
from chat.service import ChatService
from fakes import echo_engine, free_port
from chat.config import AppConfig
from spotlight.config import SamplingConfig, SpotlightConfig

# ----------------------------------------------------------------------------- adapters


def test_history_from_gradio_flattens_gradio6_parts():
    history = [
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "plain string", "metadata": None},
        {"role": "user", "content": [{"type": "file", "file": {"path": "/tmp/x.pdf"}}, {"type": "text", "text": "?"}]},
    ]
    assert history_from_gradio(history) == [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "plain string"},
        {"role": "user", "content": "?"},
    ]
    assert text_of({"type": "text", "text": "one part"}) == "one part"


def test_throttled_drops_intermediate_items_but_never_the_last():
    assert list(throttled(range(1000), seconds=60)) == [0, 999]
    assert list(throttled(range(5), seconds=0)) == [0, 1, 2, 3, 4]
    assert list(throttled([], seconds=1)) == []


# ----------------------------------------------------------------------------- the UI's shape (issue #18, item 6)


@pytest.fixture
def ui_parts(tmp_path):
    """(components, handlers, events table) of a UI over the echo engine, built as build_ui builds it."""
    service = ChatService(AppConfig(home=tmp_path / "home", system_prompt="Be brief."), _engine=echo_engine())
    handlers = Handlers(ServiceRef(service))
    with gr.Blocks() as demo:
        components = app.layout(demo, service.config)
        table = app.events(components, handlers)
    yield components, handlers, table
    handlers.service.close()


def test_the_components_are_exactly_those_the_events_table_names(ui_parts):
    components, _, table = ui_parts
    fields = {}
    for field in dataclasses.fields(Components):
        value = getattr(components, field.name)
        for component in value if isinstance(value, tuple) else (value,):
            fields[id(component)] = component
    named = {}
    for event in table:
        for component in [trigger.__self__ for trigger in event.triggers] + event.inputs + event.outputs:
            named[id(component)] = component
    assert named.keys() == fields.keys()  # every named component is a field, and every field is named
    assert [c.elem_id for c in components.view()] == [None, None, "sessions", "title", "chat", "chips", "gauge",
                                                      "turn-stats", "versions", "resume-btn", "continue-btn"]
    assert components.reply() == components.view() + [components.msg]


def test_every_model_bound_event_shares_the_engine_queue(ui_parts):
    components, handlers, table = ui_parts
    engine_bound = {h.__name__ for _, h, _, _, options in table if options.get("concurrency_id") == "engine"}
    assert engine_bound == {"upload", "send", "summarize", "regenerate", "edit", "edit_in_chat", "undo",
                            "older_version", "newer_version", "apply_settings", "refresh", "models_view",
                            "use_trained_encoders"}
    assert all(options["concurrency_limit"] == 1 for *_, options in table if "concurrency_id" in options)


def test_the_encoders_group_shows_untrained_codes_with_the_train_button(tmp_path):
    from spotlight.testing import tiny_engine

    handlers = Handlers(ServiceRef(ChatService(AppConfig(home=tmp_path), _engine=tiny_engine(spotlight=True))))
    note, train, cancel, reload = handlers.encoders()
    assert note == f"Spotlight encoders: **untrained codes** (retrieval less precise). {ui.TRAINING_COST}"
    assert (train.value, train.visible, cancel.visible, reload) == ("Train encoders", True, False, "")
    service = handlers.service
    again = handlers.use_trained_encoders("")
    assert (again[0], again[1].visible, again[2].visible, again[3]) == (note, True, False, "")
    assert handlers.service is service  # no new encoders: the service stays
    dense = Handlers(ServiceRef(ChatService(AppConfig(home=tmp_path), _engine=echo_engine())))
    note, train, cancel, _ = dense.encoders()
    assert (note, train.visible, cancel.visible) == ("Spotlight encoders: not used (Spotlight attention is off).",
                                                     False, False)
    service.close()


def test_each_handler_returns_a_complete_view(ui_parts, tmp_path):
    components, handlers, table = ui_parts
    outputs = {h.__name__: outs for _, h, _, outs, _ in table if h is not None}
    fresh = handlers.new_session()
    session_id = fresh.session
    assert isinstance(fresh, View) and (fresh.title, fresh.chat, fresh.chips, fresh.status) == (
        "### New chat", [], ui.chips_html([]), "")
    assert (fresh.sessions.value, [value for _, value in fresh.sessions.choices]) == (session_id, [session_id])
    assert (fresh.versions.choices, fresh.versions.visible) == ([], False)
    streamed = list(handlers.send(session_id, "hello there"))
    assert all(isinstance(r, Reply) and isinstance(r.view, View) for r in streamed)
    assert (streamed[0].view.chat, streamed[0].view.status, streamed[0].msg) == (
        [ui.user_message("hello there"), ui.pending_message()], ui.READING, "")
    final = streamed[-1]
    assert final.view.chat == [ui.user_message("hello there"), ui.assistant_message("Echo: hello there")]
    assert final.view.title == "### hello there" and "tokens cached" in final.view.status
    notes = tmp_path / "notes.txt"
    notes.write_text("The vault code is 7481.\n")
    views = {
        "open_initial": handlers.open_initial(None), "open_session": handlers.open_session(session_id),
        "rename": handlers.rename(session_id, "Vault"), "upload": handlers.upload(session_id, [str(notes)]),
        "undo": handlers.undo(session_id), "new_session": handlers.new_session(), "delete": handlers.delete(None),
        "import_json": handlers.import_json(handlers.export_json(session_id).value["path"]),
        "send": final,
    }
    for name, result in views.items():
        assert len(app.gradio_values(result, len(outputs[name]))) == len(outputs[name]), name
    assert views["rename"].title == "### Vault" and "notes.txt" in views["upload"].chips
    assert views["undo"].msg == "hello there" and views["undo"].view.chat == []
    assert views["import_json"].title == "### Vault" and views["import_json"].session != session_id


def test_gradio_values_puts_a_view_in_output_order():
    view = View("s1", 3, "sessions", "title", [], "chips", "gauge", "status", "versions", "resume", "continue")
    assert app.gradio_values(view, 11) == ("s1", 3, "sessions", "title", [], "chips", "gauge", "status", "versions",
                                           "resume", "continue")
    assert app.gradio_values(Reply(view, "typed"), 12) == (*view, "typed")
    assert app.gradio_values("note", 1) == "note"
    with pytest.raises(AssertionError, match="a View of 11 values for 12 outputs"):
        app.gradio_values(view, 12)


def test_settings_apply_swaps_the_service_in_its_holder(ui_parts):
    _, handlers, _ = ui_parts
    before = handlers.service
    form = ui.settings_form(before.config)
    assert handlers.apply_settings(*dataclasses.astuple(form)) == ui.NOTHING_CHANGED
    assert handlers.service is before
    note = handlers.apply_settings(*dataclasses.astuple(replace(form, temperature=0.5)))
    assert note == "Settings applied.\n\n**Sampling changed:** applies from the next reply; cached context is kept."
    assert handlers.service is not before and handlers.service.config.sampling.temperature == 0.5
    assert handlers.service.saved_settings() == ui.settings_values(replace(form, temperature=0.5))  # issue #19 item 9


def test_settings_models_group_lists_the_folder_and_notes_untrained_codes_after_apply(tmp_path):
    """Issue #22: the Models group lists a tiny model the test put in the models folder; choosing it
    fills in the model path, and applying it says Spotlight uses untrained codes."""
    from spotlight.config import EngineConfig
    from tiny_models import write_tiny_hf_dir

    home = tmp_path / "home"
    hf = write_tiny_hf_dir(home / "models" / "tiny-llama", "llama")
    size = sum(p.stat().st_size for p in hf.iterdir()) / 1e6
    spotlight = SpotlightConfig(bits=64, dense_layers=(0,), dense_below=8, k_min=4, window=4)
    config = AppConfig(home=home, engine=EngineConfig(packages_dir=str(tmp_path / "no-packages")), spotlight=spotlight)
    handlers = Handlers(ServiceRef(ChatService(config, _engine=echo_engine())))
    try:
        table, choice = handlers.models_view()
        assert table == (
            '<table class="models"><thead><tr><th>Model</th><th>Kind</th><th>Window</th><th>Size</th>'
            '<th>Spotlight encoders</th><th>Problem</th></tr></thead><tbody>'
            f'<tr><td title="{hf}">tiny-llama</td><td>hf</td><td>512 tokens</td><td>{size:.1f} MB</td>'
            '<td>untrained codes</td><td></td></tr></tbody></table>')
        assert (choice.choices, choice.value) == ([("tiny-llama · 512 tokens", str(hf))], None)
        assert handlers.choose_model(str(hf)) == str(hf)
        form = replace(ui.settings_form(config), model_path=handlers.choose_model(str(hf)))
        note = handlers.apply_settings(*dataclasses.astuple(form))
        assert note == (
            "Settings applied.\n\n**Model changed:** caches computed with the old model are not reused; each "
            "conversation is read again on its next message (its messages are kept).\n\n**Note:** No trained "
            "Spotlight encoders for this model at 64 bits: using untrained (identity-like) codes, which retrieve "
            "less precisely; train them in Settings -> Encoders or with `python -m spotlight.train`.")
        table, choice = handlers.models_view()
        assert choice.value == str(hf) and f'<td title="{hf}">tiny-llama <b>(in use)</b></td>' in table
        note = handlers.apply_settings(*dataclasses.astuple(replace(form, temperature=0.5)))  # same model: no repeat
        assert note == "Settings applied.\n\n**Sampling changed:** applies from the next reply; cached context is kept."
    finally:
        handlers.service.close()


def test_saved_settings_apply_at_start_under_the_command_line():
    """Issue #19 item 9: the defaults, then the saved Settings tab, then what the command line names."""
    defaults = ui.settings_form(app.startup_config(app.parse_args([]), {}))
    chosen = replace(defaults, max_new_tokens=700, temperature=0.4, spotlight_enabled=False, system_prompt="Hi.")
    saved = ui.settings_values(chosen)
    assert saved == {"model_path": "", "temperature": 0.4, "top_p": chosen.top_p, "max_new_tokens": 700,
                     "repetition_penalty": chosen.repetition_penalty, "system_prompt": "Hi.",
                     "spotlight_enabled": False, "spotlight_ratio": chosen.spotlight_ratio}
    assert ui.settings_form(app.startup_config(app.parse_args([]), saved)) == chosen
    overridden = app.startup_config(app.parse_args(["--max-new-tokens", "64", "--model", "/m.gguf"]), saved)
    assert ui.settings_form(overridden) == replace(chosen, max_new_tokens=64, model_path="/m.gguf")
    plain = app.startup_config(app.parse_args([]), {})
    assert app.startup_config(app.parse_args([]), {"max_new_tokens": -5}) == plain  # no longer valid: ignored
    assert app.startup_config(app.parse_args([]), {"a_setting_from_a_newer_version": 1}) == plain
    assert app.startup_config(app.parse_args([]), {"max_new_tokens": 700}).sampling.max_new_tokens == 700
    exact = app.startup_config(app.parse_args(["--far-products", "float32"]), saved).engine
    assert (plain.engine.far_products, exact.far_products) == ("auto", "float32")


# ----------------------------------------------------------------------------- display values


def test_the_status_line_while_documents_are_read_before_a_reply_and_while_it_streams():
    reading = Turn("s", reading=(12_288, 64_000))
    assert ui.live_line(reading) == ("reading the documents on where an earlier reading stopped… 12,288 of "
                                     "64,000 tokens")
    reading.reading_tps = 240.0
    assert ui.live_line(reading) == ("reading the documents on where an earlier reading stopped… 12,288 of "
                                     "64,000 tokens (240 tokens/s, about 216 s left)")
    assert ui.live_message(reading) == ui.pending_message()
    streaming = Turn("s", "Twelve lamps")
    assert (ui.live_line(streaming), ui.live_message(streaming)) == (
        "generating… 12 characters", ui.assistant_message("Twelve lamps"))


def message(role, content, **stats):
    return ChatMessage(f"id-{role}-{content}", role, content, None, stats=stats)


def test_chat_messages_adds_a_sources_block_when_a_reply_has_sources():
    history = [
        message("user", "Where is the vault?"),
        message("assistant", "In Lisbon.", sources=[{"text": "The vault is in Lisbon.", "document": "a.pdf", "page": 9}]),
    ]
    messages, ids = ui.chat_messages(history)
    assert [m["role"] for m in messages] == ["user", "assistant", "assistant"]
    assert ids == ["id-user-Where is the vault?", "id-assistant-In Lisbon.", None]  # the block is no message
    assert messages[2]["metadata"] == {"title": "Sources (1)", "status": "done"}
    assert messages[2]["content"] == "> The vault is in Lisbon.\n>\n> — *a.pdf · p. 9*"


def test_context_use_counts_documents_conversation_and_room():
    docs = [DocumentInfo("d1", "a.txt", 4000, 1000), DocumentInfo("d2", "b.txt", 800, 200)]
    history = [message("user", "x" * 40), message("assistant", "y" * 60)]
    use = ui.context_use(8192, docs, history, 256, count_tokens=len, system_prompt="s" * 10)
    markup = ui.TEMPLATE_TOKENS * 3 + ui.DOCUMENT_WRAPPER_TOKENS * 2
    assert (use.documents, use.history) == (1200, 10 + 40 + 60 + markup)
    assert use.room == 8192 - use.used
    html = ui.gauge_html(use)
    assert "documents 1,200" in html and f"room left {use.room:,} of 8,192 tokens" in html
    assert "gauge-warn" in ui.gauge_html(ui.ContextUse(1000, 900, 50, 256))  # less room than a full reply


def test_the_gauge_says_how_much_lies_beyond_the_model_window():
    docs = [DocumentInfo("d1", "book.txt", 80_000, 20_000)]
    use = ui.context_use(1_000_000, docs, [], 256, count_tokens=len, model_window=8192)
    assert use.beyond == use.used - 8192
    assert (f"{use.beyond:,} tokens lie beyond the model's 8,192-token window and are read through Spotlight"
            in ui.gauge_html(use))
    assert "beyond" not in ui.gauge_html(ui.ContextUse(1_000_000, 4000, 100, 256, 8192))  # all inside the window


def test_turn_line_shows_cached_computed_restored_and_speeds():
    turn = Turn("s", "text", finish="eos", cached_tokens=3000, prefill_tokens=120, restored_tokens=2990,
                prefill_tps=340.0, decode_tokens=20, decode_tps=11.5)
    sparse = SpotlightConfig(dense_below=2048)  # sparse at 3,120 tokens (the default reads them densely)
    line = ui.turn_line(turn, sparse)
    assert line.startswith("3,000 tokens cached · 120 computed now · restored 2,990 tokens from disk")
    assert "prefill 340 tok/s" in line and "decode 20 tokens at 11.5 tok/s" in line
    share = 100 * sparse.budget(3120) / 3120  # sinks + window + retrieved, of 3,120 tokens
    assert f"Spotlight reads ≈{share:.1f}% of the context per step (estimated)" in line
    assert "stopped" in ui.turn_line({**turn.stats(), "finish": "cancelled"}, SpotlightConfig())
    assert ui.turn_line({}, SpotlightConfig()) == ""


def test_the_status_line_calls_a_context_dense_only_inside_the_models_window():
    config = SpotlightConfig(dense_below=16384)
    small = ui.fitted_spotlight(config, ui.ModelFacts(1_000_000, False, len, model_window=8192))  # SmolLM2's window
    large = ui.fitted_spotlight(config, ui.ModelFacts(1_000_000, False, len, model_window=32768))
    assert (small.dense_below, large.dense_below) == (8192, 16384)
    assert ui.spotlight_share(small, 10_000).startswith("Spotlight reads ≈")  # past the 8K window: the far budget
    assert ui.spotlight_share(large, 10_000) == "Spotlight: dense below 16,384 tokens (reads 100%)"
    assert ui.fitted_spotlight(config, ui.ModelFacts(None, True, len)) == config  # no model: as configured


def test_spotlight_share_is_measured_when_the_turn_carries_it():
    config = SpotlightConfig()
    assert ui.spotlight_share(config, 10_000, measured=0.031) == "Spotlight read 3.1% of the context per step"
    assert ui.spotlight_share(config, 500, measured=1.0) == \
        "Spotlight read 100.0% of the context per step (dense below 8,192 tokens)"
    assert ui.spotlight_share(config, 10_000, measured=1.0, measured_spotlight=False) == \
        "Spotlight off: every step read the whole context"
    turn = Turn("s", "text", finish="eos", cached_tokens=9000, decode_tokens=8, read_share=0.04321, spotlight=True)
    assert (turn.stats()["read_share"], turn.stats()["spotlight"]) == (0.0432, True)
    assert "Spotlight read 4.3% of the context per step" in ui.turn_line(turn, config).split(" · ")
    assert "dense below 8,192" in ui.spotlight_share(config, 500)
    assert ui.spotlight_share(SpotlightConfig(enabled=False), 10_000).startswith("Spotlight off")
    share = 100 * config.budget(20_000) / 20_000
    assert ui.spotlight_share(config, 20_000, dense_engine=True) == \
        f"dense decode: reads 100% per step (Spotlight would read ≈{share:.1f}%, estimated)"


def test_screen_of_an_open_conversation(tmp_path):
    config = AppConfig(home=tmp_path)
    info = SessionInfo("s1", "Trip", 0.0, 0.0, "Be brief.")
    history = [message("user", "hi"), message("assistant", "hello", finish="eos", cached_tokens=10, decode_tokens=2)]
    docs = [DocumentInfo("d1", "a.txt", 400, 100)]
    model = ui.ModelFacts(1000, False, len)
    screen = ui.screen([info], info, history, docs, config, model)
    use = ui.context_use(1000, docs, history, config.sampling.max_new_tokens, len, "Be brief.")
    assert screen == ui.Screen(
        ui.session_choices([info]), None, "### Trip", ui.chat_messages(history)[0], ui.chips_html(docs),
        ui.gauge_html(use), ui.turn_line(history[-1].stats, ui.fitted_spotlight(config.spotlight, model)), [], None,
        False, False)
    assert screen.status.endswith("Spotlight: dense below 1,000 tokens (reads 100%)")  # the model's 1,000-token window
    empty = ui.screen([], None, [], [], config, ui.ModelFacts(None, True, len))
    assert empty == ui.Screen([], ui.NO_SESSIONS, "### New conversation", [], ui.chips_html([]),
                              ui.gauge_html(None), "", [], None, False, False)


def test_an_interrupted_reply_and_a_full_window_are_shown_with_what_to_do(tmp_path):
    """Issue #19 items 8 and 13: the notice in place of the reply, and the offer of a new chat."""
    config = AppConfig(home=tmp_path)
    info = SessionInfo("s1", "Trip", 0.0, 0.0, "Be brief.")
    history = [message("user", "hi"), message("assistant", "hello", finish="eos", cached_tokens=10, decode_tokens=2),
               message("user", "and then?")]
    docs = [DocumentInfo("d1", "a.txt", 400, 100)]
    interrupted = ui.screen([info], info, history, docs, config, ui.ModelFacts(1000, False, len), interrupted=True)
    assert interrupted.messages == ui.chat_messages(history)[0] + [{
        "role": "assistant", "content": "Press **Regenerate the reply** to answer it.",
        "metadata": {"title": "Reply interrupted — the app stopped before it finished", "status": "done"}}]
    assert (interrupted.status, interrupted.interrupted, interrupted.window_full) == (
        "⚠ Reply interrupted — the app stopped before it finished. Press **Regenerate the reply** to "
        "answer it.", True, False)
    full = ui.screen([info], info, history, [DocumentInfo("d1", "a.txt", 3000, 800)], config,
                     ui.ModelFacts(1000, False, len))
    assert (full.interrupted, full.window_full) == (False, True)  # less room than a reply of 256 tokens
    assert ui.screen([info], info, [], [DocumentInfo("d1", "a.txt", 3000, 800)], config,
                     ui.ModelFacts(1000, False, len)).window_full is False  # no conversation to continue from
    assert ui.offers_new_chat(ConversationTooLong("full", fresh_chat_fits=True)) is True
    assert ui.offers_new_chat(ConversationTooLong("document too long")) is False


def test_a_regenerated_reply_says_it_was_sampled():
    """Issue #19 item 12: the stats line and the version label name the temperature."""
    config = AppConfig()
    stats = {"finish": "eos", "cached_tokens": 900, "prefill_tokens": 1, "decode_tokens": 5, "decode_tps": 3.0,
             "regenerated_at": 0.7, "seed": 12}
    plain = {key: value for key, value in stats.items() if key not in ("regenerated_at", "seed")}
    assert ui.turn_line(stats, config.spotlight) == ui.turn_line(plain, config.spotlight) + \
        " · regenerated at temperature 0.7"
    history = [message("user", "hi"), ChatMessage("r2", "assistant", "hey", None, 1, 2, stats)]
    assert ui.version_choices(history) == ([("Reply 1: version 2 of 2 (regenerated at temperature 0.7)", "r2")], "r2")


def test_edited_message_id_refuses_a_stale_chat():
    history = [message("user", "one"), message("assistant", "two"), message("user", "three")]
    shown = [{"role": m.role, "content": m.content} for m in history]
    assert ui.edited_message_id(history, shown, 2) == "id-user-three"
    assert ui.edited_message_id(history, [shown[0], {"role": "assistant", "content": "other"}], 2) is None
    assert ui.edited_message_id(history, shown, 3) is None


def test_search_choices_keep_the_open_conversation_only_when_listed():
    found = [SessionInfo("s1", "Trip", 0.0, 0.0, "")]
    choices = ui.session_choices(found)
    assert ui.search_choices(found, "s1") == (choices, "s1")
    assert ui.search_choices(found, "s2") == (choices, None)


def test_chips_show_name_pages_and_tokens_escaped():
    html = ui.chips_html([DocumentInfo("d", "<b>x</b>.txt", 10, 3), DocumentInfo("e", "r.pdf", 900, 250, pages=1)])
    assert "&lt;b&gt;x&lt;/b&gt;.txt<small> · 3 tokens" in html and "<b>" not in html
    assert "r.pdf<small> · 1 page · 250 tokens" in html
    assert ui.NO_DOCUMENTS in ui.chips_html([])


def test_apply_settings_explains_what_each_change_invalidates():
    config = AppConfig(system_prompt="Be brief.")
    same, notes = ui.apply_settings(config, ui.settings_form(config))
    assert (same, notes) == (config, [])
    form = ui.settings_form(config)
    changed, notes = ui.apply_settings(config, ui.SettingsForm(
        "/models/other.gguf", 0.7, form.top_p, 64, form.repetition_penalty, "Be thorough.", False, form.spotlight_ratio))
    assert changed.engine.model_path == "/models/other.gguf" and changed.sampling.temperature == 0.7
    assert changed.system_prompt == "Be thorough." and not changed.spotlight.enabled
    assert [note.split(":")[0] for note in notes] == [
        "**Model changed", "**System prompt changed", "**Spotlight changed", "**Sampling changed"]
    assert "replies now decode densely" in notes[2]
    budget, notes = ui.apply_settings(config, replace(form, spotlight_ratio=0.05))
    assert (budget.spotlight.ratio, notes) == (0.05, [
        "**Spotlight budget changed:** applies from the next reply; cached context and codes are kept."])
    with pytest.raises(ValueError, match="top_p"):
        ui.apply_settings(config, ui.SettingsForm("", 0.0, 0.0, 64, 1.0, "", True, 0.02))


def test_small_helpers():
    assert ui.export_filename("Trip to Lisbon / May", ".md") == "Trip-to-Lisbon-May.md"
    assert ui.export_filename("???", ".json") == "conversation.json"
    assert [ui.ago(s) for s in (5, 120, 7200, 200000)] == ["just now", "2 min ago", "2 h ago", "2 d ago"]
    assert ui.error_text(ValueError("no conversation 'x'. Pick one from the list (ChatService.list_sessions())")) == \
        "no conversation 'x'. Pick one from the list"


# ----------------------------------------------------------------------------- uploads


def test_ingest_attaches_good_files_reports_bad_ones_and_prefills(tmp_path):
    service = ChatService(AppConfig(home=tmp_path), _engine=echo_engine())
    session = service.create()
    good = tmp_path / "notes.md"
    good.write_text("# Notes\n\nThe courier arrives on Tuesday.\n")
    bad = tmp_path / "scan.pdf"
    bad.write_bytes(b"%PDF-1.4 broken")
    seen = []
    report = documents.ingest(service, session.id, [str(good), str(bad)], lambda f, text: seen.append((f, text)))
    assert [d.name for d in report.documents] == ["notes.md"]
    assert [name for name, _ in report.errors] == ["scan.pdf"]
    assert report.resume is not None and report.resume.n_tokens > report.documents[0].n_tokens
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert seen[0][1] == "Reading notes.md"
    assert [d.name for d in service.documents(session.id)] == ["notes.md"]
    assert ui.upload_refusal(report) is None
    assert ui.upload_notices(report) == ([report.errors[0][1]], report.warnings + report.resume.notices)
    refused = documents.ingest(service, session.id, [str(bad)])
    assert ui.upload_refusal(refused) == refused.errors[0][1]
    service.close()


def limited_handlers(tmp_path, **limits):
    """Handlers over the echo engine with `UploadLimits(**limits)`."""
    from chat.config import UploadLimits

    config = AppConfig(home=tmp_path / "home", uploads=UploadLimits(**limits))
    return Handlers(ServiceRef(ChatService(config, _engine=echo_engine())))


def test_uploads_over_the_byte_or_token_limit_are_refused_in_the_users_terms_and_leave_no_chat(tmp_path):
    """Issue #19 item 1: a configurable byte and token cap, stated in the message; item 15:
    no empty "New chat" left by a failed upload."""
    handlers = limited_handlers(tmp_path, max_bytes=2000, max_tokens=300)
    big = tmp_path / "big60.txt"
    big.write_text("river stone " * 200)  # 2,400 bytes
    with pytest.raises(ValueError) as refused:
        handlers.upload(None, [str(big)])
    assert str(refused.value) == ("big60.txt is 2.4 KB; this app reads files up to 2 KB. "
                                  "Split it into smaller files, or save the part you need as a file of its own.")
    long = tmp_path / "long.txt"
    long.write_text("lamp " * 100)  # 500 bytes: 500 tokens of the byte tokenizer
    with pytest.raises(ValueError) as refused:
        handlers.upload(None, [str(long)])
    assert str(refused.value) == ("long.txt is longer than 300 tokens (about 1 page), the most this app reads "
                                  "from one document. Attach a shorter excerpt, or split it into parts.")
    assert handlers.service.list_sessions() == []  # neither refusal left a conversation behind
    fits = tmp_path / "fits.txt"
    fits.write_text("lamp " * 50)
    view = handlers.upload(None, [str(fits)])
    assert [s.title for s in handlers.service.list_sessions()] == ["New chat"] and "fits.txt" in view.chips
    with pytest.raises(ValueError, match="^long.txt is longer than 300 tokens"):
        handlers.upload(view.session, [str(long)])  # into an open conversation: it stays, with its document
    assert [d.name for d in handlers.service.documents(view.session)] == ["fits.txt"]
    handlers.service.close()


class Tab:
    """What Gradio passes a handler as its `gr.Request`: here only the tab's session hash."""

    def __init__(self, session_hash: str):
        self.session_hash = session_hash


def test_closing_the_tab_stops_the_uploads_prefill_within_one_chunk(tmp_path):
    """Issue #19 item 1: "kept working after the tab closed". Gradio calls `tab_closed` on
    unload (tab closed or reloaded); the upload's prefill stops at the next chunk."""
    handlers = limited_handlers(tmp_path)
    doc = tmp_path / "report.txt"
    doc.write_text("The harbour ledger lists seven copper lamps. " * 60)  # 2,700 tokens: 43 chunks of 64
    seen, tab = [], Tab("tab-1")

    def progress(fraction, desc):
        seen.append(desc)
        if desc.startswith("Reading 64 of"):  # the first prefill chunk is done: the tab goes away
            handlers.tab_closed(tab)

    view = handlers.upload(None, [str(doc)], progress=progress, request=tab)
    prefill = [text for text in seen if "tokens into memory" in text]
    assert prefill == [prefill[0]] and prefill[0].startswith("Reading 64 of ")  # no chunk after the close
    session_id = view.session
    assert "report.txt" in view.chips  # the document stays attached; its cache is finished on next use
    assert handlers.service.tab_closed(tab.session_hash) == []  # nothing of that tab runs any more
    report = handlers.service.resume(session_id)
    assert report.computed_tokens == report.n_tokens - 64 - report.restored_tokens  # the rest, computed now
    handlers.service.close()


def test_the_tab_closed_hook_is_wired_to_gradios_unload(tmp_path):
    service = ChatService(AppConfig(home=tmp_path), _engine=echo_engine())
    demo = app.build_ui(service)
    unload = [fn.fn for fn in demo.fns.values() if any(event == "unload" for _, event in fn.targets)]
    assert [f.__name__ for f in unload] == ["tab_closed"]
    service.close()


# ----------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def app_url(engine, tmp_path_factory):
    from app import serve

    config = AppConfig(home=tmp_path_factory.mktemp("app-real"), sampling=SamplingConfig(max_new_tokens=24))
    service = ChatService(config, _engine=engine)
    demo = serve(service, port=free_port(), prevent_thread_lock=True, quiet=True)
    yield demo.local_url
    demo.close()
    service.close()


@pytest.mark.model
def test_streamed_answer_over_http(app_url):
    from gradio_client import Client

    client = Client(app_url, verbose=False)
    job = client.submit("What is the capital of France?", api_name="/send")
    replies = [out[2][-1]["content"][0]["text"] for out in job if out[2] and out[2][-1]["role"] == "assistant"]
    final = job.outputs()[-1]
    assert "Paris" in replies[-1]
    growing = [r for r in replies if r]
    assert len(growing) >= 2 and all(b.startswith(a) for a, b in zip(growing, growing[1:]))  # streamed, in order
    assert "tokens cached" in final[5] and "decode" in final[5]


def test_command_line_defaults_and_password_from_the_environment(monkeypatch):
    from app import parse_args

    monkeypatch.delenv("SPOTLIGHT_PASSWORD", raising=False)
    args = parse_args([])
    assert (args.host, args.port, args.model, args.password, args.max_new_tokens) == ("127.0.0.1", 7860, None, None, None)
    monkeypatch.setenv("SPOTLIGHT_PASSWORD", "from-env")
    assert parse_args(["--port", "8000"]).password == "from-env"
    assert (args.weights, args.quantize) == ("quantized", None)
    assert (parse_args(["--quantize", "q8_0"]).quantize, parse_args(["--weights", "fp32"]).weights) == ("q8_0", "fp32")


TINY_SERVER = """
import sys
from pathlib import Path

import app
from chat.config import AppConfig
from chat.service import ChatService
from spotlight.testing import tiny_engine

service = ChatService(AppConfig(home=Path(sys.argv[1])), _engine=tiny_engine())
service.warm_up()
service.list_sessions()
app.serve(service, port=int(sys.argv[2]), quiet=True)
"""


def memory_mb(pid: int, field: str) -> float:
    """`VmRSS` (resident now) or `VmHWM` (peak since the last reset) of a process, in MiB."""
    line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) / 1024


def text_file(path, n_bytes: int):
    line = ("the river stone lamp ledger north quiet seven orbit maple copper signal harbor " * 25).strip() + "\n"
    with open(path, "w") as out:
        for _ in range(n_bytes // len(line)):
            out.write(line)
    return path


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc (peak RSS reset)")
def test_refusing_a_60_mb_upload_peaks_under_200_mb_above_the_idle_server(tmp_path):
    """Issue #19 item 1 (must show): the app process (tiny model) takes a 60 MB .txt through
    Gradio's upload; its peak RSS (VmHWM, reset just before) stays within 200 MB of its idle
    RSS. So does a file just under the byte limit, which is read and refused by its tokens."""
    import subprocess
    import sys
    import time
    import urllib.request

    from gradio_client import Client, handle_file

    from chat.config import UploadLimits

    big = text_file(tmp_path / "big60.txt", 63_600_000)
    near = text_file(tmp_path / "near.txt", UploadLimits.max_bytes - 100_000)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", TINY_SERVER, str(tmp_path / "home"), str(port)],
                              cwd=Path(app.__file__).parent)
    try:
        url = f"http://127.0.0.1:{port}/"
        for _ in range(240):
            try:
                urllib.request.urlopen(url, timeout=2).close()
                break
            except OSError:
                assert server.poll() is None, "the test server exited"
                time.sleep(0.5)
        client = Client(url, verbose=False)
        idle = memory_mb(server.pid, "VmRSS:")
        peaks, messages = [], []
        for path in (big, near):
            Path(f"/proc/{server.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS now
            outputs = client.predict([handle_file(str(path))], api_name="/upload")
            peaks.append(memory_mb(server.pid, "VmHWM:") - idle)
            messages.append(outputs[5])  # the status line
        after = memory_mb(server.pid, "VmRSS:") - idle
        conversations = client.predict("", api_name="/search")["choices"]
    finally:
        server.terminate()
        server.wait(30)
    print(f"idle {idle:.0f} MiB; peak above idle: 60 MB file {peaks[0]:.0f} MiB, near-limit file {peaks[1]:.0f} MiB; "
          f"after both {after:.0f} MiB")
    assert messages == [
        "⚠ big60.txt is 63.6 MB; this app reads files up to 20 MB. "
        "Split it into smaller files, or save the part you need as a file of its own.",
        "⚠ near.txt is longer than the 8,049 tokens left in this conversation: with Spotlight off the model "
        "reads at most 8,192 tokens at once (about 20 pages). Turn Spotlight on to read beyond that, attach a "
        "shorter excerpt, or start a new chat for it."]
    assert max(peaks) <= 200, peaks
    assert conversations == []  # neither refusal left an empty "New chat"


def test_upload_limits_on_the_command_line():
    from app import parse_args

    args = parse_args([])
    assert (args.max_upload_mb, args.max_document_tokens) == (20.0, None)
    args = parse_args(["--max-upload-mb", "2.5", "--max-document-tokens", "4000"])
    assert (args.max_upload_mb, args.max_document_tokens) == (2.5, 4000)


def test_the_disk_budget_on_the_command_line():
    assert app.startup_config(app.parse_args([]), {}).store.disk_budget_bytes == 8 * 1024**3
    config = app.startup_config(app.parse_args(["--disk-budget-gb", "20"]), {})
    assert (config.disk_budget_bytes, config.store.disk_budget_bytes) == (20 * 10**9, 20 * 10**9)


def test_the_context_cap_on_the_command_line(capsys):
    assert app.startup_config(app.parse_args([]), {}).spotlight.max_context == 1_000_000
    config = app.startup_config(app.parse_args(["--max-context-tokens", "200000"]), {"spotlight_ratio": 0.05})
    assert (config.spotlight.max_context, config.spotlight.ratio) == (200_000, 0.05)
    assert app.main(["--max-context-tokens", "1"]) == 2
    assert capsys.readouterr().err == "error: a conversation must be allowed at least 2 tokens (max_context), got 1\n"


def test_a_bad_disk_budget_stops_the_app_with_the_reason(capsys):
    assert app.main(["--disk-budget-gb", "0"]) == 2
    assert capsys.readouterr().err == "error: the disk budget for the cache must be positive, got 0 bytes\n"


def test_a_bad_upload_limit_stops_the_app_with_the_reason(capsys):
    assert app.main(["--max-upload-mb", "0"]) == 2
    assert capsys.readouterr().err == "error: the upload size limit must be positive, got 0 bytes\n"


def test_a_second_server_on_a_busy_data_directory_stops_before_loading_the_model(tmp_path, monkeypatch, capsys):
    """Issue #19 item 16: the store's lock is taken before the model loads (which takes ~15 s):
    with a model path that does not exist, the message is the store's, not the model's."""
    from memory import Store
    from memory.config import StoreConfig

    holder = Store(StoreConfig(root=tmp_path / "store"))  # another process, as far as the lock goes
    monkeypatch.setenv("SPOTLIGHT_HOME", str(tmp_path))
    try:
        assert app.main(["--model", str(tmp_path / "no-such-model.gguf")]) == 2
    finally:
        holder.close()
    assert capsys.readouterr().err == (f"error: another Spotlight Chat process (pid {os.getpid()}) is using "
                                       f"{tmp_path / 'store'}; close it or set SPOTLIGHT_HOME to another directory\n")


# ----------------------------------------------------------------------------- issue #19: what the browser sees


def test_user_and_document_text_is_shown_as_text_character_for_character():
    typed = "<script>alert(1)</script> <b>bold</b> ![](http://127.0.0.1:9999/x_y) *a* `c` a&amp;b $$x$$ | ~~s~~"
    lines = "# not a heading\n1. not a list\n- nor this\n> nor a quote\nC:\\dir \\* www.example.org me@example.org"
    for text in (typed, lines):
        assert ui.from_text(ui.as_text(text)) == text
    assert ui.as_text(typed) == ("&lt;script&gt;alert(1)&lt;/script&gt; &lt;b&gt;bold&lt;/b&gt; "
                                 "!\\[\\](http\\://127.0.0.1:9999/x\\_y) \\*a\\* \\`c\\` a&amp;amp;b "
                                 "\\$\\$x\\$\\$ \\| \\~\\~s\\~\\~")
    assert ui.as_text(lines) == ("\\# not a heading\n1\\. not a list\n\\- nor this\n&gt; nor a quote\n"
                                 "C:\\\\dir \\\\\\* www\\.example.org me\\@example.org")
    assert ui.user_message("a <b>") == {"role": "user", "content": "a &lt;b&gt;"}


def test_replies_keep_markdown_but_their_html_and_images_are_inert():
    reply = 'See <img src="http://10.0.0.1/x.png"> and ![map](http://10.0.0.1/m.png), **bold**, `<b>` kept\n' \
            "```html\n<i>code</i>\n```\nafter <b>it</b>"
    assert ui.inert_markdown(reply) == ('See &lt;img src="http://10.0.0.1/x.png"> and !\\[map](http://10.0.0.1/m.png), '
                                        "**bold**, `<b>` kept\n```html\n<i>code</i>\n```\nafter &lt;b>it&lt;/b>")
    assert ui.inert_markdown("streaming\n```\n<b>") == "streaming\n```\n<b>"  # an unclosed block is code so far
    history = [message("user", "<b>hi</b>"), message("assistant", "<b>hello</b>")]
    assert ui.chat_messages(history)[0] == [{"role": "user", "content": "&lt;b&gt;hi&lt;/b&gt;"},
                                            {"role": "assistant", "content": "&lt;b>hello&lt;/b>"}]
    sources = ui.sources_message([{"text": "<img src=http://x/y>\nline two", "document": "<b>d</b>.md"}])
    assert sources["content"] == "> &lt;img src=http\\://x/y&gt;\n> line two\n>\n> — *&lt;b&gt;d&lt;/b&gt;.md*"


def test_titles_are_capped_on_rename_import_and_auto_title_and_ellipsized_in_the_sidebar(tmp_path):
    from chat.service import TITLE_LIMIT

    service = ChatService(AppConfig(home=tmp_path), _engine=echo_engine())
    long_title = "Lisbon " * 60
    renamed = service.rename(service.create().id, long_title)
    assert renamed.title == "Lisbon " * 17 + "L" and len(renamed.title) == TITLE_LIMIT
    exported = service.export_json(renamed.id).replace(renamed.title, "Porto\\n" * 100)  # JSON for a newline
    assert service.import_json(exported).title == ("Porto " * 20).rstrip()
    session = service.create()
    list(service.send(session.id, "word " * 40))
    assert service.get(session.id).title == ("word " * 12).rstrip()  # the first 60 characters of the question
    assert service.create("  ").title == "New chat"
    label, _ = ui.session_choices([service.get(renamed.id)], now=service.get(renamed.id).updated)[0]
    assert label == "Lisbon " * 6 + "Lisbo… · just now"  # 47 characters and the ellipsis
    assert (ui.ellipsized("short", 5), ui.ellipsized("longer", 5)) == ("short", "long…")
    service.close()


def test_speeds_show_only_over_enough_tokens_to_mean_something():
    """Issue #19: "prefill 7 tok/s" after a one-token prefill."""
    config = SpotlightConfig(enabled=False)
    short = Turn("s", "t", finish="eos", cached_tokens=900, prefill_tokens=1, prefill_tps=7.0, decode_tokens=1,
                 decode_tps=3.0)
    assert ui.turn_line(short, config) == ("900 tokens cached · 1 computed now · decode 1 token · "
                                           "Spotlight off: every step reads the whole context")
    enough = replace(short, prefill_tokens=ui.SPEED_MIN_PREFILL, prefill_tps=500.0,
                     decode_tokens=ui.SPEED_MIN_DECODE, decode_tps=9.0)
    assert ui.turn_line(enough, config) == ("900 tokens cached · 64 computed now · prefill 500 tok/s · "
                                            "decode 8 tokens at 9.0 tok/s · "
                                            "Spotlight off: every step reads the whole context")


def test_the_gauge_counts_nothing_before_a_conversation_exists(tmp_path):
    config = AppConfig(home=tmp_path, system_prompt="Be brief.")
    nothing = ui.screen([], None, [], [], config, ui.ModelFacts(2048, False, len))
    assert nothing.gauge == ui.gauge_html(ui.ContextUse(2048, 0, 0, config.sampling.max_new_tokens))
    assert "conversation 0 ·" in nothing.gauge


def test_a_search_without_a_match_says_so(ui_parts):
    _, handlers, _ = ui_parts
    handlers.rename(handlers.new_session().session, "Lisbon trip")
    missed = handlers.search_sessions("  harbour ", None)
    assert (missed.choices, missed.value, missed.info) == ([], None, "No conversation matches “harbour”.")
    found = handlers.search_sessions("lisbon", None)
    assert ([label.split(" · ")[0] for label, _ in found.choices], found.info) == (["Lisbon trip"], "")
    assert ui.search_info("", []) == ui.NO_SESSIONS


def test_browser_side_events_label_dark_mode_and_keep_the_conversation_in_the_address(ui_parts):
    components, _, table = ui_parts
    scripts = {(tuple(t.__self__ for t in e.triggers), e.options["js"]) for e in table if "js" in e.options}
    assert scripts == {((components.dark_btn,), app.DARK_JS), ((components.demo,), app.LOAD_JS),
                       ((components.sessions,), app.ADDRESS_JS)}
    assert "spotlightDarkLabel" in app.DARK_JS and "window.spotlightDarkLabel = " in app.HEAD
    assert "spotlightFitSidebar" in app.LOAD_JS and "window.innerWidth < 700" in app.HEAD
    assert "history.replaceState" in app.ADDRESS_JS and "'session'" in app.ADDRESS_JS
    assert "#versions-row:not(:has(#versions)) { display: none; }" in app.CSS


def test_toasts_and_the_status_line_show_file_names_as_text(ui_parts, tmp_path):
    _, handlers, _ = ui_parts
    assert ui.toast_text("<img src=http://10.0.0.1/x>.pdf & co") == "&lt;img src=http://10.0.0.1/x&gt;.pdf &amp; co"
    bad = tmp_path / "<b>budget.xlsx"
    bad.write_bytes(b"PK\x03\x04 not a document")
    view = app.adapted(handlers.upload, ui_parts[0].view(), [ui_parts[0].status])(None, [str(bad)])
    assert view[7].startswith("⚠ &lt;b&gt;budget.xlsx: .xlsx files are not supported")
