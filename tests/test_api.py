"""The OpenAI-compatible API (chat/api.py, chat/http_api.py) with the official `openai` client.

Issue #23: "An OpenAI-compatible API whose prompt memory survives restarts". Servers run
in-process on a free loopback port over the echo engine (tests/fakes.py) and a temporary
data directory; a restart is a new ChatService + server on the same directory.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import httpx
import openai
import pytest

from chat.api import API_TITLE, ApiConfig
from chat.config import AppConfig
from chat.http_api import ApiServer
from chat.service import ChatService
from fakes import EchoEngine, echo_engine, free_port
from spotlight.config import SamplingConfig

SYSTEM = {"role": "system", "content": "Be brief."}
LIMIT = 50  # max_new_tokens: "/long" replies run this long unless stopped


@dataclass
class StopEcho(EchoEngine):
    """The echo engine honouring `stop` like the real decode loop (text before the stop string, "stop")."""

    def stream(self, context, prompt_ids, sampling, **kwargs):
        text = ""
        for step in super().stream(context, prompt_ids, sampling, **kwargs):
            hit = next((s for s in sampling.stop_strings if s in text + step.text), None)
            if hit is not None:
                cut = (text + step.text).index(hit)
                yield type(step)(step.token, (text + step.text)[len(text):cut])
                yield type(step)(None, "", "stop", step.stats or _stats(kwargs))
                return
            text += step.text
            yield step


def _stats(_kwargs):
    from spotlight.generate import Stats

    return Stats()


class Running:
    """A service + API server on one data directory; `restart()` reopens both on it."""

    def __init__(self, home, api: ApiConfig = ApiConfig(), delay: float = 0.0, engine_type=EchoEngine):
        self.home, self.api, self.delay, self.engine_type = home, api, delay, engine_type
        self._open()

    def _open(self):
        base = echo_engine(delay=self.delay)
        engine = self.engine_type(base.config, base.args, base.model, base.tokenizer, base.source, base.policy,
                                  delay=self.delay)
        config = AppConfig(home=self.home, sampling=SamplingConfig(max_new_tokens=LIMIT), system_prompt="Default.")
        self.service = ChatService(config, _engine=engine)
        self.server = ApiServer(self.service, self.api, port=free_port()).start()
        self.url = self.server.url

    def client(self, key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0)

    def restart(self):
        self.close()
        self._open()

    def close(self):
        self.server.close()
        self.service.close()


@pytest.fixture
def running(tmp_path):
    server = Running(tmp_path / "home", engine_type=StopEcho)
    yield server
    server.close()


def chat(client, messages, **options):
    return client.chat.completions.create(model="spotlight", messages=messages, **options)


def usage(response) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens."""
    u = response.usage
    return u.prompt_tokens, u.prompt_tokens_details.cached_tokens, u.completion_tokens


def test_models_lists_the_one_model(running):
    assert [(m.id, m.object) for m in running.client().models.list().data] == [("spotlight", "model")]


def test_a_chat_completion_answers_and_stores_an_api_conversation(running):
    response = chat(running.client(), [SYSTEM, {"role": "user", "content": "hello there"}])
    assert (response.object, response.choices[0].message.role, response.choices[0].message.content,
            response.choices[0].finish_reason) == ("chat.completion", "assistant", "Echo: hello there", "stop")
    prompt, cached, completion = usage(response)
    assert (cached, completion) == (0, 3) and prompt > 0
    [session] = running.service.list_sessions()
    assert (session.title, session.system_prompt) == (API_TITLE + "hello there", "Be brief.")
    assert [(m.role, m.content) for m in running.service.history(session.id)] == [
        ("user", "hello there"), ("assistant", "Echo: hello there")]


def test_text_parts_are_joined(running):
    content = [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]
    assert chat(running.client(), [{"role": "user", "content": content}]).choices[0].message.content == "Echo: two parts"


