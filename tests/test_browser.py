"""End to end in headless Chromium (Playwright + Debian's /usr/bin/chromium, never `playwright install`).

Issue: "The Gradio app: a long-document chat people enjoy, tested in a real browser".
  - fast flows on the echo engine (tests/fakes.py): empty state, upload, streamed answer,
    Esc stops mid-answer, Ctrl+Shift+R regenerates, a broken file's message, dark mode,
    no request leaves the machine, and the render time of a 200-message conversation;
  - issue #19: remote images in messages and documents fetch nothing (inert text, and the CSP),
    HTML in messages shows as its characters, the small display fixes and ?session=ID; uploads and
    exports are refused by URL once used, a second file with the same text shows its own name,
    settings survive a restart; a second tab follows the first without a reload, an interrupted
    reply says so and regenerates (sampled), a full conversation continues in a new chat with its
    documents, a 420 px screen, toasts;
  - the real model (SmolLM2) in a server subprocess: upload a PDF, ask about a fact on its
    last page, stop an answer, restart the server, find the conversation and continue it
    from the cache on disk (the status line says how many tokens were restored).

Screenshots go to $SPOTLIGHT_SCREENSHOTS (e.g. docs/screenshots) when set, else to a temp dir.
Pages load with wait_until="load": a Gradio page keeps an event stream open, so
"networkidle" never comes.
"""
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("SPOTLIGHT_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
]
ROOT = Path(__file__).resolve().parent.parent
VIEWPORT = {"width": 1280, "height": 860}
TIMEOUT_MS = 60_000  # real-model steps on a shared 2-core machine

if importlib.util.find_spec("playwright") is None:
    pytest.skip("playwright is not installed: pip install playwright==1.65.2 (no `playwright install`)",
                allow_module_level=True)
if not shutil.which(CHROMIUM):
    pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install -y chromium (Debian), or set SPOTLIGHT_CHROMIUM",
                allow_module_level=True)

from playwright.sync_api import expect, sync_playwright  # noqa: E402

from fakes import free_port  # noqa: E402


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.outside = []  # every request that would leave this machine
    page.on("request", lambda r: None if r.url.startswith(("http://127.0.0.1", "data:", "blob:"))
            else page.outside.append(r.url))
    yield page
    context.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    target = os.environ.get("SPOTLIGHT_SCREENSHOTS")
    directory = Path(target) if target else tmp_path_factory.mktemp("screenshots")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def shot(page, shots: Path, name: str) -> None:
    page.mouse.move(0, 0)  # no hover effects in the picture
    page.wait_for_timeout(500)  # let transitions (toasts, selection) settle
    page.screenshot(path=str(shots / name))


def open_app(page, url: str) -> None:
    page.goto(url, wait_until="load")
    page.locator("#msg textarea").wait_for()


def ask(page, text: str) -> None:
    box = page.locator("#msg textarea")
    box.fill(text)
    box.press("Enter")


def attach(page, *paths) -> None:
    with page.expect_file_chooser() as chooser:
        page.click("#upload-btn")
    chooser.value.set_files([str(p) for p in paths])


def last_reply(page):
    """The last assistant answer (a Sources block under it is a bot message of its own)."""
    bot = page.locator("#chat [data-testid=bot]")
    return bot.filter(has_not_text=re.compile(r"^\s*Sources \(")).last


def status_line(page):
    return page.locator("#turn-stats")


def tokens_in(text: str, label: str) -> int:
    return int(re.search(rf"([\d,]+) {label}", text).group(1).replace(",", ""))


# ----------------------------------------------------------------------------- on the echo engine


@pytest.fixture(scope="module")
def fake_app(tmp_path_factory):
    import app
    from chat.service import ChatService
    from fakes import echo_engine
    from chat.config import AppConfig
    from spotlight.config import SamplingConfig

    config = AppConfig(home=tmp_path_factory.mktemp("browser-fake"), sampling=SamplingConfig(max_new_tokens=150))
    service = ChatService(config, _engine=echo_engine(delay=0.03))
    demo = app.serve(service, port=free_port(), prevent_thread_lock=True, quiet=True)
    yield demo.local_url, service
    demo.close()
    service.close()


