"""The playground at `/`, driven by Debian's headless Chromium (through Playwright, never a
downloaded browser) against a real `cde serve` on the built-in demo (the trained reference model,
an instruct one): keyboard only, a neutral prompt in chat mode (the default) steered toward one
concept found by name, attribution on. The steered text is about that topic and the unsteered one
is not (the training program's topic judge reads them); the concept panels name catalog concepts.
A server that refuses chat (a base model) makes the page fall back to plain completions.
Screenshots go to $CDE_PLAYGROUND_SHOTS (default: a pytest temporary directory)."""

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import httpx
import pytest
from cde.gateway.errors import invalid

from cde.train.text import on_topic_share
from tests.api_server import ServerProcess

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PROMPT = "Write a few sentences."
# What the page sends for the test's choices: "space" found by name (concept 4 of the demo's catalog),
# the slider moved from 8 to 24, the demo's documented amplify strength (neutral prompts go on topic).
STEERING = {"concepts": [4], "preset": "amplify", "strength": 24}
# The compare run's length (the page's default is 256): the unsteered answer runs to it, past the
# templated prompt's first block and a whole second one, into a third.
MAX_TOKENS = 128

# Test-side probe: after every animation frame, how many cells of the steered run are still
# masks, how many hold tokens, and how many held tokens the server dropped when their block
# completed (landed after the end of turn).
FRAME_PROBE = """
window.__frames = [];
requestAnimationFrame(function probe() {
  const run = document.getElementById("run-steered");
  const count = (selector) => run.querySelectorAll(selector).length;
  if (run) window.__frames.push([count(".cell.mask"), count(".cell.tok"), count(".cell.dropped")]);
  requestAnimationFrame(probe);
});
"""


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(None, workers=2)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y --no-install-recommends chromium (bash .ci/run does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture
def shots(tmp_path) -> Path:
    out = Path(os.environ.get("CDE_PLAYGROUND_SHOTS", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    return out


def api_choice(server, body: dict, chat: bool = True) -> dict:
    """The API's answer to what the page sends: in chat the prompt is the user's message, and the
    choice's message content is returned as `text`, with the response's prompt_token_ids."""
    body = {"model": "cde-reference", "temperature": 0, "top_p": 1, "seed": 42, "return_token_ids": True, **body}
    if chat:
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    r = httpx.post(server.base_url + ("/chat/completions" if chat else "/completions"), json=body, timeout=180)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if chat:
        choice["text"] = choice["message"]["content"]
        choice["prompt_token_ids"] = r.json()["prompt_token_ids"]
    return choice


def test_playground_streams_the_denoising_and_matches_the_api(server, browser, shots):
    # The API's answers to the requests the page will make, computed meanwhile.
    pool = ThreadPoolExecutor(2)
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "tokens_per_step": 2, "attribution": {"top_k": 5}}
    steered = pool.submit(api_choice, server, body | {"steering": STEERING})
    unsteered = pool.submit(api_choice, server, body)
    page = browser.new_page(viewport={"width": 1500, "height": 1150})
    blocked = []  # what the page's Content-Security-Policy refused: the page must need none of it
    page.on("console", lambda m: blocked.append(m.text) if "Content Security Policy" in m.text else None)
    page.add_init_script(FRAME_PROBE)
    page.goto(server.url + "/")
    page.wait_for_selector("#model:has-text('model: cde-reference')")
    assert page.is_checked("#chat")  # chat mode by default: the instruct model steers through its template

    # Keyboard only: type the prompt, find "space" and take the first match with Enter.
    page.focus("#prompt")
    page.keyboard.press("Control+A")
    page.keyboard.type(PROMPT)
    page.focus("#tokens_per_step")
    page.keyboard.press("ArrowUp")  # 2 tokens per step keeps the CI run short
    page.focus("#max_tokens")
    page.keyboard.press("Control+A")
    page.keyboard.type(str(MAX_TOKENS))
    page.focus("#concept_search")
    page.keyboard.type("space")
    page.wait_for_selector("#concept_results button")
    page.keyboard.press("Enter")
    page.wait_for_selector("#chosen button:has-text('Space')")
    page.focus("#strength")
    for _ in range(32):  # 8 -> 24 in steps of 0.5
        page.keyboard.press("ArrowRight")
    assert page.text_content("#strength_value") == "24"
    # Compare: steered and unsteered side by side, same seed, in one run (a steered run alone
    # would decode the steered text a third time).
    page.focus("#compare")
    page.keyboard.press("Space")
    page.focus("#prompt")
    page.keyboard.press("Control+Enter")

    # Polled from here: wait_for_function evals its predicate in the page, which the CSP forbids.
    # The steered answer is short (the chat model ends its turn within the first block).
    deadline = time.monotonic() + 180
    while page.evaluate("document.querySelectorAll('#run-steered .cell.tok').length") < 24:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    page.screenshot(path=str(shots / "playground-denoising.png"))
    page.wait_for_selector("#run-steered.done", timeout=180_000)
    page.wait_for_selector("#run-unsteered.done", timeout=180_000)
    page.wait_for_selector("#status:has-text('done')")
    page.screenshot(path=str(shots / "playground-compare.png"), full_page=True)
    page.locator("#run-steered").screenshot(path=str(shots / "playground-final.png"))

    # Mask cells turned into tokens over many frames, not all at once: the answer's tokens are
    # cells, the ones after its end of turn struck out, no mask left.
    expected = steered.result()
    frames = page.evaluate("window.__frames")
    assert frames[-1][1] == len(expected["token_ids"]) and frames[-1][0] == 0
    landed = [tok + dropped for _, tok, dropped in frames]  # a landed token is kept or dropped, never unlanded
    filling = {n for n in landed if 0 < n < landed[-1]}
    assert len(filling) >= 10, f"tokens landed in only {len(filling)} intermediate frames"
    assert all(a <= b for a, b in pairwise(landed))
    # ... out of order: within a block, cells that landed later sit left of earlier ones; the
    # first cells hold the templated prompt's tail.
    assert _landing_steps(page, "steered", 0) != sorted(_landing_steps(page, "steered", 0))
    tail = len(expected["prompt_token_ids"]) % 64
    assert len(page.query_selector_all("#run-steered .block[data-block='0'] .cell.prompt")) == tail

    # The final text is the API's text for the same chat request (same seed, same steering), on the topic.
    assert page.text_content("#run-steered .final-text") == expected["text"]
    assert on_topic_share(expected["text"], "Space") >= 0.5, expected["text"]
    # Each block's concept panel lists its chunk's top concepts, known vs discovered marked.
    chunks = expected["attribution"]["chunks"]
    panels = page.query_selector_all("#run-steered .block .concepts")
    assert len(panels) == len(chunks) >= 1
    assert panels[0].query_selector(".label").text_content() == "Space"  # the steered concept comes first
    for panel, chunk in zip(panels, chunks):
        labels = [e.text_content() for e in panel.query_selector_all(".label")]
        titles = [e.get_attribute("title").split("\n")[0] for e in panel.query_selector_all(".label")]
        badges = [e.text_content() for e in panel.query_selector_all(".badge")]
        # The badge says known or discovered; the label is the name, whole (the hover: the API's label).
        assert labels == [c["label"].split(": ", 1)[1] for c in chunk["concepts"]]
        assert titles == [c["label"] for c in chunk["concepts"]]
        known = [label for label, c in zip(labels, chunk["concepts"]) if c["type"] == "known"]
        assert known and not [label for label in known if label.startswith("#")]  # the catalog names them
        assert all(_fits(e) for e in panel.query_selector_all(".label")), labels
        assert badges == ["K" if c["type"] == "known" else "D" for c in chunk["concepts"]]
        assert panel.query_selector(".eps .val").text_content() == f"{chunk['epsilon_pct']:.1f}%"
    assert page.text_content("#run-unsteered .final-text") == unsteered.result()["text"]
    assert on_topic_share(unsteered.result()["text"], "Space") < 0.5
    # The unsteered answer runs to max_tokens: a whole block that filled in out of order.
    assert len(steps := _landing_steps(page, "unsteered", 1)) == 64 and steps != sorted(steps)
    print("compare runs:", page.text_content("#perf"))
    assert not blocked, blocked
    print("screenshots:", shots)


# The refusal a base model's server sends for chat, in the server's own words and shape.
NO_CHAT = invalid("model `cde-reference` is a base checkpoint without a chat template", "model", "chat_not_supported")


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "base-model-fallback"])
def test_clicking_a_token_shades_the_prompt_by_its_input_attribution(server, browser, chat):
    """Input attribution on: clicking a generated token shades every prompt token by that token's
    integrated-gradients contribution, the API's numbers for the same request. In chat those are the
    templated prompt's tokens, all shown. Without chat (the server refuses it as a base model would,
    here faked in the browser), the page falls back to /v1/completions and unchecks the box."""
    prompt, offset = "Tell me about the ocean and its tides.", 5
    body = {"prompt": prompt, "max_tokens": 64, "tokens_per_step": 4}
    body["attribution"] = {"top_k": 5, "inputs": {"top_k": 256, "steps": 2, "scope": "prompt"}}
    answer = api_choice(server, body, chat)
    expected = answer["attribution"]["inputs"]["tokens"][offset]

    page = browser.new_page(viewport={"width": 1500, "height": 1150})
    errors: list[str] = []
    page.on(
        "console",
        lambda m: errors.append(m.text) if m.type == "error" and "favicon" not in m.location.get("url", "") else None,
    )
    page.on("pageerror", lambda e: errors.append(str(e)))
    sent = []
    page.on("request", lambda r: sent.append(r.url.split("/v1")[-1]) if r.method == "POST" else None)
    if not chat:
        refusal = json.dumps(NO_CHAT.body())
        page.route(
            "**/v1/chat/completions", lambda r: r.fulfill(status=400, content_type="application/json", body=refusal)
        )
    page.goto(server.url + "/")
    page.wait_for_selector("#model:has-text('model: cde-reference')")
    page.fill("#prompt", prompt)
    page.fill("#max_tokens", "64")
    page.fill("#tokens_per_step", "4")
    page.check("#input_attribution")
    page.fill("#input_steps", "2")
    page.focus("#prompt")
    page.keyboard.press("Control+Enter")
    deadline = time.monotonic() + 180
    while not page.query_selector("#run-unsteered.done"):
        assert time.monotonic() < deadline and not [e for e in errors if chat or "400" not in e], errors
        time.sleep(0.1)
    page.wait_for_selector("#status:has-text('done')")
    assert page.text_content("#run-unsteered .final-text") == answer["text"]
    assert sent == (["/chat/completions"] if chat else ["/chat/completions", "/completions"])
    assert page.is_checked("#chat") == chat and ("no chat template" in page.text_content("#status")) != chat
    assert page.is_visible("#run-unsteered .prompt-view")
    page.click(f"#run-unsteered .cell.tok[data-offset='{offset}']")
    spans = page.eval_on_selector_all(
        "#run-unsteered .ptok",
        "s => s.map(e => [Number(e.dataset.position), Number(e.dataset.shade), Number(e.dataset.contribution),"
        " e.textContent, getComputedStyle(e).backgroundColor])",
    )
    want = {i["position"]: i for i in expected["inputs"]}
    assert [s[0] for s in spans] == sorted(want)  # the whole prompt, in order
    if chat:  # the templated prompt: its special tokens (no text) as markers, the user's words inside
        assert len(spans) == len(answer["prompt_token_ids"])
        assert [s[3] == "◆" for s in spans] == [not want[p]["text"] for p in sorted(want)]
        assert prompt in "".join(s[3] for s in spans)
    else:
        assert "".join(s[3] for s in spans) == prompt
    top = max(abs(i["contribution"]) for i in expected["inputs"])
    for position, shade, contribution, _, color in spans:
        assert contribution == pytest.approx(want[position]["contribution"], rel=1e-6)
        assert shade == pytest.approx(abs(contribution) / top, abs=1e-3)
        assert ("209, 73, 63" if contribution < 0 else "47, 111, 223") in color  # red lowers, blue raises
    strongest = max(spans, key=lambda s: s[1])
    assert strongest[0] == expected["inputs"][0]["position"] and strongest[1] == 1.0
    assert page.is_visible(f"#run-unsteered .cell.selected[data-offset='{offset}']")
    page.close()