def test_streaming_sends_deltas_a_finish_usage_and_done(running):
    messages = [SYSTEM, {"role": "user", "content": "stream these words"}]
    chunks = list(chat(running.client(), messages, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Echo: stream these words"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    with httpx.stream("POST", running.url + "/chat/completions", timeout=60,  # httpx's default 5 s is short on a busy CI
                      json={"model": "spotlight", "messages": messages, "stream": True}) as raw:
        lines = [line for line in raw.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_the_same_history_reuses_the_cache_and_says_so(running):
    client = running.client()
    first = chat(client, [SYSTEM, {"role": "user", "content": "first question"}])
    again = chat(client, [SYSTEM, {"role": "user", "content": "first question"}])
    assert usage(again)[0] == usage(first)[0] and 0 < usage(again)[1] < usage(again)[0]
    follow_up = [SYSTEM, {"role": "user", "content": "first question"},
                 {"role": "assistant", "content": again.choices[0].message.content},
                 {"role": "user", "content": "and then"}]
    prompt, cached, _ = usage(chat(client, follow_up))
    assert cached > usage(first)[0] and prompt - cached < 40  # only the new user message is computed
    assert len(running.service.list_sessions()) == 1  # one conversation, a branch for the repeat


def test_prompt_memory_survives_a_restart(running):
    messages = [SYSTEM, {"role": "user", "content": "remember me"}]
    reply = chat(running.client(), messages).choices[0].message.content
    running.restart()
    follow_up = messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": "still there?"}]
    response = chat(running.client(), follow_up)
    prompt, cached, _ = usage(response)
    assert response.choices[0].message.content == "Echo: still there?"
    assert prompt - cached < 40 and cached > 0  # the stored conversation's spans were read from disk
    assert len(running.service.list_sessions()) == 1


def test_a_new_history_starts_a_new_conversation_with_its_turns(running):
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}]
    assert chat(running.client(), messages).choices[0].message.content == "Echo: c"
    [session] = running.service.list_sessions()
    assert [(m.role, m.content) for m in running.service.history(session.id)] == [
        ("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "Echo: c")]


def test_x_session_id_binds_a_ui_conversation(running):
    session = running.service.create("From the UI", system_prompt="Be brief.")
    client = running.client()
    response = client.chat.completions.with_raw_response.create(
        model="spotlight", messages=[{"role": "user", "content": "hi"}], extra_headers={"X-Session-Id": session.id})
    assert response.headers["x-session-id"] == session.id
    assert [m.content for m in running.service.history(session.id)] == ["hi", "Echo: hi"]
    with pytest.raises(openai.APIStatusError) as error:  # its history diverges from the request's
        chat(client, [{"role": "user", "content": "other"}, {"role": "assistant", "content": "x"},
                      {"role": "user", "content": "y"}], extra_headers={"X-Session-Id": session.id})
    assert (error.value.status_code, error.value.body["code"]) == (409, "history_mismatch")


def test_an_unknown_session_id_is_a_404(running):
    response = httpx.post(running.url + "/chat/completions", headers={"X-Session-Id": "nope"},
                          json={"messages": [{"role": "user", "content": "hi"}]})
    assert (response.status_code, response.json()["error"]["code"]) == (404, "conversation_not_found")


def test_stop_strings_end_the_reply(running):
    response = chat(running.client(), [{"role": "user", "content": "one two three four"}], stop=["three"])
    assert (response.choices[0].message.content, response.choices[0].finish_reason) == ("Echo: one two ", "stop")


def test_max_tokens_limits_the_reply(running):
    response = chat(running.client(), [{"role": "user", "content": "/long"}], max_tokens=3)
    assert (response.choices[0].message.content, response.choices[0].finish_reason) == ("word1 word2 word3", "length")


def test_plain_completions(running):
    response = running.client().completions.create(model="spotlight", prompt="plain prompt")
    assert (response.object, response.choices[0].text) == ("text_completion", "Echo: plain prompt")
    streamed = running.client().completions.create(model="spotlight", prompt="plain prompt", stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "Echo: plain prompt"


@pytest.mark.parametrize("body, param", [
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_bad_requests_get_openai_shaped_400s(running, body, param):
    response = httpx.post(running.url + "/chat/completions", json={"model": "spotlight", **body})
    error = response.json()["error"]
    assert (response.status_code, error["type"], error["param"]) == (400, "invalid_request_error", param)
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_unknown_fields_are_ignored(running):
    response = chat(running.client(), [{"role": "user", "content": "hi"}], extra_body={"frobnicate": True})
    assert response.choices[0].message.content == "Echo: hi"


def test_invalid_json_and_huge_bodies_are_refused(tmp_path):
    server = Running(tmp_path / "home", ApiConfig(max_body_bytes=2048))
    try:
        bad = httpx.post(server.url + "/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
        huge = httpx.post(server.url + "/chat/completions",
                          json={"messages": [{"role": "user", "content": "x" * 4096}]})
        assert [(bad.status_code, bad.json()["error"]["code"]), (huge.status_code, huge.json()["error"]["code"])] == [
            (400, "invalid_json"), (413, "request_too_large")]
    finally:
        server.close()


def test_a_prompt_longer_than_the_window_is_a_400_naming_the_window(running):
    window = running.service.context_window()
    with pytest.raises(openai.BadRequestError) as error:
        chat(running.client(), [{"role": "user", "content": "x" * (window + 10)}])
    assert error.value.body["code"] == "context_length_exceeded"
    assert f"{window:,} tokens" in error.value.body["message"]
    assert running.service.list_sessions() == []  # refused before anything was stored


def test_a_prompt_past_the_models_window_is_answered_through_spotlight(tmp_path):
    """Issue #23 item 3: with Spotlight on, a prompt longer than the model's own window goes
    through the long-context path (issue #21) instead of a 400."""
    from spotlight.testing import tiny_engine

    engine = tiny_engine(seed=1, spotlight=True, max_seq_len=512, prefill_chunk=128)
    config = AppConfig(home=tmp_path / "home", sampling=SamplingConfig(max_new_tokens=4))
    service = ChatService(config, _engine=engine)
    server = ApiServer(service, ApiConfig(), port=free_port()).start()
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        document = "".join(f"Line {i} of the long report says nothing new. " for i in range(60))  # 2,700 bytes
        response = chat(client, [{"role": "system", "content": document}, {"role": "user", "content": "Line 7?"}])
        assert response.choices[0].finish_reason in ("stop", "length")
        assert response.usage.prompt_tokens > 5 * service.model_window()
    finally:
        server.close()
        service.close()


def test_a_password_requires_the_bearer_key(tmp_path):
    server = Running(tmp_path / "home", ApiConfig(api_key="s3cret"))
    try:
        with pytest.raises(openai.AuthenticationError) as error:
            server.client("wrong").models.list()
        assert error.value.body["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/models").status_code == 401
        assert [m.id for m in server.client("s3cret").models.list().data] == ["spotlight"]
    finally:
        server.close()


def test_a_full_queue_answers_429_with_retry_after(tmp_path):
    server = Running(tmp_path / "home", ApiConfig(max_pending=1), delay=0.02)
    client = server.client()
    try:  # the first reply would run 4000 words (80 s): it holds the one slot until the stream is closed
        with httpx.stream("POST", server.url + "/chat/completions", json={
                "messages": [{"role": "user", "content": "/long"}], "stream": True, "max_tokens": 4000}) as first:
            lines = first.iter_lines()  # kept: a dropped line iterator closes the stream (a disconnect)
            next(lines)  # the first reply is running: the one slot is taken
            busy = httpx.post(server.url + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert (busy.status_code, busy.json()["error"]["code"], busy.headers["retry-after"]) == (
                429, "rate_limit_exceeded", "5")
            with pytest.raises(openai.RateLimitError):  # the official client sees it as such (retries off)
                chat(client, [{"role": "user", "content": "hi"}])
    finally:
        server.close()


def test_a_client_that_disconnects_stops_its_reply(tmp_path):
    server = Running(tmp_path / "home", delay=0.02)
    try:
        with httpx.stream("POST", server.url + "/chat/completions",
                          json={"messages": [{"role": "user", "content": "/long"}], "stream": True}) as response:
            session_id = response.headers["x-session-id"]
            lines = response.iter_lines()
            next(lines), next(lines)  # role chunk, then the first word
        stored = wait_for_reply(server.service, session_id)
        assert stored.stats["finish"] == "cancelled"
        assert len(stored.content.split()) < LIMIT
    finally:
        server.close()


def test_a_non_streaming_client_that_disconnects_stops_its_reply(tmp_path):
    """A non-streaming request has no body to cancel: the server polls for the disconnect while it waits."""
    server = Running(tmp_path / "home", delay=0.02)
    try:  # a 4000-word reply would take 80 s; the client gives up after 0.5 s and closes its connection
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/chat/completions", timeout=httpx.Timeout(10.0, read=0.5),
                       json={"messages": [{"role": "user", "content": "/long"}], "max_tokens": 4000})
        session_id = server.service.list_sessions()[0].id
        stored = wait_for_reply(server.service, session_id)
        assert stored.stats["finish"] == "cancelled"
        assert len(stored.content.split()) < 4000
    finally:
        server.close()


def wait_for_reply(service, session_id, rounds: int = 500):
    """The conversation's stored reply, once its run has ended (bounded polling, no timing assert)."""
    done = threading.Event()
    for _ in range(rounds):
        history = service.history(session_id)
        if history[-1].role == "assistant":  # stored when the run ends
            return history[-1]
        done.wait(0.02)
    raise AssertionError(f"the reply in {session_id} did not end: {json.dumps([m.content for m in history])}")


def test_the_api_is_served_beside_the_ui(tmp_path):
    """app.serve(api=...) mounts /v1 on Gradio's own server; the UI page still answers."""
    import app

    service = ChatService(AppConfig(home=tmp_path / "home", sampling=SamplingConfig(max_new_tokens=LIMIT)),
                          _engine=echo_engine())
    demo = app.serve(service, port=free_port(), api=ApiConfig(), prevent_thread_lock=True, quiet=True)
    try:
        client = openai.OpenAI(base_url=demo.local_url.rstrip("/") + "/v1", api_key="unused", max_retries=0)
        assert chat(client, [{"role": "user", "content": "beside"}]).choices[0].message.content == "Echo: beside"
        assert httpx.get(demo.local_url).status_code == 200
    finally:
        demo.close()
        service.close()


def test_the_command_line_sets_up_the_api():
    import app

    args = app.parse_args(["--api-only", "--api-key", "k", "--api-cors", "http://localhost:3000"])
    assert (args.api_only, args.api_key, args.api_allow_remote, args.api_cors) == (
        True, "k", False, ["http://localhost:3000"])