def test_chat_flow_in_the_browser(page, fake_app, shots, tmp_path):
    url, service = fake_app
    open_app(page, url)
    expect(page.locator("#chat")).to_contain_text("Ask about a long document")  # the empty state
    expect(page.locator("#gauge")).to_contain_text("conversation 0 ·")  # issue #19: none exists yet
    expect(page.locator("#older-btn")).to_be_hidden()  # no versions, no arrows
    shot(page, shots, "empty.png")

    notes = tmp_path / "harbour-notes.md"
    notes.write_text("# Harbour notes\n\n" + "The tide tables are on the pier. " * 60 + "\n\nThe ferry leaves at 7:40.\n")
    attach(page, notes)
    expect(page.locator("#chips")).to_contain_text(re.compile(r"harbour-notes\.md · [\d,]+ tokens"))
    expect(page.locator("#gauge")).to_contain_text("documents 2,")

    ask(page, "When does the ferry leave?")
    expect(last_reply(page)).to_have_text("Echo: When does the ferry leave?")
    expect(status_line(page)).to_contain_text("tokens cached")
    assert tokens_in(status_line(page).inner_text(), "tokens cached") > 2000  # read at upload, reused now

    ask(page, "/long tell me everything")  # Esc stops it mid-answer
    expect(last_reply(page)).to_contain_text("word3")
    page.keyboard.press("Escape")
    expect(status_line(page)).to_contain_text("stopped")
    session_id = service.list_sessions(limit=1)[0].id
    stopped = service.history(session_id)[-1]
    assert stopped.stats["finish"] == "cancelled" and len(stopped.content.split()) < 150
    expect(last_reply(page)).to_have_text(stopped.content)  # what is shown is what was stored

    page.keyboard.press("Control+Shift+R")  # regenerate: a second version of the last reply
    expect(status_line(page)).to_contain_text("generating")
    expect(last_reply(page)).to_contain_text("word3")
    page.keyboard.press("Escape")
    expect(status_line(page)).to_contain_text("tokens cached")
    assert service.history(session_id)[-1].branches == 2
    expect(page.locator("#older-btn")).to_be_visible()
    shot(page, shots, "chat-fake.png")

    page.locator("#chat button[aria-label='Edit']").first.click()  # edit the first question and resubmit
    page.locator("#chat textarea").first.fill("When does the last ferry leave?")
    page.locator("#chat button[aria-label='Submit']").first.click()
    expect(last_reply(page)).to_have_text("Echo: When does the last ferry leave?")
    expect(page.locator("#chat [data-testid=user]")).to_have_count(1)  # a new branch from the first message
    first = service.history(session_id)[0]
    assert (first.content, first.branch, first.branches) == ("When does the last ferry leave?", 1, 2)
    expect(status_line(page)).to_contain_text("tokens cached")
    assert tokens_in(status_line(page).inner_text(), "tokens cached") > 2000  # the document was not read again

    bad = tmp_path / "budget.xlsx"
    bad.write_bytes(b"PK\x03\x04 not a document")
    attach(page, bad)
    expect(page.locator(".toast-body").last).to_contain_text(".xlsx files are not supported")
    expect(status_line(page)).to_contain_text("⚠ budget.xlsx")
    expect(page.locator("#chat [data-testid=user]")).to_have_count(1)  # the conversation is still shown
    shot(page, shots, "error.png")

    page.locator(".toast-close").first.click()
    page.get_by_role("tab", name="Settings").click()
    expect(page.locator("#settings-note")).to_be_visible()
    shot(page, shots, "settings.png")
    page.get_by_role("tab", name="Chat").click()
    expect(page.locator("#dark-btn")).to_have_text("Dark mode")
    page.click("#dark-btn")
    expect(page.locator("body")).to_have_class(re.compile(r"\bdark\b"))
    expect(page.locator("#dark-btn")).to_have_text("Light mode")
    shot(page, shots, "dark.png")
    page.locator("#manage").get_by_text("Rename, delete, export").click()
    page.click("#export-md-btn")
    name = page.locator("#export-file td.filename")
    expect(name).to_have_text(re.compile(r"^\s*When-does-the-ferry-leave\s*\.md\s*$"))  # titled from the first question
    assert name.evaluate("(el) => el.scrollWidth <= el.clientWidth && el.clientWidth >= 150"), "a clipped name"
    assert page.outside == []  # nothing left the machine (no fonts, no analytics)


