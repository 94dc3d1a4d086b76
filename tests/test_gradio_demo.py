"""``ragfuse demo``: its backend on the shared engine, then the real page in Debian's chromium driven
by Playwright (pick and upload documents, ingest, ask, wait for the answer, save a screenshot)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("gradio", reason="the demo needs ragfuse[demo]")
# pandas 3 deprecations inside gradio's queue, not ours
pytestmark = pytest.mark.filterwarnings("ignore::pandas.errors.Pandas4Warning")

from ragfuse.bench.serve_process import free_port  # noqa: E402
from ragfuse.connectors.gradio_demo import DemoBackend, Turn  # noqa: E402
from ragfuse.engine import RagfuseError, RequestError  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "demo" / "docs"
QUESTION = "When was the Hollowpoint lighthouse electrified?"
SECOND = "How many panels does the Kessel Valley solar farm have?"
WAIT_MS = 180_000  # for one ingest or answer on a shared CPU (they take seconds)
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def backend(tmp_path_factory, engine):
    from ragfuse.app import open_pipeline

    root = tmp_path_factory.mktemp("demo-store")
    backend = DemoBackend(str(root), docs_dir=DEMO,
                          open_pipe=lambda r: open_pipeline(str(r), engine=engine, gate=False))
    yield backend
    backend.close()


def test_backend_ingests_picked_and_uploaded_documents(backend, tmp_path):
    with pytest.raises(RagfuseError, match="no documents"):
        next(backend.ask(QUESTION))
    assert backend.sample_docs() == ["bakery.txt", "lighthouses.md", "solar.md"]
    with pytest.raises(RequestError, match="not a demo document"):
        backend.ingest(["../secrets.txt"], [])
    with pytest.raises(RequestError, match="at least one"):
        backend.ingest([], [])
    upload = tmp_path / "gradio-tmp" / "solar.md"  # an upload arrives under a temporary path
    upload.parent.mkdir()
    shutil.copyfile(DEMO / "solar.md", upload)
    report = backend.ingest(["lighthouses.md"], [str(upload)])
    assert len(report.new_files) == 2 and report.kv_computed >= 2
    assert dict(backend.stored_files()).keys() == {"lighthouses.md", "solar.md"}
    again = backend.ingest([], [str(upload)])  # the same upload again: kept in the store, unchanged
    assert again.unchanged_files and not again.new_files
    # uploads the ingest skips do not stay: a new one goes, one over an earlier upload puts it back
    blob, broken = tmp_path / "gradio-tmp" / "blob.md", tmp_path / "broken" / "solar.md"
    broken.parent.mkdir()
    blob.write_bytes(b"\x00\x01")
    broken.write_bytes(b"\x00\x02")
    skipped = backend.ingest([], [str(blob), str(broken)])
    assert sorted(Path(s.path).name for s in skipped.skipped) == ["blob.md", "solar.md"]
    assert not (backend.uploads / "blob.md").exists()
    assert (backend.uploads / "solar.md").read_bytes() == (DEMO / "solar.md").read_bytes()
    with pytest.raises(RequestError, match="no uploaded file gone.md"):
        backend.ingest([], [str(tmp_path / "gone.md")])


def test_backend_streams_the_answer_then_compares_ttft(backend):
    with pytest.raises(RequestError, match="empty"):
        next(backend.ask("  "))
    items = list(backend.ask(QUESTION, mode="fuse", top_k=2, max_tokens=24))
    texts, fused, turn = items[:-2], items[-2], items[-1]
    assert isinstance(turn, Turn) and all(isinstance(t, str) for t in texts)
    assert fused is turn.fused  # shown before full prefill runs
    assert len(texts) > 3 and all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # it grew token by token
    assert turn.fused.answer == texts[-1].strip() and turn.question == QUESTION
    assert Path(turn.fused.sources[0]["source"]).name == "lighthouses.md"
    assert turn.fused.mode == "fuse" and turn.fused.reused_tokens > 0 and set(turn.fused.tiers) & {"cpu", "disk"}
    assert turn.full.mode == "full" and turn.full.reused_tokens == 0 and len(turn.full.token_ids) == 1
    assert turn.full.prompt_tokens == turn.fused.prompt_tokens  # the same prompt, prefilled in full
    assert turn.fused.ttft_s > 0 and turn.full.ttft_s > 0


def test_page_events_through_gradio_client(backend):
    """The page's events as Gradio serves them (the browser test below drives the same page in chromium)."""
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    from ragfuse.connectors.gradio_demo.app import build_app

    app = build_app(backend).queue()
    app.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    try:
        client = Client(app.local_url, verbose=False)
        with pytest.raises(AppError, match="at least one"):
            client.predict([], [], api_name="/on_ingest")
        with pytest.raises(AppError, match="empty"):
            client.predict("  ", "fuse", 2, api_name="/on_ask")
        for n in (1, 2):  # the session's turns accumulate in the page's state
            chat, headline, _plot, sources, table = client.predict(QUESTION, "fuse", 2, api_name="/on_ask")
            assert "1952" in chat[-1]["content"][0]["text"]
            assert re.match(r"\*\*TTFT: fuse \d+ ms vs full prefill \d+ ms \(\d+\.\dx\)\*\*", headline)
            assert "retrieval" in headline and "KV load" in headline
            assert "lighthouses.md" in sources
            assert [row[:4] for row in table["data"]] == [[i, QUESTION, row[2], "fuse"] for i, row in
                                                          enumerate(table["data"], 1)]
            assert len(table["data"]) == n
    finally:
        app.close()


