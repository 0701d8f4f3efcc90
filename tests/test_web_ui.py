"""The pages for people, in a real browser: Playwright for Python driving Debian's Chromium
(headless; ``$ORCA_CHROMIUM``, default /usr/bin/chromium, which ``make test`` installs) against
real ``orca-serve`` processes with the default model, SmolLM2-135M-Instruct.

The chat at ``/``: a streamed answer, the request the page sent, the stop button (the server
aborts the request and frees its KV), conversations kept across a reload, new and delete,
Markdown rendered and model output unable to inject HTML, and the API key asked for once. The
dashboard at ``/dashboard``: requests arriving, joining running decodes with their prefills and
leaving, iteration by iteration. Every page must run without a console error or an uncaught
exception. Screenshots of both pages go to ``$ORCA_TEST_ARTIFACTS`` (default
build/test-artifacts/).
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright
from server_helpers import PLAIN_CHAT_TEMPLATE, ServerProcess

from orca_ext.model.builtin import DEFAULT_MODEL

CHROMIUM = os.environ.get("ORCA_CHROMIUM", "/usr/bin/chromium")
# Headless, and nothing that would reach beyond this machine.
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update",
               "--disable-sync"]
ARTIFACTS = Path(os.environ.get("ORCA_TEST_ARTIFACTS",
                                Path(__file__).resolve().parents[1] / "build" / "test-artifacts"))
TIMEOUT_MS = 120_000  # a reply on a busy 2-core machine
# Greedy, a 64-token reply naming Paris: long enough that the browser sees it in several reads
# of the stream (an 8-token one could arrive, and be shown, all at once).
QUESTION = "What is the capital of France? Tell me about it."
KEY = "web-ui-test-key"
ABORTED = 'orca_requests_finished_total{finish_reason="abort"}'


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess("--model", DEFAULT_MODEL, "--kv-cache-tokens", "8192").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"the web UI tests need Chromium at {CHROMIUM}: `make test` installs "
                    "Debian's chromium (as root), or apt-get install chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        yield browser
        browser.close()


class Pages:
    """A fresh browser context (its own localStorage) on ``base_url``; every page opened in it
    records console errors and uncaught exceptions, which ``check`` reports (but those
    matching ``allowed``)."""

    def __init__(self, browser: Browser, base_url: str, allowed: tuple[str, ...] = ()) -> None:
        self.context = browser.new_context(base_url=base_url,
                                           viewport={"width": 1280, "height": 860})
        self.context.set_default_timeout(TIMEOUT_MS)
        self.allowed = allowed
        self.problems: list[str] = []

    def open(self, path: str) -> Page:
        page = self.context.new_page()
        page.on("console", lambda m: m.type == "error" and self.problems.append(
            f"console error on {page.url}: {m.text}"))
        page.on("pageerror", lambda e: self.problems.append(
            f"uncaught exception on {page.url}: {e}"))
        page.goto(path)
        return page

    def close_and_check(self) -> None:
        self.context.close()
        unexpected = [p for p in self.problems if not any(re.search(a, p) for a in self.allowed)]
        assert not unexpected, "\n".join(unexpected)


@pytest.fixture
def pages(browser: Browser, server: ServerProcess) -> Iterator[Pages]:
    pages = Pages(browser, server.base_url)
    yield pages
    pages.close_and_check()


def settings(page: Page, **values: str) -> None:
    """Open the settings panel (if closed) and set fields by id."""
    if page.locator("#settings").is_hidden():
        page.click("#settings-toggle")
    for field, value in values.items():
        page.fill(f"#{field.replace('_', '-')}", value)


def ask(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last_reply(page: Page):
    return page.locator(".message.assistant").last


def wait_done(page: Page) -> None:
    expect(last_reply(page)).not_to_have_class(re.compile(r"\bpending\b"))


def screenshot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


# The lengths of the pending reply's text each time the page changed it.
RECORD_STREAMING = """() => {
  window.lengths = [];
  new MutationObserver(() => {
    const body = document.querySelector(".message.assistant.pending .body");
    if (body) window.lengths.push(body.textContent.length);
  }).observe(document.getElementById("messages"),
             { subtree: true, childList: true, characterData: true });
}"""


def test_chat_streams_the_answer_and_keeps_conversations(pages: Pages):
    page = pages.open("/")
    expect(page.locator("#model")).to_contain_text(DEFAULT_MODEL)
    settings(page, temperature="0", max_tokens="64", top_p="0.9", seed="7")
    page.evaluate(RECORD_STREAMING)
    with page.expect_request("**/v1/chat/completions") as sent:
        ask(page, QUESTION)
    body = sent.value.post_data_json
    assert body["messages"] == [{"role": "user", "content": QUESTION}]
    assert (body["temperature"], body["top_p"], body["seed"], body["max_tokens"]) == (0, 0.9, 7, 64)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == DEFAULT_MODEL
    expect(page.locator("#stop")).to_be_visible()
    wait_done(page)
    reply = last_reply(page)
    assert "Paris" in reply.locator(".body").inner_text()
    meta = reply.locator(".meta").inner_text()
    assert re.fullmatch(r"TTFT \d+ ms · \d+\.\d tok/s · 64 tokens · max tokens reached",
                        meta), meta
    shown = [n for n in page.evaluate("window.lengths") if n]
    final = len(reply.locator(".body").text_content())
    assert shown and shown[0] < final, f"no part of the reply was shown before the rest: {shown}"
    expect(page.locator("#send")).to_be_visible()
    screenshot(page, "chat.png")

    page.reload()  # the conversation, its statistics and the settings are kept
    expect(page.locator("#conversations li")).to_have_count(1)
    expect(page.locator("#conversations .open")).to_have_text(QUESTION)
    expect(page.locator(".message.user .body")).to_have_text(QUESTION)
    expect(last_reply(page).locator(".body")).to_contain_text("Paris")
    expect(last_reply(page).locator(".meta")).to_have_text(meta)
    expect(page.locator("#temperature")).to_have_value("0")

    page.click("#new-chat")
    expect(page.locator("#conversations li")).to_have_count(2)
    expect(page.locator(".message")).to_have_count(0)
    page.locator("#conversations li", has_text=QUESTION).locator(".open").click()
    expect(last_reply(page).locator(".body")).to_contain_text("Paris")
    page.locator("#conversations li", has_text=QUESTION).locator(".delete").click()
    expect(page.locator("#conversations li")).to_have_count(1)
    expect(page.locator("#conversations .open")).to_have_text("New chat")
    page.reload()
    expect(page.locator("#conversations li")).to_have_count(1)
    assert QUESTION not in page.evaluate("localStorage.getItem('orca.chat.conversations')")


def test_stop_aborts_the_request_and_frees_its_kv(pages: Pages, server: ServerProcess):
    aborted = server.metrics().get(ABORTED, 0.0)
    page = pages.open("/")
    settings(page, temperature="0", max_tokens="2000")
    ask(page, "Write a very long story about a dragon.")  # greedy: 300+ tokens
    page.wait_for_function(
        "() => document.querySelector('.message.assistant .body').textContent.length > 100")
    running = server.metrics()
    assert running["orca_num_requests_running"] == 1 and running["orca_kv_cache_used_blocks"] > 0
    page.click("#stop")
    reply = last_reply(page)
    expect(reply.locator(".meta")).to_contain_text("stopped")
    expect(page.locator("#send")).to_be_visible()
    idle = server.wait_idle()
    assert idle["orca_kv_cache_used_blocks"] == 0 and idle["orca_kv_cache_usage_ratio"] == 0
    assert idle[ABORTED] == aborted + 1
    text = reply.locator(".body").inner_text()
    assert len(text) > 100
    time.sleep(1)
    assert reply.locator(".body").inner_text() == text  # nothing arrives after the stop


def _stream_completion(base_url: str, prompt: str, max_tokens: int, ids: list[str],
                       started: threading.Event) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True}
    with httpx.Client(base_url=base_url, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and not started.is_set():
                    ids.append(json.loads(line[6:])["id"])
                    started.set()


# (prompt, max_tokens): the longest outlives the others; all fit in the strip's columns.
LENGTHS = (("The history of the Roman Empire", 100), ("A recipe for bread: first,", 60),
           ("Ten facts about the ocean:", 30))


def test_dashboard_shows_requests_join_and_leave_the_batch(pages: Pages, server: ServerProcess):
    dash = pages.open("/dashboard")
    expect(dash.locator("#connection")).to_have_text("live")
    for text in ("policy", "orca", "max batch size", "32", "KV cache", "512 blocks × 16 tokens"):
        expect(dash.locator("#config")).to_contain_text(text)
    # Each request starts once the one before it decodes, so its prefill joins their decodes.
    ids: list[str] = []
    threads = []
    for prompt, max_tokens in LENGTHS:
        started = threading.Event()
        thread = threading.Thread(target=_stream_completion,
                                  args=(server.base_url, prompt, max_tokens, ids, started))
        thread.start()
        threads.append(thread)
        assert started.wait(60)
    dash.wait_for_function("""() => document.querySelectorAll('#live tr.running').length === 3
                                 && document.getElementById('running').textContent === '3'""")
    screenshot(dash, "dashboard.png")
    seen_rate = dash.wait_for_function(
        "() => parseFloat(document.getElementById('tokens-per-s').textContent) > 0")
    assert seen_rate
    for thread in threads:
        thread.join(120)
    for rid, (_, max_tokens) in zip(ids, LENGTHS):
        expect(dash.locator(f'.event.arrive[data-rid="{rid}"]')).to_have_count(1)
        expect(dash.locator(f'.event.end[data-rid="{rid}"]')).to_contain_text("length")
        expect(dash.locator(f'.event.end[data-rid="{rid}"]')).to_contain_text(
            f"{max_tokens} tokens generated")
        expect(dash.locator(f'.cell.prefill[data-rid="{rid}"]')).to_have_count(1)
        # The prefill's iteration gives the first token; one decode iteration for each other.
        expect(dash.locator(f'.cell.decode[data-rid="{rid}"]')).to_have_count(max_tokens - 1)
    packed = dash.evaluate("""(ids) => [1, 2].map((k) => [...document.querySelectorAll('.iter')]
        .some((column) => column.querySelector(`.cell.prefill[data-rid="${ids[k]}"]`) &&
                          column.querySelector(`.cell.decode[data-rid="${ids[k - 1]}"]`)))""",
                           ids)
    assert packed == [True, True], "a later request's prefill ran with the earlier decodes"
    together = dash.evaluate("""(ids) => Math.max(...[...document.querySelectorAll('.iter')]
        .map((column) => ids.filter((id) => column.querySelector(`[data-rid="${id}"]`)).length))""",
                             ids)
    assert together == 3
    expect(dash.locator("#live")).to_contain_text("no requests")
    expect(dash.locator("#running")).to_have_text("0")
    expect(dash.locator("#ttft")).to_contain_text("ms")
    expect(dash.locator("#itl")).to_contain_text("ms")
    expect(dash.locator("#kv-text")).to_contain_text("used 0 of 512 blocks")


# A reply with Markdown and with HTML that must stay text, streamed in small pieces.
MARKDOWN_REPLY = """## Steps
1. **Bold** and *italic* with `inline <code>`
2. A [safe link](https://example.com/a_b) and a [bad one](javascript:window.pwned=1)

```python
print("<script>window.pwned = 2</script>")
```

| name | value |
|------|:-----:|
| <b>x</b> | y |

<img src=x onerror="window.pwned=3"> <script>window.pwned=4</script>
> quoted"""


def _sse_reply(text: str, piece: int = 7) -> str:
    chunks = [{"choices": [{"index": 0, "delta": {"content": text[i:i + piece]},
                            "finish_reason": None}]} for i in range(0, len(text), piece)]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    chunks.append({"choices": [], "usage": {"completion_tokens": 42}})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def test_markdown_is_rendered_and_model_output_cannot_inject_html(pages: Pages):
    page = pages.open("/")
    sent = []

    def reply(route) -> None:
        sent.append(route.request.post_data_json)
        route.fulfill(status=200, content_type="text/event-stream",
                      body=_sse_reply(MARKDOWN_REPLY))

    page.route("**/v1/chat/completions", reply)
    settings(page, system_prompt="Answer in Markdown.")
    ask(page, "Show me some Markdown")
    wait_done(page)
    assert sent[0]["messages"] == [{"role": "system", "content": "Answer in Markdown."},
                                   {"role": "user", "content": "Show me some Markdown"}]
    body = last_reply(page).locator(".body")
    expect(body.locator("h2")).to_have_text("Steps")
    expect(body.locator("ol > li")).to_have_count(2)
    expect(body.locator("strong")).to_have_text("Bold")
    expect(body.locator("em")).to_have_text("italic")
    expect(body.locator("li code")).to_have_text("inline <code>")
    safe = body.locator('a[href="https://example.com/a_b"]')
    expect(safe).to_have_text("safe link")
    expect(safe).to_have_attribute("rel", "noopener noreferrer")
    expect(body.locator("a")).to_have_count(1)  # the javascript: link stays text
    expect(body).to_contain_text("[bad one](javascript:window.pwned=1)")
    expect(body.locator("pre code.language-python")).to_have_text(
        'print("<script>window.pwned = 2</script>")')
    expect(body.locator("th")).to_have_count(2)
    expect(body.locator("td").first).to_have_text("<b>x</b>")
    expect(body.locator("blockquote")).to_have_text("quoted")
    expect(body).to_contain_text('<img src=x onerror="window.pwned=3">')
    assert body.locator("img, script, b").count() == 0
    assert page.evaluate("window.pwned") is None
    expect(last_reply(page).locator(".meta")).to_contain_text("42 tokens")


def test_pages_are_served_from_the_package(server: ServerProcess):
    """No CDN, nothing fetched from elsewhere, small, with a content security policy."""
    from orca_ext.server.web import load_assets

    assets = load_assets()
    assert sum(len(body) for body, _ in assets.values()) < 200_000
    with server.client() as http:
        for path in ("/", "/dashboard"):
            r = http.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            assert "default-src 'self'" in r.headers["content-security-policy"]
        for name, (body, media_type) in assets.items():
            r = http.get(f"/ui/{name}")
            assert r.status_code == 200 and r.content == body
            assert r.headers["content-type"] == media_type
            assert not re.search(rb"""(src|href|import|from)\s*=?\s*["'](https?:)?//""", body), name
        assert http.get("/ui/nothing.js").status_code == 404
        assert http.get("/?name=missing").status_code == 200  # no query parameters
        paths = http.get("/openapi.json").json()["paths"]
        assert not {"/", "/dashboard", "/dashboard/events"} & paths.keys()


def test_api_key_is_asked_once(browser: Browser):
    # orca-tiny (any reply will do) with a plain template, as it has none of its own.
    keyed = ServerProcess("--api-key", KEY, "--chat-template", PLAIN_CHAT_TEMPLATE).start()
    # The refused first tries are logged by the browser as failed loads.
    pages = Pages(browser, keyed.base_url, allowed=(r"status of 401",))
    try:
        with keyed.client() as http:
            assert http.get("/").status_code == 200  # the pages are public, the APIs are not
            assert http.get("/dashboard/events").status_code == 401
        page = pages.open("/")
        dialog = page.locator("#key-dialog")
        expect(dialog).to_be_visible()
        expect(dialog).to_contain_text("needs an API key")
        dialog.locator("input").fill("wrong")
        dialog.locator("button").click()
        expect(dialog).to_contain_text("not accepted")
        dialog.locator("input").fill(KEY)
        dialog.locator("button").click()
        expect(dialog).to_be_hidden()
        expect(page.locator("#model")).to_contain_text("orca-tiny")
        settings(page, max_tokens="8")
        ask(page, "hello")
        wait_done(page)
        expect(last_reply(page)).not_to_have_class(re.compile("failed"))
        expect(last_reply(page).locator(".meta")).to_contain_text("tokens")
        page.reload()
        expect(page.locator("#model")).to_contain_text("orca-tiny")
        expect(dialog).to_be_hidden()
        dash = pages.open("/dashboard")
        expect(dash.locator("#connection")).to_have_text("live")
        expect(dash.locator("#config")).to_contain_text("orca-tiny")
        expect(dash.locator("#key-dialog")).to_be_hidden()
        pages.close_and_check()  # before the server stops: the dashboard would reconnect
    finally:
        keyed.stop()