def test_sessions_sidebar_and_two_hundred_messages(page, fake_app, shots, capsys):
    url, service = fake_app
    long_one = service.create("Two hundred messages")
    parent = None
    for index in range(200):
        role = "user" if index % 2 == 0 else "assistant"
        parent = service.store.transcript.add_message(long_one.id, role, f"message {index}: " + "lorem ipsum " * 12,
                                                      parent_id=parent.id if parent else None)
    for title in ("Lisbon trip", "Quarterly report", "Reading list"):
        service.rename(service.create().id, title)
    open_app(page, url)
    sidebar = page.locator("#sessions")
    expect(sidebar).to_contain_text("Reading list")  # the newest is open
    search = page.locator("#search textarea")
    search.press_sequentially("quarterly")  # typed: Gradio's input event needs key events, not fill()
    expect(sidebar.locator("label")).to_have_count(1)
    expect(sidebar).to_contain_text("Quarterly report")
    search.press("Control+A")
    search.press("Backspace")
    expect(sidebar.locator("label")).to_have_count(len(service.list_sessions()))
    search.press_sequentially("zzqx")
    expect(sidebar).to_contain_text("No conversation matches “zzqx”.")
    expect(sidebar.locator("label")).to_have_count(0)
    search.press("Control+A")
    search.press("Backspace")
    expect(sidebar.locator("label")).to_have_count(len(service.list_sessions()))
    shot(page, shots, "sessions.png")

    started = time.perf_counter()
    sidebar.get_by_text("Two hundred messages").click()
    page.wait_for_function("() => document.querySelectorAll('#chat [data-testid=bot]').length === 100"
                           " && document.querySelector('#chat').innerText.includes('message 199:')")
    seconds = time.perf_counter() - started
    with capsys.disabled():
        print(f"\n[browser] opening a 200-message conversation rendered in {seconds:.2f} s (click to last message)")
    expect(page.locator("#title")).to_contain_text("Two hundred messages")
    expect(page).to_have_url(re.compile(rf"[?&]session={long_one.id}$"))  # a reload keeps the place
    page.reload(wait_until="load")
    expect(page.locator("#title")).to_contain_text("Two hundred messages")


class Listener:
    """A loopback HTTP server in a thread that records every request it gets (a remote host)."""

    def __init__(self):
        import http.server
        import threading

        self.paths = []
        record = self.paths.append

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                record(self.path)
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def test_nothing_is_fetched_from_other_hosts_and_html_shows_as_text(page, fake_app):
    """Issue #19, items 1 and 2: remote images in messages and documents stay inert (and the
    CSP would block them), HTML in messages shows as its characters."""
    url, service = fake_app
    csp_reports = []
    page.on("console", lambda m: csp_reports.append(m.text) if "Content Security Policy" in m.text else None)
    with Listener() as remote:
        bait = f'<script>alert("x")</script> <b>bold</b> ![](remote/md) <img src="remote/html">'.replace(
            "remote", remote.url)
        draft = service.create("Imported <b>bait</b>")
        service.attach_text(draft.id, "bait.md", f"The document says {bait}\n")
        service.store.transcript.add_message(draft.id, "user", f"Question {bait}")
        service.store.transcript.add_message(draft.id, "assistant", f"Answer {bait}", metadata={"stats": {
            "finish": "eos", "sources": [{"text": f"Quoted {bait}", "document": "bait.md"}]}})
        imported = service.import_json(service.export_json(draft.id))
        open_app(page, f"{url}?session={imported.id}")
        chat = page.locator("#chat")
        expect(chat.locator("[data-testid=user]")).to_have_text(f"Question {bait}")
        expect(last_reply(page)).to_have_text(f"Answer {bait}")
        expect(page.locator("#title")).to_contain_text("Imported <b>bait</b>")
        ask(page, f"Typed {bait}")
        expect(last_reply(page)).to_have_text(f"Echo: Typed {bait}")
        expect(chat.locator("[data-testid=user]").last).to_have_text(f"Typed {bait}")
        blocked = page.evaluate("(url) => fetch(url).then(() => 'fetched', () => 'blocked')", remote.url + "/fetch")
        assert (blocked, chat.locator(f"img[src^='{remote.url}']").count()) == ("blocked", 0)
        page.click("#new-btn")  # one more round trip after the page rendered
        expect(page.locator("#title")).to_contain_text("New chat")
        assert remote.paths == []
    assert [text for text in csp_reports if remote.url not in text] == []  # the CSP blocked nothing of the app's


def click_until(page, selectors: list[str], done, seconds: float = 20) -> None:
    """Click `selectors` in turn until `done()`: a click that comes while the page is still
    settling (its load event, a row just shown) can do nothing, so try again."""
    deadline = time.monotonic() + seconds
    while True:
        for selector in selectors:
            page.click(selector)
        for _ in range(15):
            if done():
                return
            page.wait_for_timeout(200)
        assert time.monotonic() < deadline, f"clicking {selectors} did nothing"


