"""The app over HTTP with gradio_client: a streamed answer from the default model. Issue #2."""
import socket

import pytest

from conftest import TEST_HOME


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(engine):
    from app import build_ui
    from chat.service import ChatService
    from spotlight.config import AppConfig, SamplingConfig

    config = AppConfig(home=TEST_HOME, sampling=SamplingConfig(max_new_tokens=24))
    service = ChatService(config, _engine=engine)
    demo = build_ui(service).queue()
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    yield f"http://127.0.0.1:{port}/"
    demo.close()


@pytest.mark.model
def test_streamed_answer_over_http(app_url):
    from gradio_client import Client

    client = Client(app_url, verbose=False)
    job = client.submit(message="What is the capital of France?", api_name="/chat")
    outputs = list(job)
    assert outputs, "no streamed output"
    final = job.outputs()[-1]
    assert "Paris" in final
    assert all(final.startswith(o) for o in outputs if o)  # each update extends the previous text