def test_demo_behind_auth_serves_only_a_logged_in_client(backend):
    """``--auth USER:PASSWORD``: the page ingests and answers for whoever reaches it, so one served
    beyond loopback can ask for a login; a client without it gets nothing."""
    from gradio_client import Client
    from gradio_client.exceptions import AppError, AuthenticationError

    from ragfuse.commands.demo import launch, parse_auth
    from ragfuse.connectors.gradio_demo.app import build_app

    app = build_app(backend)
    launch(app, "127.0.0.1", None, parse_auth("reader:s3cret:with-colon"), block=False)
    try:
        with pytest.raises(AuthenticationError):
            Client(app.local_url, verbose=False)
        client = Client(app.local_url, auth=("reader", "s3cret:with-colon"), verbose=False)
        with pytest.raises(AppError, match="empty"):  # the page's own answer: the client got through
            client.predict("  ", "fuse", 2, api_name="/on_ask")
    finally:
        app.close()


def test_demo_command_rejects_bad_arguments_before_loading(tmp_path, capsys):
    from ragfuse.cli import main

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        cases = {("--port", "70000"): "--port must be in 1-65535",
                 ("--port", str(port)): f"cannot listen on 127.0.0.1:{port}",
                 ("--docs", str(tmp_path / "missing")): "is not a directory",
                 ("--auth", "admin"): "--auth must be USER:PASSWORD", ("--auth", "admin:"): "--auth must be"}
        for extra, message in cases.items():
            assert main(["demo", "--store", str(tmp_path / "store"), *extra]) == 2
            err = capsys.readouterr().err
            assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "store").exists()  # nothing was created for a command that failed


# ---- the page in a real browser -------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip("no chromium: scripts/setup.sh installs Debian's package with apt-get")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright comes with ragfuse[dev]")

    # root in a container: no sandbox; a container's small /dev/shm can crash chromium's renderer, so it
    # keeps shared memory in /tmp
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def demo_url(tmp_path_factory):
    """``ragfuse demo`` as a user starts it, on a new (empty) store, on loopback; without the gate's
    r* calibration (4+ minutes of this CPU on a first run, covered by the gate's own tests)."""
    tmp = tmp_path_factory.mktemp("demo-cli")
    port = free_port()
    log = (tmp / "demo.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ragfuse.cli", "demo", "--store", str(tmp / "store"), "--host", "127.0.0.1",
         "--port", str(port), "--docs", str(DEMO), "--no-gate"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"},
    )
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ragfuse demo exited {proc.returncode}: {(tmp / 'demo.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"ragfuse demo did not answer in 300 s: {(tmp / 'demo.log').read_text()[-2000:]}")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_demo_page_in_chromium(demo_url, browser, tmp_path, capsys):
    # (demo_url first: chromium starts once the demo answers, not minutes before on a slow machine)
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(demo_url)
    page.get_by_label("lighthouses.md").check()
    page.locator("#upload input[type=file]").set_input_files(str(DEMO / "solar.md"))
    page.locator("#ingest").click()
    expect(page.locator("#ingest-status")).to_contain_text("2 new", timeout=WAIT_MS)
    expect(page.locator("#stored")).to_contain_text("solar.md")

    page.locator("#question textarea").fill(QUESTION)
    page.locator("#ask").click()
    seen: list[str] = []  # what the chat showed while the answer streamed in
    deadline = time.monotonic() + WAIT_MS / 1e3
    while "vs full prefill" not in page.locator("#ttft").inner_text():  # (it shows a timer while pending)
        assert time.monotonic() < deadline, f"no answer in {WAIT_MS / 1e3:.0f} s"
        text = page.locator("#chat").inner_text()
        if not seen or seen[-1] != text:
            seen.append(text)
        time.sleep(0.1)
    expect(page.locator("#ttft")).to_contain_text("KV load")
    expect(page.locator("#sources")).to_contain_text("lighthouses.md")
    expect(page.locator("#turns")).to_contain_text(QUESTION)
    expect(page.locator("#chat")).to_contain_text(QUESTION)
    answer = page.locator("#chat").inner_text().split(QUESTION, 1)[1].strip()  # the bot's message
    assert answer and answer != "…"
    expect(page.locator("#turns")).to_contain_text(answer.split()[0])
    assert len({s for s in seen if QUESTION in s}) >= 3, seen  # the answer grew in place: it streamed
    expect(page.locator("#question textarea")).to_have_value("")

    page.locator("#question textarea").fill(SECOND)  # a second turn, sent with Enter
    page.locator("#question textarea").press("Enter")
    expect(page.locator("#turns")).to_contain_text(SECOND, timeout=WAIT_MS)
    expect(page.locator("#turns")).to_contain_text(QUESTION)
    expect(page.locator("#sources li").first).to_contain_text("solar.md")
    expect(page.locator("#chat")).to_contain_text(QUESTION)  # the session keeps the first turn
    shot = tmp_path / "ragfuse-demo.png"
    page.screenshot(path=str(shot), full_page=True)
    with capsys.disabled():
        print(f"\nscreenshot of the demo: {shot}")
    assert shot.stat().st_size > 10_000