def served(page, url: str, path) -> int:
    """The HTTP status Gradio's file route answers for a file path (as this tab, with its cookies)."""
    return page.request.get(f"{url.rstrip('/')}/gradio_api/file={path}").status


def test_uploads_and_exports_are_not_served_once_used(page, fake_app, tmp_path):
    """Issue #19 item 4: uploads land in the data directory's short-lived folder and are gone once
    read; an export is served until its conversation is deleted, then refused."""
    url, service = fake_app
    open_app(page, url)
    click_until(page, ["#new-btn"], lambda: "New chat" in page.locator("#title").inner_text())
    notes = tmp_path / "vault-notes.md"
    notes.write_text("# Vault\n\nThe vault opens at noon. " * 20)
    with page.expect_response(lambda response: "/gradio_api/upload" in response.url) as uploaded:
        attach(page, notes)
    paths = uploaded.value.json()
    assert [Path(path).is_relative_to(service.scratch.gradio_dir) for path in paths] == [True]
    expect(page.locator("#chips")).to_contain_text(re.compile(r"vault-notes\.md · [\d,]+ tokens"))  # read
    assert [served(page, url, path) for path in paths] == [403]
    # no upload's bytes left on disk (Gradio's form parser leaves an empty temporary file per browser
    # upload; the folder is emptied at the next start)
    assert [p.stat().st_size for p in service.scratch.gradio_dir.rglob("*") if p.is_file()
            and not p.is_relative_to(service.scratch.exports_dir) and p.stat().st_size] == []

    page.locator("#manage").get_by_text("Rename, delete, export").click()
    page.click("#export-md-btn")
    link = page.locator("#export-file a[download]").first
    expect(link).to_be_attached()
    export = re.search(r"/gradio_api/file=([^?]+)", link.get_attribute("href")).group(1)
    assert Path(urllib.request.unquote(export)).is_relative_to(service.scratch.exports_dir)
    assert served(page, url, export) == 200
    session_id = re.search(r"session=(\w+)", page.url).group(1)
    click_until(page, ["#delete-btn", "#confirm-delete-btn"],
                lambda: session_id not in [s.id for s in service.list_sessions()])
    expect(page.locator("#chips")).not_to_contain_text("vault-notes.md")
    assert served(page, url, export) == 403


def test_the_same_text_attached_under_another_name_shows_that_name(page, fake_app, tmp_path):
    """Issue #19 item 10: a second file with the first one's text is shown under its own name."""
    url, service = fake_app
    text = "Only the owner may open the vault. " * 30
    (tmp_path / "owner_only.txt").write_text(text)
    (tmp_path / "good.txt").write_text(text)
    open_app(page, url)
    for name in ("owner_only.txt", "good.txt"):
        click_until(page, ["#new-btn"], lambda: "New chat" in page.locator("#title").inner_text())
        attach(page, tmp_path / name)
        expect(page.locator("#chips")).to_contain_text(re.compile(re.escape(name) + r" · [\d,]+ tokens"))
    expect(page.locator("#chips")).not_to_contain_text("owner_only.txt")
    ask(page, "Who may open the vault?")
    expect(last_reply(page)).to_have_text("Echo: Who may open the vault?")
    expect(page.locator("#chips")).to_contain_text("good.txt")
    expect(page.locator("#chat")).not_to_contain_text("owner_only.txt")  # nor in the sources under the answer


