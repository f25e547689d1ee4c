"""The chat page at / in a real browser (Debian's headless Chromium driven by Selenium through
Debian's chromedriver) against `ferrum serve` on 127.0.0.1 with SmolLM2: a streamed reply, stop
(the server aborts the request), regenerate, reload, a reply with HTML in it shown as text, the
API key flow, --no-web-ui; and no console errors from the page."""
import json
import re
import time

import pytest
import requests
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.by import By

from server_harness import serve, stop, wait_until

MODEL = "smollm2"
HOSTILE = '<script>window.pwned=1</script><img src=x onerror="window.pwned=2"> and **bold**'


@pytest.fixture(scope="module")
def server(smollm2_path):
    proc, url = serve(smollm2_path)
    yield url
    stop(proc)


def chrome(size=(1000, 800), downloads=None):
    """Debian's headless Chromium through Debian's chromedriver, named so that Selenium Manager
    never looks for (or downloads) one; the page's console kept, downloads saved in `downloads`."""
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={size[0]},{size[1]}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    if downloads:
        options.add_experimental_option("prefs", {"download.default_directory": str(downloads)})
    driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    driver.set_script_timeout(30)
    return driver


@pytest.fixture
def browser(tmp_path):
    driver = chrome(downloads=tmp_path)
    yield driver
    driver.quit()


def console_errors(driver, allowed=()):
    return [e for e in driver.get_log("browser")
            if e["level"] == "SEVERE" and not any(a in e["message"] for a in allowed)]


def metric(url, name):
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^ferrum:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def aborted(url):
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r'^ferrum:request_success_total{[^}]*finished_reason="abort"[^}]*} (\S+)$', text, re.M))


def messages(driver):
    return driver.find_elements(By.CSS_SELECTOR, "#messages .message")


def settle(driver):
    """Waits for the reply in progress to end (read it afresh after: last_content, read_last)."""
    wait_until(lambda: not driver.find_elements(By.CSS_SELECTOR, ".message.pending"), 90, "the reply")


def reply_to(driver, action):
    """Runs `action` (a click that starts a reply) and waits for that reply to end, not for one
    that has not begun yet: the page shows a pending message, or the last message is another
    element than before (regenerate renders the conversation anew)."""
    before = messages(driver)
    last = before[-1] if before else None
    action()

    def started():
        if driver.find_elements(By.CSS_SELECTOR, ".message.pending"):
            return True
        now = messages(driver)
        return len(now) > len(before) or (bool(now) and now[-1] != last)
    wait_until(started, 30, "the reply to start")
    settle(driver)


def last_content(driver, part=".content"):
    """The last message's text (or its `part`'s), found afresh: the page may render a reply anew
    (another element) just after it ends, so an element found before that is stale."""
    try:
        found = messages(driver)
        return found[-1].find_element(By.CSS_SELECTOR, part).text.strip() if found else None
    except StaleElementReferenceException:
        return None


