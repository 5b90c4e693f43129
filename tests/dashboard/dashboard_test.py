#!/usr/bin/env python3
"""The dashboard in a real headless Chromium against a real node.

Run by tests/it/dashboard.rs with a fresh node (the default model's files
present, nothing placed, HF_ENDPOINT at a local hub). Environment:
  TESSERA_API          http://127.0.0.1:PORT of the node
  TESSERA_MODEL        the model to place and chat with
  TESSERA_HUB_REPO     a GGUF repository on the local hub, to add and download
  TESSERA_SCREENSHOTS  folder for the PNGs
  CHROMIUM             the system Chromium (default /usr/bin/chromium)
  TESSERA_DASHBOARD_URL  optional: where the page is (default TESSERA_API + "/")

Steps: the Cluster page shows the node; the Models page places the model
through the place dialog and sees it Ready; the Chat page's greedy answer
equals the API's, with TTFT and tokens/s; stop cancels a long answer (the
task cancelled in the event log); a download from the hub moves its bar and
is cancelled; the Events page filters, and time travel shows the instance
absent before its creation and present now. No console errors throughout.
Prints one line per step; on failure prints why, saves failure.png, exits 1.
"""

import json
import os
import sys
import time
import traceback
import urllib.error
import urllib.request

from playwright.sync_api import expect, sync_playwright

API = os.environ.get("TESSERA_API", "http://127.0.0.1:52415").rstrip("/")
MODEL = os.environ.get("TESSERA_MODEL", "smollm2-135m-instruct-q4_1")
HUB_REPO = os.environ.get("TESSERA_HUB_REPO", "")
SHOTS = os.environ.get("TESSERA_SCREENSHOTS", "target/dashboard-screenshots")
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
PAGE_URL = os.environ.get("TESSERA_DASHBOARD_URL", API + "/")

READY_TIMEOUT_S = 120
ANSWER_TIMEOUT_S = 120
SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly."
QUESTION = "What is the capital of France?"
SHORT_MAX_TOKENS = 24
LONG_PROMPT = "Write a very long story, at least two thousand words, about a lighthouse keeper and a storm."
LONG_MAX_TOKENS = 1500

problems = []  # console errors and page errors, across every page
t0 = time.monotonic()


def log(message):
    print(f"[dashboard {time.monotonic() - t0:6.1f}s] {message}", flush=True)


def step(message):
    log(f"step: {message}")


def ms(seconds):
    return int(seconds * 1000)


