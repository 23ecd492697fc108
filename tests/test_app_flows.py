"""The app's main flows over HTTP with gradio_client, on the deterministic echo engine (tests/fakes.py).

Issue: "The Gradio app: a long-document chat people enjoy, tested in a real browser".
Each `Client` is one browser tab: it keeps its own `gr.State` (the open conversation).
The real-model flow is in test_app.py; the browser flows in test_browser.py.
"""
import json
import re
import time
from pathlib import Path

import pytest
from gradio_client import Client, handle_file

from chat.service import ChatService
from chat.ui_model import SPEED_MIN_PREFILL
from fakes import echo_engine, free_port
from chat.config import AppConfig
from spotlight.config import SamplingConfig, SpotlightConfig

REPLY_LIMIT = 200  # max_new_tokens: "/long" replies run this long unless stopped


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, service) of an app on the echo engine, 20 ms per generated word."""
    import app

    home = tmp_path_factory.mktemp("app-flows")
    config = AppConfig(home=home, sampling=SamplingConfig(max_new_tokens=REPLY_LIMIT), system_prompt="Be brief.")
    service = ChatService(config, _engine=echo_engine(delay=0.02))
    demo = app.serve(service, port=free_port(), prevent_thread_lock=True, quiet=True)
    yield demo.local_url, service
    demo.close()
    service.close()


@pytest.fixture
def tab(server):
    """A fresh browser tab (its own gr.State), with a new empty conversation open."""
    client = Client(server[0], verbose=False)
    client.opened = open_id(client.predict(api_name="/new_session"))  # the conversation this tab shows
    return client


def status(outputs) -> str:
    """The status line: turn numbers, or the last error ("⚠ ...", also shown as a toast)."""
    return outputs[STATS] if isinstance(outputs, tuple) else outputs


# VIEW outputs as the client returns them (gr.State is hidden): sessions, title, chatbot, chips, gauge, stats,
# versions; streaming events add the message box
SESSIONS, TITLE, CHAT, CHIPS, GAUGE, STATS, VERSIONS, MSG = range(8)
RATIO = SpotlightConfig().ratio
STALE = "This conversation changed in another tab; it has been refreshed. Look at it, then try again."  # the settings form's default budget


def open_id(outputs) -> str:
    return outputs[SESSIONS]["value"]


def texts(chat) -> list[tuple[str, str]]:
    """Chatbot value -> [(role, text)]."""
    return [(m["role"], "".join(p.get("text", "") for p in m["content"])) for m in chat]


def history(client, session_id):
    return client.predict(session_id, api_name="/history")


def run(client, *args, api_name):
    """Submit a streaming event; returns (every streamed output, the final outputs)."""
    job = client.submit(*args, api_name=api_name)
    streamed = list(job)
    job.result()  # raises if the handler crashed (user errors come back in the status line)
    return streamed, job.outputs()[-1]


def write(tmp_path, name, data) -> str:
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(path)


# ----------------------------------------------------------------------------- chat


def test_send_streams_the_reply_and_stores_it(tab):
    streamed, final = run(tab, "hello brave new world", api_name="/send")
    chats = [texts(out[CHAT]) for out in streamed]
    assert chats[0] == [("user", "hello brave new world"), ("assistant", "")]  # the pending reply, at once
    assert texts(final[CHAT]) == [("user", "hello brave new world"), ("assistant", "Echo: hello brave new world")]
    assert final[MSG] == ""  # the textbox was cleared
    assert final[TITLE] == "### hello brave new world"  # titled from the first message
    computed = int(re.search(r"\d+ tokens cached · (\d+) computed now", final[STATS]).group(1))
    assert ("prefill" in final[STATS]) == (computed >= SPEED_MIN_PREFILL)  # a speed only where it means something
    assert "decode 5 tokens" in final[STATS]
    assert "conversation" in final[GAUGE] and "room left" in final[GAUGE]
    stored = history(tab, open_id(final))
    assert [(m["role"], m["content"]) for m in stored] == texts(final[CHAT])


def test_second_turn_reuses_the_cache(tab):
    run(tab, "first question", api_name="/send")
    _, final = run(tab, "second question", api_name="/send")
    cached, computed = map(int, re.search(r"([\d,]+) tokens cached · ([\d,]+) computed", final[STATS]).groups())
    assert cached > computed > 0


def test_stop_ends_generation_and_keeps_the_partial_reply(tab, server):
    job = tab.submit("/long story please", api_name="/send")
    while not any("word3" in str(out[CHAT]) for out in job.outputs()):
        time.sleep(0.02)
    tab.predict(api_name="/stop")
    final = job.result()
    reply = texts(final[CHAT])[-1][1]
    assert reply.startswith("word1 word2 word3") and len(reply.split()) < REPLY_LIMIT
    assert "stopped" in final[STATS]
    stored = history(tab, open_id(final))
    assert stored[-1]["content"] == reply and stored[-1]["stats"]["finish"] == "cancelled"
    assert not server[1]._flags.is_running(open_id(final))  # the engine is free again


def test_regenerate_keeps_the_old_reply_as_a_branch(tab):
    _, first = run(tab, "tell me again", api_name="/send")
    _, final = run(tab, api_name="/regenerate")
    assert texts(final[CHAT]) == [("user", "tell me again"), ("assistant", "Echo: tell me again")]
    stored = history(tab, open_id(final))
    assert (stored[-1]["branch"], stored[-1]["branches"]) == (1, 2)


def test_edit_an_earlier_message_branches_and_resubmits(tab):
    run(tab, "my first question", api_name="/send")
    _, final = run(tab, "a follow-up", api_name="/send")
    first_user = history(tab, open_id(final))[0]
    _, edited = run(tab, first_user["id"], "my better question", api_name="/edit")
    assert texts(edited[CHAT]) == [("user", "my better question"), ("assistant", "Echo: my better question")]
    stored = history(tab, open_id(edited))
    assert (stored[0]["branch"], stored[0]["branches"]) == (1, 2)  # the original is kept as a sibling


def test_versions_switch_between_an_edit_and_the_original(tab):
    run(tab, "the original question", api_name="/send")
    first = history(tab, tab.opened)[0]
    _, edited = run(tab, first["id"], "the edited question", api_name="/edit")
    edited_id = history(tab, tab.opened)[0]["id"]
    assert edited[VERSIONS]["choices"] == [["Question 1: version 2 of 2", edited_id]]
    assert edited[VERSIONS]["value"] == edited_id and edited[VERSIONS]["visible"] is True
    older = tab.predict(edited_id, api_name="/older_version")
    assert texts(older[CHAT]) == [("user", "the original question"), ("assistant", "Echo: the original question")]
    assert older[VERSIONS]["choices"] == [["Question 1: version 1 of 2", first["id"]]]
    assert older[VERSIONS]["value"] == first["id"]
    assert texts(tab.predict(first["id"], api_name="/older_version")[CHAT])[0] == ("user", "the original question")
    newer = tab.predict(first["id"], api_name="/newer_version")
    assert texts(newer[CHAT]) == [("user", "the edited question"), ("assistant", "Echo: the edited question")]
    plain = tab.predict(api_name="/new_session")
    assert plain[VERSIONS]["choices"] == [] and plain[VERSIONS]["visible"] is False


def test_undo_hides_the_last_exchange_and_returns_its_text(tab):
    run(tab, "keep this", api_name="/send")
    _, final = run(tab, "take this back", api_name="/send")
    undone = tab.predict(api_name="/undo")
    assert undone[MSG] == "take this back"  # back in the textbox, ready to edit
    assert texts(undone[CHAT]) == [("user", "keep this"), ("assistant", "Echo: keep this")]


# ----------------------------------------------------------------------------- sessions


def test_rename_search_open_and_delete(server, tab):
    _, final = run(tab, "Lisbon itinerary ideas", api_name="/send")
    session_id = open_id(final)
    renamed = tab.predict("Trip to Lisbon", api_name="/rename")
    assert renamed[TITLE] == "### Trip to Lisbon"
    assert any(label.startswith("Trip to Lisbon") for label, _ in renamed[SESSIONS]["choices"])
    found = tab.predict("itinerary", api_name="/search")
    assert [value for _, value in found["choices"]] == [session_id]

    other = Client(server[0], verbose=False)  # another tab opens it by id
    other.predict("", api_name="/search")  # lists every conversation (the radio's choices)
    opened = other.predict(session_id, api_name="/open_session")
    assert texts(opened[CHAT]) == texts(final[CHAT])

    after = tab.predict(api_name="/delete")
    assert session_id not in [value for _, value in after[SESSIONS]["choices"]]
    assert session_id not in [s.id for s in server[1].list_sessions()]


def test_a_page_load_reopens_the_latest_conversation(server, tab):
    _, final = run(tab, "remember me", api_name="/send")
    reloaded = Client(server[0], verbose=False).predict(api_name="/open_initial")  # a new tab, or after a reload
    assert open_id(reloaded) == open_id(final)
    assert texts(reloaded[CHAT]) == texts(final[CHAT])


def exported_path(outputs) -> str:
    """The gr.File update's file path (a dict with "value" when visibility changes too)."""
    value = outputs["value"] if isinstance(outputs, dict) and "value" in outputs else outputs
    return value["path"] if isinstance(value, dict) else value


