"""The web page in a real browser: Debian's headless Chromium driven by selenium, against
`specmoe serve` (the bundled demo model, SpecMoE with experts on disk, an API key) in a
subprocess. One server and one browser for the module; each test loads the page itself
and enters the key where it needs it, so none depends on another having run.

Skipped where Chromium, chromedriver or selenium are missing; `.ci/run` installs them.
Set SPECMOE_UI_SCREENSHOT=docs/ui.png to keep the screenshot taken during the batch run.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("the browser tests need Chromium and chromedriver (apt-get install chromium chromium-driver)",
                allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402
from serving import ServeProcess  # noqa: E402

KEY = "browser-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
DRAFT_EXPERTS, BLOCKS = 4, 8  # the demo model has 8 MoE blocks of 16 experts
BATCH, BATCH_TOKENS = 8, 24
PROMPTS_FILE = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts" / "heldout.jsonl"
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,900")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = ServeProcess(None, tmp_path_factory.mktemp("ui-server") / "server.log", "--api-key", KEY,
                          "--policy", "specmoe", "--offload", "disk", "--device-memory", "40%", "--draft-quant", "none",
                          "--draft-experts", str(DRAFT_EXPERTS), "--max-batch-size", "16")
    yield served.url
    served.stop()
    assert "Traceback" not in served.log(), served.log()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()  # before the server stops: the page's live stream closes first


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers=AUTH, timeout=120) as client:
        yield client


def js(driver, expression: str):
    return driver.execute_script(f"return ({expression});")


def wait_for(driver, expression: str, timeout: float = 60):
    """Until `expression` (JavaScript) is truthy on the page; its value."""
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: js(d, expression))


def metric(http, name: str) -> float:
    line = next(x for x in http.get("/metrics").text.splitlines() if x.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def severe(logs: list[dict]) -> list[dict]:
    return [entry for entry in logs if entry["level"] == "SEVERE"]


def type_prompt(driver, text: str, max_tokens: int) -> None:
    prompt, tokens = driver.find_element(By.ID, "prompt"), driver.find_element(By.ID, "max-tokens")
    prompt.clear()
    prompt.send_keys(text)
    tokens.clear()
    tokens.send_keys(str(max_tokens))


def open_without_a_key(browser, server) -> None:
    browser.get(server)
    browser.execute_script("sessionStorage.clear()")
    browser.get(server)
    wait_for(browser, "!document.getElementById('key-form').hidden")


def enter_the_key(browser, server) -> None:
    open_without_a_key(browser, server)
    browser.find_element(By.ID, "key-input").send_keys(KEY)
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
    wait_for(browser, "document.getElementById('connection').dataset.state === 'live'")


def test_without_the_key_the_page_generates_nothing(server, browser, http):
    open_without_a_key(browser, server)
    requests_before = metric(http, "specmoe_requests_total")
    type_prompt(browser, "The built-in function len returns", 8)
    browser.find_element(By.ID, "send").click()
    assert "API key" in wait_for(browser, "document.getElementById('prompt-error').textContent")
    browser.find_element(By.ID, "key-input").send_keys("a wrong key")
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
    assert "refused" in wait_for(browser, "document.getElementById('key-message').textContent")
    # the page answers the click at once, saying so (a sent request would add an exchange at once too)
    browser.execute_script("document.getElementById('prompt-error').textContent = ''")
    browser.find_element(By.ID, "send").click()
    assert "API key" in wait_for(browser, "document.getElementById('prompt-error').textContent")
    assert js(browser, "document.querySelectorAll('.exchange').length") == 0
    assert js(browser, "document.getElementById('live-generated').textContent") == "-"  # no live data either
    assert metric(http, "specmoe_requests_total") == requests_before


def test_with_the_key_the_page_loads_without_console_errors(server, browser):
    open_without_a_key(browser, server)
    browser.get_log("browser")  # drop what came before (a refused key's 401s)
    browser.find_element(By.ID, "key-input").send_keys(KEY)
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
    wait_for(browser, "document.getElementById('connection').dataset.state === 'live'")
    browser.get(server)  # the key is kept for the session: a reload goes straight to live
    wait_for(browser, "document.getElementById('count-offload').textContent !== '0'")
    assert js(browser, "document.getElementById('connection').dataset.state") == "live"
    assert severe(browser.get_log("browser")) == []


def test_a_prompt_streams_the_apis_greedy_output(server, browser, http):
    enter_the_key(browser, server)
    browser.get_log("browser")
    prompt = "The built-in function len returns"
    type_prompt(browser, prompt, 16)
    # note the answer's length at each change, as it happens, independently of the page's own code
    browser.execute_script("""
        window.lengthsSeen = new Set();
        new MutationObserver(() => {
            const text = document.querySelector('.exchange:last-child .answer .text');
            if (text && text.textContent) window.lengthsSeen.add(text.textContent.length);
        }).observe(document.getElementById('transcript'), {subtree: true, childList: true, characterData: true});""")
    browser.find_element(By.ID, "send").click()
    wait_for(browser, "document.querySelector('.exchange:last-child .answer').dataset.state === 'done'")
    shown = js(browser, "document.querySelector('.exchange:last-child .answer .text').textContent")
    api = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0}).json()
    assert shown == api["choices"][0]["text"] and shown
    assert js(browser, "window.lengthsSeen.size") >= 3  # the text arrived in pieces, not at the end
    stats = js(browser, "document.querySelector('.exchange:last-child .answer-stats').textContent")
    assert "tokens/s" in stats and "policy specmoe" in stats
    assert severe(browser.get_log("browser")) == []


def map_signature(driver) -> str:
    return js(driver, "Array.from(document.querySelectorAll('#expert-map .cell'))"
                      ".map(c => c.dataset.state + ':' + c.dataset.load).join(',')")


def run_batch(server) -> list[threading.Thread]:
    prompts = [json.loads(line)["prompt"][:300] for line in PROMPTS_FILE.read_text().splitlines()[:BATCH]]

    def ask(prompt):
        httpx.post(server + "/v1/completions", headers=AUTH, timeout=300,
                   json={"prompt": prompt, "max_tokens": BATCH_TOKENS, "temperature": 0, "ignore_eos": True})

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    return threads


def test_the_live_view_follows_a_batch_run(server, browser, http, tmp_path):
    enter_the_key(browser, server)
    browser.get_log("browser")
    generated_before = int(js(browser, "document.getElementById('live-generated').textContent"))
    map_before = map_signature(browser)
    threads = run_batch(server)
    try:
        wait_for(browser, f"+document.getElementById('live-running').textContent >= {BATCH // 2} && "
                          f"+document.getElementById('live-generated').textContent > {generated_before + 2 * BATCH}")
        during = {name: int(js(browser, f"document.getElementById('count-{name}').textContent"))
                  for name in ("draft", "device", "fetched")}
        loads = js(browser, "Array.from(document.querySelectorAll('#expert-map .cell')).map(c => +c.dataset.load)")
        shot = Path(os.environ.get("SPECMOE_UI_SCREENSHOT") or tmp_path / "ui.png")
        assert browser.save_screenshot(str(shot))
    finally:
        for t in threads:
            t.join()
    generated = metric(http, "specmoe_generation_tokens_total")
    wait_for(browser, f"+document.getElementById('live-generated').textContent === {int(generated)}", timeout=10)
    assert generated >= generated_before + BATCH * BATCH_TOKENS
    assert during["draft"] == DRAFT_EXPERTS * BLOCKS and during["device"] >= during["draft"]
    assert during["fetched"] > 0 and sum(loads) > 0
    assert map_signature(browser) != map_before
    assert shot.stat().st_size > 10_000
    assert severe(browser.get_log("browser")) == []