def test_settings_are_kept_across_a_restart(page, tmp_path):
    """Issue #19 item 9: a reply length applied in Settings is still there after the app restarts."""
    import app
    from chat import ui_model as ui
    from chat.config import AppConfig
    from chat.service import ChatService
    from fakes import echo_engine

    engine, gradio_dir = echo_engine(), os.environ.get("GRADIO_TEMP_DIR")
    reply_length = page.get_by_label("number input for Max reply tokens")
    try:
        first = app.ServiceRef(ChatService(AppConfig(home=tmp_path / "home"), _engine=engine))
        demo = app.serve(first.get(), port=free_port(), prevent_thread_lock=True, quiet=True, holder=first)
        open_app(page, demo.local_url)
        page.get_by_role("tab", name="Settings").click()
        expect(reply_length).to_have_value("256")
        reply_length.fill("700")
        reply_length.press("Tab")
        page.click("#apply-btn")
        expect(page.locator("#settings-note")).to_contain_text("Sampling changed")
        demo.close()
        first.get().close()  # the service Apply swapped in

        second = ChatService(AppConfig(home=tmp_path / "home"), _engine=engine)  # as app.main starts
        second = app.with_saved_settings(second, ui.saved_config(second.config, second.saved_settings()))
        demo = app.serve(second, port=free_port(), prevent_thread_lock=True, quiet=True)
        open_app(page, demo.local_url)
        page.get_by_role("tab", name="Settings").click()
        expect(reply_length).to_have_value("700")
        assert second.config.sampling.max_new_tokens == 700
        demo.close()
        second.close()
    finally:  # the module's other app keeps its own temporary folder
        if gradio_dir is None:
            os.environ.pop("GRADIO_TEMP_DIR", None)
        else:
            os.environ["GRADIO_TEMP_DIR"] = gradio_dir


def test_settings_lists_the_models_folder_and_a_choice_fills_in_the_path(page, tmp_path, shots):
    """Issue #22: a tiny GGUF the test put in <home>/models is a row of the Models table; choosing it
    in the dropdown fills in the model path that Apply loads."""
    import app
    from chat.config import AppConfig, EngineConfig
    from chat.service import ChatService
    from fakes import echo_engine
    from tiny_models import write_tiny_gguf

    home, gradio_dir = tmp_path / "home", os.environ.get("GRADIO_TEMP_DIR")
    gguf = write_tiny_gguf(home / "models" / "tiny-llama.gguf", "llama", window=2048)
    config = AppConfig(home=home, engine=EngineConfig(packages_dir=str(tmp_path / "no-packages")))
    service = ChatService(config, _engine=echo_engine())
    try:
        demo = app.serve(service, port=free_port(), prevent_thread_lock=True, quiet=True)
        open_app(page, demo.local_url)
        page.get_by_role("tab", name="Settings").click()
        rows = page.locator("#models-table tbody tr")
        expect(rows).to_have_count(1)
        expect(rows.first.locator("td")).to_have_text(["tiny-llama.gguf", "gguf", "2,048 tokens", "0.0 MB",
                                                       "untrained codes", ""])
        expect(page.locator("#models-hint")).to_contain_text(str(home / "models"))
        page.locator("#model-choice input").click()
        page.get_by_role("option", name="tiny-llama.gguf · 2,048 tokens").click()
        expect(page.get_by_label("Model path")).to_have_value(str(gguf))
        shot(page, shots, "settings-models.png")
        demo.close()
    finally:
        service.close()
        if gradio_dir is None:  # the module's other app keeps its own temporary folder
            os.environ.pop("GRADIO_TEMP_DIR", None)
        else:
            os.environ["GRADIO_TEMP_DIR"] = gradio_dir


def test_settings_show_untrained_encoders_and_offer_to_train_them(page, tmp_path):
    """Issue #22: a model without trained encoders says so in Settings and offers to train them."""
    import app
    from chat.config import AppConfig
    from chat.service import ChatService
    from spotlight.testing import tiny_engine

    gradio_dir = os.environ.get("GRADIO_TEMP_DIR")
    service = ChatService(AppConfig(home=tmp_path / "home"), _engine=tiny_engine(spotlight=True))
    try:
        demo = app.serve(service, port=free_port(), prevent_thread_lock=True, quiet=True)
        open_app(page, demo.local_url)
        page.get_by_role("tab", name="Settings").click()
        expect(page.locator("#encoders-note")).to_contain_text("Spotlight encoders: untrained codes (retrieval less "
                                                                "precise).")
        expect(page.locator("#encoders-note")).to_contain_text("on one CPU core")
        expect(page.locator("#train-encoders-btn")).to_be_visible()
        expect(page.locator("#train-encoders-btn")).to_have_text("Train encoders")
        expect(page.locator("#cancel-training-btn")).to_be_hidden()
        demo.close()
    finally:  # the module's other app keeps its own temporary folder
        service.close()
        if gradio_dir is None:
            os.environ.pop("GRADIO_TEMP_DIR", None)
        else:
            os.environ["GRADIO_TEMP_DIR"] = gradio_dir


# ----------------------------------------------------------------------------- issue #19: tabs, crashes, windows


