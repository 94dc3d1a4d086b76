"""Second connector audit, the Gradio demo through ``gradio_client``: two users asking at once, a
question too long for the model, and uploads of an empty and a binary file, each shown in the page
(a ``gr.Error`` message), never as a traceback or a lost answer."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("gradio", reason="the demo needs ragfuse[demo]")
pytestmark = pytest.mark.filterwarnings("ignore::pandas.errors.Pandas4Warning")

from ragfuse.connectors.gradio_demo import DemoBackend  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "demo" / "docs"
QUESTION = "When was the Hollowpoint lighthouse electrified?"
SECOND = "How many panels does the Kessel Valley solar farm have?"


@pytest.fixture(scope="module")
def page(tmp_path_factory, engine):

    from ragfuse.app import open_pipeline
    from ragfuse.connectors.gradio_demo.app import build_app

    backend = DemoBackend(str(tmp_path_factory.mktemp("demo-store")), docs_dir=DEMO,
                          open_pipe=lambda r: open_pipeline(str(r), engine=engine, gate=False))
    backend.ingest(["lighthouses.md", "solar.md"], [])
    app = build_app(backend).queue()
    app.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    try:
        yield app.local_url
    finally:
        app.close()
        backend.close()


def test_two_users_at_once_each_get_their_own_answer(page):
    from gradio_client import Client

    def ask(question: str) -> str:
        chat, *_ = Client(page, verbose=False).predict(question, "fuse", 1, api_name="/on_ask")
        return chat[-1]["content"][0]["text"]

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(ask, [QUESTION, SECOND])
    assert "1952" in first and "41,000" in second.replace(" ", "")


def test_too_long_a_question_and_bad_uploads_are_messages(page, tmp_path):
    from gradio_client import Client, handle_file
    from gradio_client.exceptions import AppError

    client = Client(page, verbose=False)
    with pytest.raises(AppError, match="exceeds the context"):
        client.predict("why " * 9000, "fuse", 1, api_name="/on_ask")
    empty, binary = tmp_path / "empty.txt", tmp_path / "blob.md"
    empty.write_bytes(b"")
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00" * 64)
    status, *_ = client.predict([], [handle_file(str(empty)), handle_file(str(binary))], api_name="/on_ingest")
    assert "skipped empty.txt: empty" in status and "skipped blob.md: binary" in status
    chat, *_ = client.predict(QUESTION, "fuse", 1, api_name="/on_ask")  # the page still answers
    assert "1952" in chat[-1]["content"][0]["text"]
