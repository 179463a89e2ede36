"""The chat page (`server/routes/ui.py`, `server/ui/`): served and secured (checked over HTTP),
and used in headless Chromium (Selenium, /usr/bin/chromedriver) against a live server over a
scripted runner double that answers with a chosen text, as slowly as a test wants.

The browser tests skip, saying why, where selenium, chromium or chromedriver is missing
(`.ci/run` installs the Debian packages when it can).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from scripted_server import (
    CONTEXT_WINDOW,
    QWEN_TOOL_TEMPLATE,
    ScriptedRunner,
    make_bundle,
    start_scripted,
)
from server_helpers import MODEL, metric  # noqa: I001

from tallow.cli.main import build_parser
from tallow.server.app import ServerOptions, create_app
from tallow.server.routes.ui import UI_FILES

UI_DIR = Path(__file__).parent.parent / "server" / "ui"
KEY = "sekrit-key"


class SlowRunner(ScriptedRunner):
    """The scripted runner, sleeping `delay` seconds in every forward (one engine step)."""

    delay = 0.0

    def forward(self, items):
        if self.delay:
            time.sleep(self.delay)
        return super().forward(items)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return make_bundle(tmp_path_factory.mktemp("ui"), QWEN_TOOL_TEMPLATE)


@pytest.fixture(scope="module")
def live(bundle):
    server, runner = start_scripted(bundle, ServerOptions(), SlowRunner)
    yield server, runner
    server.stop()


def say(runner, bundle, text: str, delay: float = 0.0) -> None:
    runner.script = bundle.tokenizer.encode(text, add_special_tokens=False).ids
    assert bundle.tokenizer.decode(runner.script, skip_special_tokens=True) == text
    runner.delay = delay


def raw_get(base_url: str, path: str) -> tuple[int, bytes]:
    """GET `path` exactly as written (httpx would normalise dot segments)."""
    host, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


# -- served and secured (no browser) -------------------------------------------------------------


def test_page_and_files_are_served_with_csp(live):
    server, _ = live
    types = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
    for path, (name, _) in UI_FILES.items():
        r = httpx.get(server.base_url + path)
        assert r.status_code == 200, path
        assert r.content == (UI_DIR / name).read_bytes()
        assert r.headers["content-type"].split(";")[0] == types[Path(name).suffix]
        csp = r.headers["content-security-policy"]
        for directive in ("default-src 'self'", "script-src 'self'", "connect-src 'self'"):
            assert directive in csp
        assert "unsafe" not in csp
        assert r.headers["x-content-type-options"] == "nosniff"
    # The table is the folder: nothing shipped is unserved, nothing served is missing.
    assert sorted(name for name, _ in UI_FILES.values()) == sorted(p.name for p in UI_DIR.iterdir())
    page = httpx.get(server.base_url + "/").text
    scripts = re.findall(r"<script\b[^>]*>", page)
    assert scripts and all(" src=" in s for s in scripts)  # no inline script
    assert not re.search(r"\son\w+=", page)  # no inline handlers
    for name, _ in UI_FILES.values():  # offline: nothing from another origin
        text = (UI_DIR / name).read_text()
        assert not re.search(r"""(src|href)=["']?(https?:)?//|@import|url\(""", text), name
        assert not re.search(r"""fetch\(\s*["'`](https?:)?//""", text), name


def test_no_ui_option_serves_no_page(live):
    server, _ = live
    app = create_app(server.engine, MODEL, ServerOptions(ui=False))
    client = TestClient(app, base_url="http://localhost")  # the Host check
    for path in UI_FILES:
        assert client.get(path).status_code == 404, path
    assert client.get("/v1/models").status_code == 200
    assert build_parser().parse_args(["serve", "--no-ui"]).no_ui is True
    assert build_parser().parse_args(["serve"]).no_ui is False


@pytest.mark.parametrize(
    "path",
    [
        "/ui/../app.py",
        "/ui/..%2fapp.py",
        "/ui/%2e%2e/app.py",
        "/ui/%2e%2e%2fapp.py",
        "/ui/%2E%2E%2Fgate.py",
        "/ui/..%5cgate.py",
        "/ui/chat.js/../../app.py",
        "/ui/../../pyproject.toml",
        "/%2e%2e/%2e%2e/etc/passwd",
        "/ui/index.html",
        "/ui/",
        "/ui",
        "/ui//chat.js",
        "/ui/chat.js%00.py",
        "/ui/routes/ui.py",
        "/index.html",
    ],
)
def test_static_route_allows_no_traversal(live, path):
    server, _ = live
    status, body = raw_get(server.base_url, path)
    assert status == 404, (path, body[:200])
    assert b"import" not in body and b"root:" not in body