def read_last(driver, read, timeout_s=10.0):
    """read(the last message's element), found afresh and read again while the page renders the
    reply anew (an element found before that goes stale)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return read(messages(driver)[-1])
        except StaleElementReferenceException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def set_settings(driver, **fields):
    driver.find_element(By.ID, "open-settings").click()
    for id_, value in fields.items():
        box = driver.find_element(By.ID, id_)
        box.clear()
        if value:
            box.send_keys(value)
    driver.find_element(By.ID, "save-settings").click()
    wait_until(lambda: not driver.find_element(By.ID, "settings").is_displayed(), 10, "the settings to close")


def say(driver, text):
    box = driver.find_element(By.ID, "input")
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


def chat_api(url, messages_, **params):
    r = requests.post(f"{url}/v1/chat/completions", json={"messages": messages_, **params}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_conversation_stop_regenerate_reload_edit_export(server, browser, tmp_path):
    url = server
    browser.get(url)
    wait_until(lambda: browser.find_element(By.ID, "model-name").text == MODEL, 20, "the model's name")
    set_settings(browser, **{"temperature": "0", "max-tokens": "24", "system-prompt": "You are terse."})
    reply_to(browser, lambda: say(browser, "What is the capital of France?"))
    expected = chat_api(url, [{"role": "system", "content": "You are terse."},
                              {"role": "user", "content": "What is the capital of France?"}],
                        temperature=0, max_tokens=24)
    # The page sent the system prompt and settings: its reply is the server's for the same request.
    wait_until(lambda: last_content(browser) == expected.strip(), 30, "the reply to be the server's")
    stats = r"\d+ tokens · [\d.]+ tokens/s · prompt \d+ tokens"
    wait_until(lambda: re.search(stats, last_content(browser, ".stats") or ""), 30, "the reply's stats")

    # Regenerate with a seed and sampling: the reply becomes the server's for that seed.
    set_settings(browser, **{"temperature": "0.9", "seed": "7"})
    def regenerate():
        read_last(browser, lambda reply: reply.find_element(By.CSS_SELECTOR, "button.regenerate").click())
    reply_to(browser, regenerate)
    assert len(messages(browser)) == 2
    seeded = chat_api(url, [{"role": "system", "content": "You are terse."},
                            {"role": "user", "content": "What is the capital of France?"}],
                      temperature=0.9, top_p=0.95, max_tokens=24, seed=7)
    wait_until(lambda: last_content(browser) == seeded.strip(), 30, "the regenerated reply to be the server's")

    # A long reply stopped midway: the server aborts the request (its running count drops to 0).
    set_settings(browser, **{"max-tokens": "400", "seed": "", "temperature": "0",
                             "extra-json": '{"ignore_eos": true}'})
    before = aborted(url)
    say(browser, "Tell me a long story about a dragon.")
    streamed = "return document.querySelector('#messages .message:last-child .content').textContent.length"
    wait_until(lambda: browser.execute_script(streamed) > 20
               and metric(url, "num_requests_running") == 1, 60, "the reply to stream")
    browser.find_element(By.ID, "stop").click()
    settle(browser)
    wait_until(lambda: metric(url, "num_requests_running") == 0 and aborted(url) == before + 1, 20, "the abort")
    wait_until(lambda: "stopped" in (last_content(browser, ".stats") or ""), 20, "the reply marked stopped")
    partial = last_content(browser)

    # Reload: the conversation is still there.
    browser.refresh()
    wait_until(lambda: len(messages(browser)) == 4, 20, "the conversation after reload")
    assert last_content(browser) == partial

    # Edit the first message and send it again: what followed is replaced by the new reply.
    set_settings(browser, **{"max-tokens": "24", "extra-json": ""})
    messages(browser)[0].find_element(By.CSS_SELECTOR, "button.edit").click()
    box = browser.find_element(By.CSS_SELECTOR, ".edit-box")
    box.clear()
    box.send_keys("What is the capital of Italy?")
    reply_to(browser, messages(browser)[0].find_element(By.CSS_SELECTOR, "button.send").click)
    assert len(messages(browser)) == 2
    edited = chat_api(url, [{"role": "system", "content": "You are terse."},
                            {"role": "user", "content": "What is the capital of Italy?"}],
                      temperature=0, top_p=0.95, max_tokens=24)
    wait_until(lambda: last_content(browser) == edited.strip(), 30, "the edited reply to be the server's")

    # Export: the conversation as JSON.
    browser.find_element(By.ID, "export").click()
    wait_until(lambda: list(tmp_path.glob("ferrum-chat-*.json")), 10, "the exported file")
    exported = json.loads(next(tmp_path.glob("ferrum-chat-*.json")).read_text())
    assert [(m["role"], m["content"]) for m in exported["messages"]] == [
        ("user", "What is the capital of Italy?"), ("assistant", edited)]
    assert exported["messages"][1]["stats"]["tokens"] > 0
    assert console_errors(browser) == []


def test_html_in_a_reply_is_shown_as_text(server, browser):
    """The model is held to the hostile text by a `choice` constraint (the real engine samples it
    under llguidance's mask) and streams it back through the page's own request."""
    browser.get(server)
    browser.find_element(By.ID, "new-chat").click()
    set_settings(browser, **{"temperature": "0", "max-tokens": "80",
                             "extra-json": json.dumps({"structured_outputs": {"choice": [HOSTILE]}})})
    reply_to(browser, lambda: say(browser, "Say something."))

    def shown(reply):
        content = reply.find_element(By.CSS_SELECTOR, ".content")
        return content.text, content.find_element(By.TAG_NAME, "strong").text
    text, strong = read_last(browser, shown)
    assert text == HOSTILE.replace("**bold**", "bold")
    assert strong == "bold"  # Markdown still renders
    assert not browser.find_elements(By.CSS_SELECTOR, "#messages script, #messages img")
    assert browser.execute_script("return window.pwned === undefined")
    assert console_errors(browser) == []


def test_markdown_renderer(server, browser):
    browser.get(server)
    render = lambda text: browser.execute_script(  # noqa: E731
        "const d = document.createElement('div'); d.append(renderMarkdown(arguments[0])); return d.innerHTML;", text)
    assert render("```python\nprint('<b>')\n```") == '<pre data-lang="python"><code>print(\'&lt;b&gt;\')</code></pre>'
    assert render("- a\n- `b`\n  - c") == "<ul><li>a</li><li><code>b</code><ul><li>c</li></ul></li></ul>"
    assert render("[x](javascript:alert(1)) [y](https://e.org)") == (
        '<p>[x](javascript:alert(1)) <a href="https://e.org" rel="noopener noreferrer" target="_blank">y</a></p>')
    assert render("*i* __b__ snake_case_name") == "<p><em>i</em> <strong>b</strong> snake_case_name</p>"
    assert render("```\nunterminated") == "<pre><code>unterminated</code></pre>"


def test_api_key_flow_and_unreachable_server(smollm2_path, browser):
    proc, url = serve(smollm2_path, "--api-key", "sesame")
    try:
        browser.get(url)
        dialog = browser.find_element(By.ID, "key-dialog")
        wait_until(dialog.is_displayed, 20, "the key dialog")
        browser.find_element(By.ID, "key-input").send_keys("wrong")
        browser.find_element(By.ID, "key-save").click()
        wait_until(lambda: "refused" in browser.find_element(By.ID, "key-reason").text, 20, "the refusal")
        browser.find_element(By.ID, "key-input").send_keys("sesame")
        browser.find_element(By.ID, "key-save").click()
        wait_until(lambda: browser.find_element(By.ID, "model-name").text == MODEL, 20, "the model's name")
        assert browser.execute_script("return localStorage.getItem('ferrum.chat.apiKey')") == "sesame"
        browser.refresh()
        wait_until(lambda: browser.find_element(By.ID, "model-name").text == MODEL, 20, "the model's name")
        assert not browser.find_element(By.ID, "key-dialog").is_displayed()
    finally:
        stop(proc)
    say(browser, "Hello?")
    settle(browser)
    banner = browser.find_element(By.ID, "banner")
    assert banner.is_displayed() and "Cannot reach the server" in banner.text
    # The browser logs each 401 and the refused connection as network errors; nothing else.
    assert console_errors(browser, ("401 (Unauthorized)", "ERR_CONNECTION_REFUSED")) == []


def test_no_web_ui(smollm2_path):
    proc, url = serve(smollm2_path, "--no-web-ui")
    try:
        assert requests.get(url, timeout=10).status_code == 404
        assert requests.get(f"{url}/ui/chat.js", timeout=10).status_code == 404
        assert requests.get(f"{url}/v1/models", timeout=10).status_code == 200
    finally:
        stop(proc)


def test_page_headers_allow_only_its_own_origin(server):
    r = requests.get(server, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
    files = [requests.get(f"{server}/ui/{f}", timeout=10).text for f in ("chat.js", "markdown.js", "chat.css")]
    assert not re.findall(r"(?:https?:)?//[\w-]+\.[\w.-]+", "".join(files) + r.text)  # no external address
    assert requests.get(f"{server}/ui/../app.py", timeout=10).status_code == 404