def test_a_second_tab_shows_the_first_tabs_exchange_without_a_reload(browser, fake_app):
    """Item 7: a tab polls the conversation's version and refreshes when another tab changed it."""
    url, service = fake_app
    session = service.create("Two tabs")
    first, second = (browser.new_context(viewport=VIEWPORT).new_page() for _ in range(2))
    try:
        for tab in (first, second):
            tab.set_default_timeout(TIMEOUT_MS)
            open_app(tab, f"{url}?session={session.id}")
            expect(tab.locator("#title")).to_contain_text("Two tabs")
        ask(first, "Asked in the first tab")
        expect(last_reply(first)).to_have_text("Echo: Asked in the first tab")
        expect(last_reply(second)).to_have_text("Echo: Asked in the first tab")  # no reload: the timer's check
        expect(second.locator("#chat [data-testid=user]")).to_have_text(["Asked in the first tab"])
        second.click("#undo-btn")  # it shows that exchange now, so undo acts on it
        expect(second.locator("#msg textarea")).to_have_value("Asked in the first tab")
        expect(first.locator("#chat [data-testid=user]")).to_have_count(0)  # and the first tab follows
    finally:
        first.context.close()
        second.context.close()


def test_an_interrupted_reply_says_so_and_regenerates_with_sampling(page, fake_app, shots):
    """Items 8 and 12: a question stored without its reply (the process died while generating)."""
    url, service = fake_app
    session = service.create("Interrupted")
    for _ in service.send(session.id, "First question"):
        pass
    service.store.transcript.add_message(session.id, "user", "Second question")  # then the crash
    open_app(page, f"{url}?session={session.id}")
    chat = page.locator("#chat")
    expect(chat).to_contain_text("Reply interrupted — the app stopped before it finished")
    expect(status_line(page)).to_contain_text("Reply interrupted — the app stopped before it finished")
    expect(page.locator("#resume-btn")).to_be_visible()
    shot(page, shots, "interrupted.png")
    page.click("#resume-btn")
    expect(last_reply(page)).to_have_text("Echo: Second question")
    expect(status_line(page)).to_contain_text("regenerated at temperature 0.7")
    expect(chat).not_to_contain_text("Reply interrupted")
    expect(page.locator("#resume-btn")).to_be_hidden()
    assert service.history(session.id)[-1].stats["regenerated_at"] == 0.7