def test_page_loads_without_the_api_key_that_the_api_needs(live):
    server, _ = live
    client = TestClient(
        create_app(server.engine, MODEL, ServerOptions(api_key=KEY)), base_url="http://localhost"
    )
    for path in UI_FILES:
        assert client.get(path).status_code == 200, path
    for path in ("/v1/models", "/metrics", "/ui/../v1/models"):
        assert client.get(path).status_code == 401, path
    assert client.post("/", json={}).status_code == 401  # only GETs of the page are open
    r = client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    assert r.json()["data"][0]["max_model_len"] == CONTEXT_WINDOW


# -- in a browser --------------------------------------------------------------------------------


def _chromium() -> tuple[str | None, str | None]:
    binary = next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p),
        None,
    )
    driver = "/usr/bin/chromedriver" if os.access("/usr/bin/chromedriver", os.X_OK) else None
    return binary, driver or shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install selenium)")
    binary, driver_path = _chromium()
    if binary is None or driver_path is None:
        pytest.skip("chromium or chromedriver is absent (apt-get install chromium chromium-driver)")
    os.environ.setdefault("SE_OFFLINE", "true")  # never let Selenium Manager download anything
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1200,850")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    yield driver
    driver.quit()


def wait(driver, condition, timeout: float = 20, poll: float = 0.02):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # The page re-renders messages while a reply streams: an element found a moment ago can
    # be replaced before it is read. That is not the condition failing, so poll again.
    return WebDriverWait(
        driver, timeout, poll_frequency=poll, ignored_exceptions=(StaleElementReferenceException,)
    ).until(lambda d: condition(d))


def fresh_page(driver, base_url: str) -> None:
    """The page with empty storage, once the model card has been shown."""
    driver.get(base_url + "/")
    driver.execute_script("localStorage.clear(); sessionStorage.clear();")
    driver.refresh()
    wait(driver, lambda d: d.find_element("id", "model-name").text == MODEL)


def send(driver, text: str) -> None:
    box = driver.find_element("id", "prompt")
    box.clear()
    box.send_keys(text)
    driver.find_element("id", "send").click()


def last_reply(driver):
    return driver.find_elements("css selector", "#messages .msg.assistant")[-1]


def state(driver) -> str | None:
    replies = driver.find_elements("css selector", "#messages .msg.assistant")
    return replies[-1].get_attribute("data-state") if replies else None


def test_streamed_reply_renders_markdown_and_survives_reload(browser, live, bundle, tmp_path):
    server, runner = live
    reply = "Here is **bold** and `code`.\n\n- one\n- two\n\n```python\nx = 1\n```\nDone."
    say(runner, bundle, reply, delay=0.03)
    t_load = time.perf_counter()
    fresh_page(browser, server.base_url)
    loaded = time.perf_counter() - t_load
    assert browser.find_element("id", "model-ctx").text == f"context {CONTEXT_WINDOW:,} tokens"
    t_send = time.perf_counter()
    send(browser, "Show me some Markdown")
    # Streaming: part of the reply is on the page while the reply is still coming.
    wait(
        browser,
        lambda d: (
            state(d) == "streaming"
            and last_reply(d).find_element("css selector", ".body").text.strip()
        ),
    )
    first_token = time.perf_counter() - t_send
    wait(browser, lambda d: state(d) == "done")
    body = last_reply(browser).find_element("css selector", ".body")
    assert body.find_element("css selector", "strong").text == "bold"
    assert body.find_element("css selector", "p code").text == "code"
    assert [li.text for li in body.find_elements("css selector", "ul li")] == ["one", "two"]
    assert body.find_element("css selector", "pre code.language-python").text == "x = 1"
    meta = last_reply(browser).find_element("css selector", ".meta").text
    assert re.search(r"\d+ tokens · [\d.]+ tok/s · first token [\d.]+ s", meta), meta
    browser.save_screenshot(str(tmp_path / "chat.png"))

    browser.refresh()  # the conversation is kept in localStorage
    wait(browser, lambda d: d.find_elements("css selector", "#messages .msg.assistant strong"))
    assert browser.find_element("css selector", ".msg.user .body").text == "Show me some Markdown"
    assert last_reply(browser).find_element("css selector", "strong").text == "bold"
    assert len(browser.find_elements("css selector", "#chats .chat-item")) == 1
    browser.find_element("id", "new-chat").click()
    assert browser.find_elements("css selector", "#messages .msg") == []
    assert len(browser.find_elements("css selector", "#chats .chat-item")) == 2
    figures = {"page_load_s": loaded, "send_to_first_token_s": first_token, "meta": meta}
    (tmp_path / "figures.json").write_text(json.dumps(figures))
    print("chat page figures:", figures)