def api_json(method, path, body=None, timeout=60):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(API + path, data=data, method=method,
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{method} {path} answered {e.code}: {e.read()[:500]!r}") from None


def read_events(from_index, want, deadline_s):
    """Reads /events from `from_index` until want(event) is true (returns
    that event) or the deadline passes (returns None); the stream never ends
    by itself, so every read has a timeout."""
    deadline = time.monotonic() + deadline_s
    response = urllib.request.urlopen(f"{API}/events?from={from_index}", timeout=5)
    try:
        while time.monotonic() < deadline:
            try:
                line = response.readline()
            except TimeoutError:
                continue
            if not line:
                return None
            line = line.decode().strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if want(event):
                return event
        return None
    finally:
        response.close()


def shot(page, name):
    path = os.path.join(SHOTS, f"{name}.png")
    page.screenshot(path=path)
    log(f"screenshot {path}")


def watch(page, label):
    def on_console(message):
        if message.type == "error":
            location = message.location or {}
            problems.append(f"{label}: console error: {message.text} ({location.get('url', '')}:{location.get('lineNumber', '')})")

    page.on("console", on_console)
    page.on("pageerror", lambda error: problems.append(f"{label}: page error: {error}"))


def goto(page, route):
    page.click(f'[data-testid="nav-{route}"]')
    expect(page.locator(f"#page-{route}")).to_be_visible()


def wait_until(what, check, timeout_s, interval_s=0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def cluster_page(page, node_id):
    step("Cluster page shows the node with its master badge and memory bar")
    page.goto(PAGE_URL + "#/cluster")
    card = page.locator(f'[data-testid="node-card"][data-node-id="{node_id}"]')
    expect(card).to_be_visible(timeout=ms(20))
    expect(card.locator('[data-testid="node-master"]')).to_be_visible()
    bar = card.locator('[data-testid="memory-bar"]')
    value, maximum = bar.evaluate("m => [m.value, m.max]")
    assert 0 < value <= maximum, f"memory bar {value}/{maximum}"
    expect(page.locator('[data-testid="banner"]')).to_be_hidden()
    paint = page.evaluate("(performance.getEntriesByName('first-contentful-paint')[0] || {}).startTime")
    log(f"first contentful paint {paint:.0f} ms" if paint else "first contentful paint not reported")
    shot(page, "01-cluster")


def place_model(page):
    step(f"Models page: place {MODEL} (pipeline, 1 node) from the place dialog")
    before = set(api_json("GET", "/state")["state"].get("instances", {}))
    goto(page, "models")
    row = page.locator(f'[data-testid="model-row"][data-model-id="{MODEL}"]')
    expect(row).to_be_visible(timeout=ms(20))
    row.locator('[data-testid="place-button"]').click()
    preview = page.locator('[data-testid="preview-row"][data-sharding="SHARDING_PIPELINE"][data-node-count="1"]')
    expect(preview).to_be_visible(timeout=ms(20))
    assert preview.get_attribute("data-fits") == "true", f"the pipeline preview does not fit: {preview.inner_text()}"
    expect(preview).to_contain_text("memory per node")
    preview.locator("input").check()
    shot(page, "02-models-place-dialog")
    page.click('[data-testid="place-confirm"]')
    expect(page.locator('[data-testid="place-dialog"]')).to_be_hidden(timeout=ms(30))
    instance_id = wait_until("the new instance in the state", lambda: next(
        (i for i, inst in api_json("GET", "/state")["state"].get("instances", {}).items()
         if i not in before and inst.get("model", {}).get("modelId") == MODEL), None), 20)
    step(f"wait until {instance_id} is Ready (at most {READY_TIMEOUT_S} s)")
    item = page.locator(f'[data-testid="model-instance"][data-instance-id="{instance_id}"]')
    expect(item.locator('[data-testid="instance-state"]')).to_contain_text("Ready", timeout=ms(READY_TIMEOUT_S))
    log(f"instance {instance_id} is Ready")
    shot(page, "03-models-ready")
    goto(page, "cluster")
    runner = page.locator(f'[data-testid="instance-row"][data-instance-id="{instance_id}"] [data-testid="runner-state"]')
    expect(runner.first).to_contain_text("Ready", timeout=ms(10))
    shot(page, "04-cluster-instance")
    return instance_id


def last_answer(page):
    return page.locator('[data-testid="chat-answer"]').last


def chat_and_compare(page):
    step("Chat: a greedy answer streamed in the page equals the API's")
    goto(page, "chat")
    page.click('[data-testid="chat-new"]')
    expect(page.locator(f'[data-testid="chat-model"] option[value="{MODEL}"]')).to_be_attached(timeout=ms(20))
    page.select_option('[data-testid="chat-model"]', MODEL)
    page.fill('[data-testid="chat-system"]', SYSTEM_PROMPT)
    page.fill('[data-testid="chat-temperature"]', "0")
    page.fill('[data-testid="chat-max-tokens"]', str(SHORT_MAX_TOKENS))
    page.fill('[data-testid="chat-input"]', QUESTION)
    page.click('[data-testid="chat-send"]')
    answer = last_answer(page)
    expect(answer).to_have_attribute("data-state", "done", timeout=ms(ANSWER_TIMEOUT_S))
    shown = answer.locator('[data-testid="answer-text"]').text_content()
    log(f"page answered {shown!r}")
    reply = api_json("POST", "/v1/chat/completions", {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": SHORT_MAX_TOKENS,
    }, timeout=ANSWER_TIMEOUT_S)
    expected = reply["choices"][0]["message"]["content"]
    log(f"API answered  {expected!r}")
    assert shown == expected, f"the page's answer {shown!r} differs from the API's {expected!r}"
    assert shown.strip(), "an empty answer"
    stats = answer.locator('[data-testid="answer-stats"]').text_content()
    log(f"stats: {stats}")
    assert "TTFT" in stats and "ms" in stats, f"no time to first token in {stats!r}"
    assert "tokens/s" in stats, f"no tokens/s in {stats!r}"
    expect(page.locator('[data-testid="conversation-list"] li')).to_have_count(1)
    shot(page, "05-chat")


def chat_stop(page):
    step("Chat: stop a long answer; the task is cancelled in the event log")
    before = int(api_json("GET", "/state")["last_index"]) + 1
    page.fill('[data-testid="chat-max-tokens"]', str(LONG_MAX_TOKENS))
    page.fill('[data-testid="chat-input"]', LONG_PROMPT)
    page.click('[data-testid="chat-send"]')
    answer = last_answer(page)
    text = answer.locator('[data-testid="answer-text"]')
    wait_until("the long answer's first words",
               lambda: len(text.text_content() or "") > 20 or answer.get_attribute("data-state") != "streaming",
               ANSWER_TIMEOUT_S)
    assert answer.get_attribute("data-state") == "streaming", \
        f"the long answer ended before stop ({answer.get_attribute('data-state')}): {text.text_content()!r}"
    page.click('[data-testid="chat-stop"]')
    expect(answer).to_have_attribute("data-state", "stopped", timeout=ms(10))
    expect(answer.locator('[data-testid="answer-status"]')).to_contain_text("Stopped")
    expect(page.locator('[data-testid="chat-stop"]')).to_be_disabled()
    log(f"stopped after {len(text.text_content())} characters")
    generations = set()

    def cancelled(event):
        kind, body = next(iter(event["event"].items()))
        if kind == "taskCreated" and "textGeneration" in body.get("task", {}):
            generations.add(body["task"]["taskId"])
        return (kind == "taskStatusUpdated" and body.get("taskId") in generations
                and body.get("status") == "TASK_STATUS_CANCELLED")

    event = read_events(before, cancelled, 30)
    assert event, f"no TASK_STATUS_CANCELLED for the generation tasks {sorted(generations)} in the log from {before}"
    log(f"event {event['index']}: task {event['event']['taskStatusUpdated']['taskId']} cancelled")
    shot(page, "06-chat-stopped")


def download(page):
    step(f"Models page: add {HUB_REPO} from the hub, download it, watch the bar move, cancel")
    goto(page, "models")
    page.fill('[data-testid="add-model-input"]', HUB_REPO)
    page.click('[data-testid="add-model-button"]')
    result = page.locator('[data-testid="add-model-result"]')
    error = page.locator('.add-form [data-testid="error-message"]')
    wait_until("the model added (or an error)", lambda: result.is_visible() or error.is_visible(), 60)
    assert not error.is_visible(), f"adding {HUB_REPO} failed: {error.text_content()}"
    log(result.text_content())
    row = page.locator(f'[data-testid="model-row"][data-model-id^="{HUB_REPO}"]')
    expect(row).to_be_visible(timeout=ms(20))
    model_id = row.get_attribute("data-model-id")
    row.locator('[data-testid="download-button"]').click()
    bar = row.locator('[data-testid="download-progress"]')
    expect(bar).to_be_visible(timeout=ms(30))
    row.scroll_into_view_if_needed()
    first, maximum = bar.evaluate("b => [b.value, b.max]")
    time.sleep(1.0)

    def moved():
        value, top = bar.evaluate("b => [b.value, b.max]")
        return (value, top) if value > first else None

    # The node reports progress about once a second: allow one more report.
    second, maximum = wait_until("the download bar to move", moved, 5)
    log(f"{model_id}: {first:.0f} then {second:.0f} of {maximum:.0f} bytes")
    assert second > first, f"the download bar did not move: {first} then {second}"
    assert second < maximum, f"the download is already complete ({second} of {maximum})"
    shot(page, "07-models-download")
    row.locator('[data-testid="download-cancel"]').click()
    expect(row.locator('[data-testid="download-state"]')).to_have_text("Cancelled", timeout=ms(30))
    expect(row.locator('[data-testid="error-message"]')).to_have_count(0)
    downloads = api_json("GET", "/downloads")
    states = [list(k for k in m.get(model_id, {}) if k not in ("modelId", "shards")) for m in
              (d.get("models", {}) for d in downloads.values())]
    assert ["cancelled"] in states, f"the downloads say {downloads}"
    shot(page, "08-models-cancelled")


def events_page(page, instance_id):
    step("Events page: rows arrive; filtering by kind narrows them")
    goto(page, "events")
    rows = page.locator('[data-testid="event-row"]')
    expect(rows.first).to_be_visible(timeout=ms(20))
    wait_until("the whole log", lambda: rows.count() >= int(api_json("GET", "/state")["last_index"]) - 5, 20)
    total = rows.count()
    page.select_option('[data-testid="event-filter-kind"]', "instanceCreated")
    wait_until("the filter applied", lambda: rows.count() < total, 10)
    kinds = set(rows.evaluate_all("rs => rs.map(r => r.dataset.kind)"))
    assert kinds == {"instanceCreated"}, f"filtered rows of kinds {kinds}"
    log(f"{total} rows, {rows.count()} instanceCreated")
    shot(page, "09-events-filtered")
    page.select_option('[data-testid="event-filter-kind"]', "")
    wait_until("the filter cleared", lambda: rows.count() >= total, 10)
    shot(page, "10-events")

    step("Events page: time travel before the instance's creation, then to now")
    created = read_events(1, lambda e: e["event"].get("instanceCreated", {}).get("instance", {})
                          .get("instanceId") == instance_id, 20)
    assert created, f"no InstanceCreated for {instance_id} in the log"
    index = int(created["index"])
    state = page.locator('[data-testid="timetravel-state"]')
    travel(page, index - 1)
    expect(state.locator(f'[data-testid="instance-row"][data-instance-id="{instance_id}"]')).to_have_count(0)
    shot(page, "11-events-timetravel-before")
    last = int(api_json("GET", "/state")["last_index"])
    travel(page, last)
    expect(state.locator(f'[data-testid="instance-row"][data-instance-id="{instance_id}"]')).to_be_visible()
    log(f"instance absent at {index - 1}, present at {last}")
    shot(page, "12-events-timetravel-now")


def travel(page, index):
    page.fill('[data-testid="timetravel-index"]', str(index))
    page.click('[data-testid="timetravel-go"]')
    result = page.locator(f'[data-testid="timetravel-state"] .tt-result[data-index="{index}"]')
    error = page.locator('[data-testid="timetravel-state"] [data-testid="error-message"]')
    wait_until(f"the state at {index}", lambda: result.is_visible() or error.is_visible(), 20)
    assert not error.is_visible(), f"time travel to {index} failed: {error.text_content()}"


def other_looks(browser):
    step("phone width (390x844) and dark screenshots")
    phone = browser.new_context(viewport={"width": 390, "height": 844}, color_scheme="light")
    page = phone.new_page()
    watch(page, "phone")
    for route in ("cluster", "chat"):
        page.goto(PAGE_URL + f"#/{route}")
        expect(page.locator(f"#page-{route}")).to_be_visible()
        if route == "cluster":
            expect(page.locator('#page-cluster [data-testid="node-card"]').first).to_be_visible(timeout=ms(20))
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 400, f"the {route} page scrolls sideways at 390 px ({width} px wide)"
        shot(page, f"13-phone-{route}")
    phone.close()
    dark = browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme="dark")
    page = dark.new_page()
    watch(page, "dark")
    for route in ("cluster", "models"):
        page.goto(PAGE_URL + f"#/{route}")
        expect(page.locator(f"#page-{route}")).to_be_visible()
        content = page.locator(f'#page-{route} [data-testid="node-card"], #page-{route} [data-testid="model-row"]')
        expect(content.first).to_be_visible(timeout=ms(20))
        shot(page, f"14-dark-{route}")
    dark.close()


def main():
    os.makedirs(SHOTS, exist_ok=True)
    expect.set_options(timeout=10_000)
    node_id = api_json("GET", "/cluster")["node_id"]
    log(f"node {node_id} at {API}, page {PAGE_URL}, model {MODEL}, hub repo {HUB_REPO or '(none)'}")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme="light")
        context.set_default_timeout(15_000)
        page = context.new_page()
        watch(page, "main")
        try:
            cluster_page(page, node_id)
            instance_id = place_model(page)
            chat_and_compare(page)
            chat_stop(page)
            if HUB_REPO:
                download(page)
            else:
                log("TESSERA_HUB_REPO unset: the download step is skipped")
            events_page(page, instance_id)
            other_looks(browser)
            step("no console errors")
            for problem in problems:
                log(problem)
            assert not problems, f"{len(problems)} console or page errors (above)"
        except Exception as error:  # any failure: say why, keep a picture
            log(f"FAILED: {error}")
            traceback.print_exc()
            for problem in problems:
                log(problem)
            try:
                shot(page, "failure")
            except Exception as shot_error:
                log(f"no failure screenshot: {shot_error}")
            browser.close()
            sys.exit(1)
        browser.close()
    log("all steps passed")


if __name__ == "__main__":
    main()