def test_a_full_conversation_continues_in_a_new_chat_with_its_documents(page, fake_app):
    """Item 13: the error says what filled the window and what to do; the button keeps the documents."""
    url, service = fake_app
    window = service.context_window()
    session = service.create("Full")
    service.attach_text(session.id, "logbook.txt", "The tide turned at noon. " * ((window - 600) // 25))
    parent = None
    for index in range(4):  # earlier turns that fill what is left of the window
        parent = service.store.transcript.add_message(session.id, "user" if index % 2 == 0 else "assistant",
                                                      "A long turn about tides. " * 6, parent_id=parent and parent.id)
    open_app(page, f"{url}?session={session.id}")
    expect(page.locator("#continue-btn")).to_be_visible()  # the gauge has less room than a reply
    ask(page, "And the next tide?")
    expect(status_line(page)).to_contain_text("This conversation has filled the model's context window")
    expect(status_line(page)).to_contain_text(f"the model reads at most {window:,} at once")
    expect(status_line(page)).to_contain_text("Continue in a new chat with logbook.txt (")
    expect(page.locator("#msg textarea")).to_have_value("And the next tide?")  # the question is kept
    page.click("#continue-btn")
    expect(page.locator("#title")).to_contain_text("Full (continued)")
    expect(page.locator("#chips")).to_contain_text("logbook.txt")
    expect(page.locator("#chat [data-testid=user]")).to_have_count(0)
    expect(page.locator("#continue-btn")).to_be_hidden()
    continued = service.list_sessions(limit=1)[0]
    assert (continued.title, service.history(continued.id)) == ("Full (continued)", [])
    assert [d.name for d in service.documents(continued.id)] == ["logbook.txt"]


def test_the_small_things_a_narrow_screen_toasts_and_the_reply_budget(browser, page, fake_app, tmp_path):
    """Item 15: at 420 px the chat shows (the sidebar starts closed), toasts leave Attach and
    Summarize free, and the gauge shows the reply length just applied in Settings."""
    url, service = fake_app
    narrow = browser.new_context(viewport={"width": 420, "height": 860}).new_page()
    try:
        narrow.set_default_timeout(TIMEOUT_MS)
        open_app(narrow, url)
        expect(narrow.locator(".sidebar")).not_to_have_class(re.compile(r"\bopen\b"))
        expect(narrow.locator("#msg textarea")).to_be_in_viewport()
    finally:
        narrow.context.close()

    open_app(page, url)
    bad = tmp_path / "sheet.xlsx"
    bad.write_bytes(b"PK\x03\x04 not a document")
    attach(page, bad)
    toast = page.locator(".toast-body").last
    expect(toast).to_contain_text(".xlsx files are not supported")
    boxes = [page.locator(selector).bounding_box() for selector in ("#upload-btn", "#summarize-btn")]
    area = toast.bounding_box()
    assert all(area["y"] >= box["y"] + box["height"] or area["y"] + area["height"] <= box["y"]
               or area["x"] >= box["x"] + box["width"] or area["x"] + area["width"] <= box["x"] for box in boxes)

    page.get_by_role("tab", name="Settings").click()
    reply_tokens = page.get_by_label("number input for Max reply tokens")
    reply_tokens.fill("97")
    reply_tokens.press("Enter")
    page.click("#apply-btn")
    expect(page.locator("#settings-note")).to_contain_text("Sampling changed")
    page.get_by_role("tab", name="Chat").click()
    try:
        expect(page.locator("#gauge")).to_contain_text("(reply up to 97)")
    finally:
        page.get_by_role("tab", name="Settings").click()  # the module's other tests expect the old length
        reply_tokens.fill("150")
        reply_tokens.press("Enter")
        page.click("#apply-btn")
        expect(page.locator("#settings-note")).to_contain_text("Sampling changed")


# ----------------------------------------------------------------------------- the real model


def tiny_pdf(pages: list[str]) -> bytes:
    """A minimal PDF with one Helvetica text block per page (enough for pypdf to extract)."""
    objects = ["<< /Type /Catalog /Pages 2 0 R >>", "", "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    kids = []
    for text in pages:
        lines = " ".join(f"({line.replace(chr(92), '').replace('(', '').replace(')', '')}) Tj T*"
                         for line in textwrap.wrap(text, 95))
        stream = f"BT /F1 9 Tf 11 TL 40 800 Td {lines} ET"
        objects.append(f"<< /Length {len(stream)} >>\nstream\n{stream}\nendstream")
        objects.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 842] /Contents {len(objects)} 0 R "
                       "/Resources << /Font << /F1 3 0 R >> >> >>")
        kids.append(f"{len(objects)} 0 R")
    objects[1] = f"<< /Type /Pages /Kids [{' '.join(kids)}] /Count {len(kids)} >>"
    out, offsets = b"%PDF-1.4\n", []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n{body}\nendobj\n".encode("latin-1")
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{offset:010d} 00000 n \n".encode() for offset in offsets)
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return out


NEEDLE = "The special magic number for the city of Lisbon is 7481."


def test_closing_the_tab_stops_its_uploads_prefill(browser, tmp_path):
    """Issue #19 item 1: an upload "kept working after the tab closed". Closing the page ends its
    Gradio session (unload), which stops the upload's prefill at the next chunk."""
    import app
    from chat.config import AppConfig
    from chat.service import ChatService
    from fakes import echo_engine

    service = ChatService(AppConfig(home=tmp_path / "home"), _engine=echo_engine(prefill_delay=0.1))
    demo = app.serve(service, port=free_port(), prevent_thread_lock=True, quiet=True)
    doc = tmp_path / "ledger.txt"
    doc.write_text("The harbour ledger lists seven copper lamps. " * 150)  # ~6,700 tokens: 105 chunks, 10 s
    context = browser.new_context(viewport=VIEWPORT)
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        open_app(page, demo.local_url)
        attach(page, doc)
        expect(page.locator("#chips")).to_contain_text(re.compile(r"\d\.\ds"))  # the upload's timer runs
        deadline = time.monotonic() + 60
        while not service.list_sessions() and time.monotonic() < deadline:
            time.sleep(0.1)
        session_id = service.list_sessions()[0].id
        time.sleep(1.0)  # into the prefill (~10 s long)
        context.close()  # the tab goes away mid-prefill
        while time.monotonic() < deadline:  # the upload ends within a chunk of the unload
            try:
                report = service.resume(session_id)
                break
            except ValueError:  # EngineBusy: the upload still runs
                time.sleep(0.1)
        assert report.computed_tokens > report.n_tokens // 2, report  # most of it was never read: stopped early
    finally:
        demo.close()
        service.close()


def report_pdf(essay_text: str, path: Path, pages: int = 4, chars: int = 700) -> Path:
    """A few pages of essay text with the needle on the last page."""
    words = " ".join(essay_text.encode("ascii", "ignore").decode().split())  # Helvetica: keep to ASCII
    texts = [words[i * chars:(i + 1) * chars] for i in range(pages)]
    texts[-1] = texts[-1][: chars // 2] + " " + NEEDLE + " " + texts[-1][chars // 2:]
    path.write_bytes(tiny_pdf(texts))
    return path


class Server:
    """`python app.py` in a subprocess on its own data directory (SPOTLIGHT_HOME)."""

    def __init__(self, home: Path, model_dir: Path, log: Path):
        self.home, self.model_dir, self.log = home, model_dir, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.process = None

    def start(self) -> "Server":
        env = {**os.environ, "SPOTLIGHT_HOME": str(self.home), "GRADIO_ANALYTICS_ENABLED": "False",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        command = [sys.executable, "app.py", "--port", str(self.port), "--model", str(self.model_dir),
                   "--max-new-tokens", "32"]
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=self.log.open("ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"the server exited: {self.log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(self.url, timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"the server did not start in 180 s: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.mark.model
def test_long_document_answer_stop_restart_and_resume(page, essay_text, shots, tmp_path):
    from conftest import TEST_HOME, TEST_MODEL
    from spotlight.loading import resolve

    model_dir = resolve(TEST_MODEL, TEST_HOME).hf_dir  # SmolLM2, converted once for the test suite
    pdf = report_pdf(essay_text, tmp_path / "lisbon-report.pdf")
    server = Server(tmp_path / "home", model_dir, tmp_path / "server.log").start()
    try:
        open_app(page, server.url)
        attach(page, pdf)
        chip = page.locator("#chips")
        expect(chip).to_contain_text(re.compile(r"lisbon-report\.pdf · 4 pages · [\d,]+ tokens"), timeout=120_000)
        document_tokens = tokens_in(chip.inner_text(), "tokens")

        question = "According to the document, what is the special magic number for the city of Lisbon?"
        ask(page, question)
        expect(status_line(page)).to_contain_text("tokens cached", timeout=120_000)
        answer = last_reply(page).inner_text()
        assert "7481" in answer, f"the fact on the last page was not found: {answer!r}"
        expect(page.locator("#chat")).to_contain_text(re.compile(r"Sources \(\d\)"))  # the answer's passages
        shot(page, shots, "chat.png")

        ask(page, "Write a long story about a sailor in Lisbon.")
        expect(page.locator("#chat [data-testid=user]")).to_have_count(2)
        expect(status_line(page)).to_contain_text("generating", timeout=120_000)  # the first words are shown
        page.click("#stop-btn")
        expect(status_line(page)).to_contain_text("stopped", timeout=30_000)
        # Gradio overlays "processing | ..." on the title while an event still runs (seen on a busy machine)
        expect(page.locator("#title")).not_to_contain_text("processing", timeout=30_000)
        title = question[:40]  # named after the first question; the sidebar ellipsizes long titles
        expect(page.locator("#title")).to_contain_text(title)
        expect(page.locator("#sessions")).to_contain_text(title)
    finally:
        server.stop()

    server = Server(tmp_path / "home", model_dir, tmp_path / "server.log").start()  # same data directory
    try:
        open_app(page, server.url)
        # the sidebar is filled by the page's load event, which a just-started server on a busy
        # machine (the whole suite in CI) has answered after the default 30 s once
        in_sidebar = page.locator("#sessions").get_by_text(title)
        expect(in_sidebar).to_be_visible(timeout=120_000)
        in_sidebar.click()
        expect(page.locator("#chat [data-testid=user]")).to_have_count(2)
        expect(page.locator("#chips")).to_contain_text("lisbon-report.pdf")

        ask(page, "Thank you. In one sentence, what is the report about?")
        expect(status_line(page)).to_contain_text("restored", timeout=120_000)
        numbers = status_line(page).inner_text()
        restored, computed = tokens_in(numbers, "tokens from disk"), tokens_in(numbers, "computed now")
        assert restored > document_tokens, numbers  # document + conversation came back from disk
        assert computed < document_tokens // 4, numbers  # the new question was read, not the document again
        shot(page, shots, "restored.png")
        assert page.outside == []
    finally:
        server.stop()