def test_export_markdown_and_json_then_import(tab):
    _, final = run(tab, "export me", api_name="/send")
    markdown = Path(exported_path(tab.predict(api_name="/export_markdown")))
    assert markdown.name == "export-me.md"
    assert "export me" in markdown.read_text() and "Echo: export me" in markdown.read_text()
    exported = Path(exported_path(tab.predict(api_name="/export_json")))
    assert exported.suffix == ".json" and "export me" in json.dumps(json.loads(exported.read_text()))
    imported = tab.predict(handle_file(str(exported)), api_name="/import_json")
    assert open_id(imported) != open_id(final)
    assert texts(imported[CHAT]) == texts(final[CHAT])


# ----------------------------------------------------------------------------- documents


def test_upload_documents_shows_chips_and_reads_them_into_the_cache(tab, tmp_path):
    notes = write(tmp_path, "notes.md", "# Notes\n\nThe courier arrives on Tuesday.\n")
    plain = write(tmp_path, "facts.txt", "The vault code is 7481.\n" * 20)
    view = tab.predict([handle_file(notes), handle_file(plain)], api_name="/upload")
    assert "notes.md" in view[CHIPS] and "facts.txt" in view[CHIPS]
    assert re.search(r"facts\.txt<small> · 480 tokens", view[CHIPS])  # byte tokenizer: 1 token per byte
    assert "documents 5" in view[GAUGE]  # 480 + the markdown file's tokens
    _, final = run(tab, "what is the vault code", api_name="/send")
    cached = int(re.search(r"([\d,]+) tokens cached", final[STATS]).group(1).replace(",", ""))
    assert cached > 480  # the documents were prefilled at upload: the question reused them


