"""chat/web_guard.py: the Content-Security-Policy, the login back-off and the login on Gradio's
/cancel and /reset routes. Issue #19 (items 1 and 3); the CSP in a browser: test_browser.py."""
import httpx
import pytest

import app
from chat import web_guard
from chat.config import AppConfig
from chat.service import ChatService
from chat.web_guard import CONTENT_SECURITY_POLICY, LoginThrottle, too_many_logins
from fakes import echo_engine, free_port


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_login_throttle_backs_off_exponentially_per_address():
    clock = Clock()
    throttle = LoginThrottle(free_tries=3, window=600, base_delay=2, max_delay=30, clock=clock)
    waits = []
    for _ in range(8):
        throttle.failed("10.0.0.2")
        waits.append(throttle.wait("10.0.0.2"))
    assert waits == [0.0, 0.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert throttle.wait("10.0.0.3") == 0.0  # another address is not held back
    clock.now += 10
    assert throttle.wait("10.0.0.2") == 20.0
    throttle.succeeded("10.0.0.2")
    assert throttle.wait("10.0.0.2") == 0.0
    for _ in range(3):
        throttle.failed("10.0.0.4")
    clock.now += 601  # a quiet window forgets the failures
    assert throttle.wait("10.0.0.4") == 0.0
    throttle.failed("10.0.0.4")
    assert throttle.wait("10.0.0.4") == 0.0


def test_password_check_compares_the_password_only():
    check = web_guard.password_check("s3cret")
    assert [check("any", "s3cret"), check("", "s3cret"), check("any", "s3cre"), check("any", "")] == [
        True, True, False, False]


@pytest.fixture
def locked_app(tmp_path):
    service = ChatService(AppConfig(home=tmp_path), _engine=echo_engine())
    demo = app.serve(service, port=free_port(), password="s3cret", prevent_thread_lock=True, quiet=True)
    yield demo.local_url.rstrip("/")
    demo.close()
    service.close()


def login(client: httpx.Client, url: str, password: str) -> httpx.Response:
    return client.post(f"{url}/login", data={"username": "me", "password": password})


def test_wrong_passwords_lock_the_address_out_with_a_clear_message(locked_app):
    with httpx.Client() as client:
        answers = [login(client, locked_app, "guess").status_code for _ in range(30)]
        assert answers == [400] * 5 + [429] * 25  # five tries, then the back-off (2 s, 4 s, ...)
        right = login(client, locked_app, "s3cret")
        assert right.status_code == 429 and right.json() == {"detail": too_many_logins(2.0)}
        assert right.headers["retry-after"] == "2"


def test_the_login_page_explains_the_wait_it_cannot_show():
    """Gradio's login form shows an error for a 400 only, nothing for the throttle's 429."""
    assert web_guard.login_message(LoginThrottle(free_tries=3, base_delay=1.5)) == (
        "Spotlight Chat: any user name, the server's password. After 3 wrong passwords the next try must wait "
        "1.5 s, then twice as long after each wrong one; if Login seems to do nothing, wait a little and try again.")


def test_the_served_login_page_carries_that_message(locked_app):
    with httpx.Client() as client:
        refused = client.get(f"{locked_app}/config")
    assert (refused.status_code, refused.json()) == (401, {"detail": {
        "error": "Not authenticated", "auth_message": web_guard.login_message(LoginThrottle())}})


def test_cancel_and_reset_need_the_login(locked_app):
    body = {"session_hash": "abc", "fn_index": 0, "event_id": "e1"}
    with httpx.Client() as client:
        for route in ("/gradio_api/cancel", "/gradio_api/reset"):
            refused = client.post(locked_app + route, json=body)
            assert (refused.status_code, refused.json()) == (401, {"detail": "Not authenticated: log in first."})
        assert login(client, locked_app, "s3cret").status_code == 200  # the session cookie is kept
        for route in ("/gradio_api/cancel", "/gradio_api/reset"):
            answered = client.post(locked_app + route, json=body)
            assert (answered.status_code, answered.json()) == (200, {"success": True})


def test_every_response_carries_the_content_security_policy(locked_app):
    with httpx.Client() as client:
        for response in (client.get(locked_app + "/"), login(client, locked_app, "nope"),
                         client.get(locked_app + "/gradio_api/info"), client.get(locked_app + "/config")):
            assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY, response.url