def test_stop_aborts_the_request_on_the_server(browser, live, bundle):
    server, runner = live
    say(runner, bundle, "word " * 150, delay=0.05)  # ~7 s of reply
    fresh_page(browser, server.base_url)
    send(browser, "Talk for a while")
    wait(browser, lambda d: last_reply(d).find_element("css selector", ".body").text)
    assert metric(server.base_url, "tallow_num_requests_running") == 1
    assert browser.find_element("id", "send").get_attribute("disabled") is not None
    browser.find_element("id", "stop").click()
    wait(browser, lambda d: state(d) == "stopped", timeout=5)
    deadline = time.monotonic() + 30
    while metric(server.base_url, "tallow_num_requests_running") != 0:
        assert time.monotonic() < deadline, "the server kept the request after stop"
        time.sleep(0.05)
    assert "stopped" in last_reply(browser).find_element("css selector", ".meta").text
    assert browser.find_element("id", "stop").is_displayed() is False
    assert browser.find_element("id", "send").get_attribute("disabled") is None
    words = last_reply(browser).find_element("css selector", ".body").text.split()
    assert 0 < len(words) < 150


def test_html_in_replies_stays_inert(browser, live, bundle, tmp_path):
    server, runner = live
    evil = '<img src=x onerror="window.__pwned=1"> and <script>window.__pwned=2</script>'
    link = "[click](javascript:window.__pwned=3)"
    say(runner, bundle, f"{evil}\n\n{link}")
    fresh_page(browser, server.base_url)
    send(browser, evil)
    wait(browser, lambda d: state(d) == "done")
    for _ in range(2):  # as streamed, then as rendered again from localStorage
        body = last_reply(browser).find_element("css selector", ".body")
        assert evil in body.text and link in body.text
        assert browser.find_element("css selector", ".msg.user .body").text == evil
        assert browser.find_elements("css selector", "#messages img, #messages script") == []
        assert browser.find_elements("css selector", "#messages a") == []
        time.sleep(0.2)  # an onerror would have fired by now
        assert browser.execute_script("return window.__pwned") is None
        browser.refresh()
        wait(browser, lambda d: state(d) == "done")
    browser.save_screenshot(str(tmp_path / "inert.png"))


def test_reasoning_folded_and_tool_calls_shown(browser, live, bundle):
    server, runner = live
    say(runner, bundle, "<think>\nThe user wants weather.\n</think>\n\nIt is *sunny*.")
    fresh_page(browser, server.base_url)
    send(browser, "Weather?")
    wait(browser, lambda d: state(d) == "done")
    reply = last_reply(browser)
    details = reply.find_element("css selector", "details.reasoning")
    assert details.is_displayed() and details.get_attribute("open") is None
    assert details.find_element("tag name", "summary").text == "Reasoning"
    assert "weather" not in reply.find_element("css selector", ".body").text
    assert reply.find_element("css selector", ".body em").text == "sunny"
    details.find_element("tag name", "summary").click()
    assert "The user wants weather." in details.text
    # A stored reply with a tool call (the page sends no tools, so none is made live).
    chat = {
        "id": "c1",
        "title": "tools",
        "created": 0,
        "messages": [
            {"role": "user", "content": "Paris?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning": "",
                "state": "done",
                "tool_calls": [{"id": "x", "name": "get_weather", "arguments": '{"city":"P"}'}],
            },
        ],
    }
    store = json.dumps({"chats": [chat], "current": "c1"})
    browser.execute_script("localStorage.setItem('tallow.chats.v1', arguments[0])", store)
    browser.refresh()

    def shown_call(d):
        """The first tool call's name and arguments, read in one go: the page renders the
        stored chat again once the model card arrives, and an element found before that is
        stale (`wait` then polls again)."""
        calls = d.find_elements("css selector", ".tool-call")
        if not calls:
            return None
        return tuple(calls[0].find_element("css selector", c).text for c in (".name", ".arguments"))

    name, arguments = wait(browser, shown_call)
    assert name == "get_weather"
    assert json.loads(arguments) == {"city": "P"}


def test_api_key_asked_once_and_kept_for_the_tab(browser, bundle):
    server, runner = start_scripted(bundle, ServerOptions(api_key=KEY), SlowRunner)
    try:
        say(runner, bundle, "Authorised.")
        browser.get(server.base_url + "/")
        browser.execute_script("localStorage.clear(); sessionStorage.clear();")
        browser.refresh()
        dialog = wait(browser, lambda d: d.find_element("id", "key-dialog"))
        wait(browser, lambda d: dialog.get_attribute("open") is not None)
        browser.find_element("id", "key").send_keys(KEY + "\n")
        wait(browser, lambda d: d.find_element("id", "model-name").text == MODEL)
        assert browser.execute_script("return sessionStorage.getItem('tallow.apiKey')") == KEY
        send(browser, "Hello")
        wait(browser, lambda d: state(d) == "done")
        assert last_reply(browser).find_element("css selector", ".body").text == "Authorised."
        browser.refresh()  # same tab: no second question
        wait(browser, lambda d: d.find_element("id", "model-name").text == MODEL)
        assert browser.find_element("id", "key-dialog").get_attribute("open") is None
    finally:
        server.stop()