def test_unsupported_and_broken_files_get_a_clear_message(tab, tmp_path):
    refused = tab.predict([handle_file(write(tmp_path, "sheet.xlsx", b"PK\x03\x04junk"))], api_name="/upload")
    assert re.match(r"⚠ sheet\.xlsx: \.xlsx files are not supported\. Upload one of .*\.pdf", status(refused))
    broken = tab.predict([handle_file(write(tmp_path, "broken.pdf", b"%PDF-1.7\nnot really a pdf"))], api_name="/upload")
    assert status(broken).startswith("⚠ broken.pdf")
    good = write(tmp_path, "ok.txt", "Fine text.\n")
    view = tab.predict([handle_file(good), handle_file(write(tmp_path, "empty.txt", b""))], api_name="/upload")
    assert "ok.txt" in view[CHIPS] and "empty.txt" not in view[CHIPS]  # the good file is still attached


def test_summarize_needs_a_document_then_asks_for_a_summary(tab, tmp_path):
    _, refused = run(tab, api_name="/summarize")
    assert status(refused) == "⚠ Attach a document first, then press Summarize."
    tab.predict([handle_file(write(tmp_path, "memo.txt", "Quarterly results were strong.\n"))], api_name="/upload")
    _, final = run(tab, api_name="/summarize")
    assert texts(final[CHAT])[-1] == ("assistant", 'Echo: Summarize the document "memo.txt".')


# ----------------------------------------------------------------------------- bad input


def test_empty_message_is_refused_and_nothing_changes(tab):
    _, final = run(tab, "   ", api_name="/send")
    assert status(final) == "⚠ the message is empty; type something to send"
    assert final[CHAT] == [] and history(tab, tab.opened) == []


def test_version_arrows_with_nothing_to_switch_say_what_to_do(tab):
    run(tab, "a question never edited", api_name="/send")
    for api_name in ("/older_version", "/newer_version"):
        refused = tab.predict(None, api_name=api_name)
        assert status(refused) == "⚠ Nothing to switch: edit or regenerate a message first, then pick it here."
        assert refused[CHAT] == {"__type__": "update"}  # gr.skip(): the chat is left as it was
    assert [m["content"] for m in history(tab, tab.opened)] == ["a question never edited",
                                                                "Echo: a question never edited"]


def test_sending_while_a_reply_streams_waits_its_turn(server, tab):
    """Two tabs on the same conversation: the second send queues behind the engine; as the first
    tab's reply was stored meanwhile, unseen by the second tab, it refreshes and keeps the typed text."""
    long_job = tab.submit("/long first", api_name="/send")
    while not any("word2" in str(out[CHAT]) for out in long_job.outputs()):
        time.sleep(0.02)
    session_id = tab.opened
    second = Client(server[0], verbose=False)
    second.predict("", api_name="/search")
    second.predict(session_id, api_name="/open_session")
    second_job = second.submit("second tab says hi", api_name="/send")
    time.sleep(0.2)
    assert not second_job.done()  # queued behind the running reply (one engine)
    tab.predict(api_name="/stop")
    long_job.result()
    refused = second_job.result()
    assert (status(refused), refused[MSG]) == (f"⚠ {STALE}", "second tab says hi")
    assert [role for role, _ in texts(refused[CHAT])] == ["user", "assistant"]  # the first tab's reply, shown now
    _, final = run(second, "second tab says hi", api_name="/send")
    roles = [m["role"] for m in history(second, session_id)]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert texts(final[CHAT])[-1] == ("assistant", "Echo: second tab says hi")