def _landing_steps(page, run: str, block: int) -> list[int]:
    """The step at which each token cell of a block landed, in position order."""
    return page.eval_on_selector_all(
        f"#run-{run} .block[data-block='{block}'] .cell.tok", "cs => cs.map(c => Number(c.title.split('step ').pop()))"
    )


def _fits(element) -> bool:
    """The element shows all of its text: nothing cut off to its right."""
    return element.evaluate("e => e.scrollWidth <= e.clientWidth + 1")


def test_the_generate_button_works_with_every_default(server, browser):
    """A fresh page, nothing touched, a click on Generate: every default passes the browser's own
    form validation (a top-p field whose step made 1 invalid once blocked the submit silently), a
    request goes out, and blocks arrive. A concept label's hover shows its catalog description."""
    assert any(line.startswith("CDE serving cde-reference (") for line in server.output)  # the banner names it
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(server.url + "/")
    page.wait_for_selector("#model:has-text('model: cde-reference')")
    invalid = page.eval_on_selector_all(
        "#controls input",
        "inputs => inputs.filter(i => !i.checkValidity()).map(i => i.id + ': ' + i.validationMessage)",
    )
    assert invalid == []
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions"), timeout=10_000) as sent:
        page.click("#generate")
    body = sent.value.post_data_json
    assert body["messages"] == [{"role": "user", "content": "Tell me about the ocean."}] and "prompt" not in body
    assert body["top_p"] == 1 and body["max_tokens"] == 256
    page.wait_for_selector("#run-unsteered .block.frozen .concept", timeout=120_000)  # a whole block
    page.keyboard.press("Escape")  # stops it, unless the chat answer already ended in its first block
    page.wait_for_selector("#generate:enabled")
    assert page.text_content("#status") in ("stopped", "done")
    label = page.query_selector("#run-unsteered .block.frozen .concept.known .label")
    concept_id = label.get_attribute("data-concept-id")
    expected = httpx.get(f"{server.base_url}/concepts/{concept_id}", timeout=30).json()
    assert expected["description"]
    label.hover()
    deadline = time.monotonic() + 10
    while "\n" not in (label.get_attribute("title") or ""):
        assert time.monotonic() < deadline, label.get_attribute("title")
        time.sleep(0.05)
    assert label.get_attribute("title").split("\n") == [f"Known: {expected['name']}", expected["description"]]
    page.close()