def test_undo_in_a_stale_tab_refreshes_instead_of_acting_on_an_unseen_exchange(server, tab):
    """Issue #19 item 7: undo in a tab that never showed the last exchange (sent from another tab)."""
    run(tab, "asked here", api_name="/send")
    other = Client(server[0], verbose=False)
    other.predict("", api_name="/search")  # its list, as a page load fills it
    other.predict(tab.opened, api_name="/open_session")
    run(other, "asked in the other tab", api_name="/send")
    refused = tab.predict(api_name="/undo")
    assert (status(refused), refused[MSG]) == (f"⚠ {STALE}", {"__type__": "update"})  # the box is left alone
    assert texts(refused[CHAT]) == [("user", "asked here"), ("assistant", "Echo: asked here"),
                                    ("user", "asked in the other tab"), ("assistant", "Echo: asked in the other tab")]
    assert len(history(tab, tab.opened)) == 4  # nothing was undone
    undone = tab.predict(api_name="/undo")  # now the tab shows that exchange: undo acts on it
    assert (undone[MSG], texts(undone[CHAT])) == ("asked in the other tab",
                                                  [("user", "asked here"), ("assistant", "Echo: asked here")])
    assert status(other.predict("Renamed", api_name="/rename")) == f"⚠ {STALE}"  # it did not see the undo
    run(tab, "one more", api_name="/send")
    assert status(other.predict(api_name="/delete")) == f"⚠ {STALE}"  # nor this exchange
    assert (server[1].get(tab.opened).title, len(history(tab, tab.opened))) == ("asked here", 4)


def test_a_conversation_deleted_in_another_tab(server, tab):
    _, final = run(tab, "soon gone", api_name="/send")
    session_id = open_id(final)
    server[1].delete(session_id)  # e.g. from another tab
    _, final = run(tab, "are you there?", api_name="/send")
    assert "it may have been deleted" in status(final)
    assert final[MSG] == "are you there?"  # the typed text is back in the textbox
    assert open_id(final) is None and session_id not in [v for _, v in final[SESSIONS]["choices"]]


def test_settings_bad_model_path_keeps_the_current_model(server, tab):
    current = server[1]
    values = ("/nonexistent/model.gguf", 0.0, 1.0, REPLY_LIMIT, 1.0, "Be brief.", True, RATIO)
    note = tab.predict(*values, api_name="/apply_settings")
    assert note.startswith("⚠ the model could not be loaded: model path '/nonexistent/model.gguf' does not exist")
    _, final = run(tab, "still working?", api_name="/send")
    assert texts(final[CHAT])[-1] == ("assistant", "Echo: still working?")
    assert server[1] is current


def test_settings_apply_to_the_next_reply_and_new_conversations(tmp_path):
    import app

    service = ChatService(AppConfig(home=tmp_path, system_prompt="Be brief."), _engine=echo_engine())
    demo = app.serve(service, port=free_port(), prevent_thread_lock=True, quiet=True)
    try:
        client = Client(demo.local_url, verbose=False)
        unchanged = client.predict("", 0.0, 1.0, 256, 1.1, "Be brief.", True, RATIO, api_name="/apply_settings")
        assert unchanged == "Nothing changed."
        note = client.predict("", 0.0, 1.0, 3, 1.1, "Be thorough.", True, RATIO, api_name="/apply_settings")
        assert note.startswith("Settings applied.")
        assert "**System prompt changed:**" in note and "**Sampling changed:**" in note and "Model" not in note
        _, final = run(client, "/long reply please", api_name="/send")
        assert texts(final[CHAT])[-1] == ("assistant", "word1 word2 word3")  # max reply tokens is now 3
        assert "reached the reply limit" in status(final)
        exported = json.loads(Path(exported_path(client.predict(api_name="/export_json"))).read_text())
        assert "Be thorough." in json.dumps(exported)  # the new conversation got the new system prompt
    finally:
        demo.close()


def test_a_password_protects_the_app_on_a_lan(tmp_path):
    import app

    service = ChatService(AppConfig(home=tmp_path), _engine=echo_engine())
    demo = app.serve(service, port=free_port(), password="s3cret", prevent_thread_lock=True, quiet=True)
    try:
        with pytest.raises(Exception):  # the API is behind the login too
            Client(demo.local_url, verbose=False).predict(api_name="/new_session")
        client = Client(demo.local_url, auth=("any name", "s3cret"), verbose=False)
        assert open_id(client.predict(api_name="/new_session"))
    finally:
        demo.close()
        service.close()
