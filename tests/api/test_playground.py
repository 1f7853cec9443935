"""The playground at `/`, driven by Debian's headless Chromium (through Playwright, never a
downloaded browser) against a real `cde serve` on the built-in demo (the trained reference model):
keyboard only, a neutral prompt steered toward one concept found by name, attribution on. The
steered text is about that topic and the unsteered one is not (the training program's topic judge
reads them); the concept panels name catalog concepts. Screenshots go to $CDE_PLAYGROUND_SHOTS
(default: a pytest temporary directory)."""

import os
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import httpx
import pytest

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
# the slider moved from 8 to 32, the strength at which the eval's amplify takes neutral prompts on topic.
STEERING = {"concepts": [4], "preset": "amplify", "strength": 32}

# Test-side probe: after every animation frame, how many cells of the steered run are still
# masks and how many hold tokens.
FRAME_PROBE = """
window.__frames = [];
requestAnimationFrame(function probe() {
  const run = document.getElementById("run-steered");
  if (run) window.__frames.push([run.querySelectorAll(".cell.mask").length, run.querySelectorAll(".cell.tok").length]);
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


def api_choice(server, steering: dict | None) -> dict:
    body = {
        "model": "cde-reference",
        "prompt": PROMPT,
        "max_tokens": 256,
        "temperature": 0,
        "top_p": 1,
        "seed": 42,
        "tokens_per_step": 2,
        "attribution": {"top_k": 5},
        **({"steering": steering} if steering else {}),
    }
    r = httpx.post(server.base_url + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_playground_streams_the_denoising_and_matches_the_api(server, browser, shots):
    # The API's answers to the requests the page will make, computed meanwhile.
    pool = ThreadPoolExecutor(2)
    steered, unsteered = pool.submit(api_choice, server, STEERING), pool.submit(api_choice, server, None)
    page = browser.new_page(viewport={"width": 1500, "height": 1150})
    blocked = []  # what the page's Content-Security-Policy refused: the page must need none of it
    page.on("console", lambda m: blocked.append(m.text) if "Content Security Policy" in m.text else None)
    page.add_init_script(FRAME_PROBE)
    page.goto(server.url + "/")
    page.wait_for_selector("#model:has-text('model: cde-reference')")

    # Keyboard only: type the prompt, find "space" and take the first match with Enter.
    page.focus("#prompt")
    page.keyboard.press("Control+A")
    page.keyboard.type(PROMPT)
    page.focus("#tokens_per_step")
    page.keyboard.press("ArrowUp")  # 2 tokens per step keeps the CI run short
    page.focus("#concept_search")
    page.keyboard.type("space")
    page.wait_for_selector("#concept_results button")
    page.keyboard.press("Enter")
    page.wait_for_selector("#chosen button:has-text('Space')")
    page.focus("#strength")
    for _ in range(48):  # 8 -> 32 in steps of 0.5
        page.keyboard.press("ArrowRight")
    assert page.text_content("#strength_value") == "32"
    # Compare: steered and unsteered side by side, same seed, in one run (a steered run alone
    # would decode the steered text a third time).
    page.focus("#compare")
    page.keyboard.press("Space")
    page.focus("#prompt")
    page.keyboard.press("Control+Enter")

    # Polled from here: wait_for_function evals its predicate in the page, which the CSP forbids.
    deadline = time.monotonic() + 180
    while page.evaluate("document.querySelectorAll('#run-steered .cell.tok').length") < 90:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    page.screenshot(path=str(shots / "playground-denoising.png"))
    page.wait_for_selector("#run-steered.done", timeout=180_000)
    page.wait_for_selector("#run-unsteered.done", timeout=180_000)
    page.wait_for_selector("#status:has-text('done')")
    page.screenshot(path=str(shots / "playground-compare.png"), full_page=True)

    # Mask cells turned into tokens over many frames, not all at once.
    frames = page.evaluate("window.__frames")
    total = frames[-1][1]
    assert total == 256 and frames[-1][0] == 0
    filling = {tok for mask, tok in frames if 0 < tok < total}
    assert len(filling) >= 20, f"tokens landed in only {len(filling)} intermediate frames"
    assert all(a[1] <= b[1] for a, b in pairwise(frames))
    # ... and out of order: within a block, cells that landed later sit left of earlier ones.
    steps = page.eval_on_selector_all(
        "#run-steered .block[data-block='1'] .cell.tok", "cells => cells.map(c => Number(c.title.split('step ').pop()))"
    )
    assert len(steps) == 64 and steps != sorted(steps)

    # The final text is the API's text for the same request (same seed, same steering), on the topic.
    expected = steered.result()
    assert page.text_content("#run-steered .final-text") == expected["text"]
    assert on_topic_share(expected["text"], "Space") >= 0.5, expected["text"]
    # Each block's concept panel lists its chunk's top concepts, known vs discovered marked.
    chunks = expected["attribution"]["chunks"]
    panels = page.query_selector_all("#run-steered .block .concepts")
    assert len(panels) == len(chunks) == 5  # the prompt's tail block, then 4 more (256 tokens)
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
    print("compare runs:", page.text_content("#perf"))
    assert not blocked, blocked
    print("screenshots:", shots)


def test_clicking_a_token_shades_the_prompt_by_its_input_attribution(server, browser):
    """Input attribution on: clicking a generated token shades every prompt token by that token's
    integrated-gradients contribution, the API's numbers for the same request."""
    prompt, offset = "Tell me about the ocean and its tides.", 5
    body = {
        "model": "cde-reference",
        "prompt": prompt,
        "max_tokens": 64,
        "temperature": 0,
        "top_p": 1,
        "seed": 42,
        "tokens_per_step": 4,
        "attribution": {"top_k": 5, "inputs": {"top_k": 256, "steps": 2, "scope": "prompt"}},
    }
    r = httpx.post(server.base_url + "/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    expected = r.json()["choices"][0]["attribution"]["inputs"]["tokens"][offset]

    page = browser.new_page(viewport={"width": 1500, "height": 1150})
    errors: list[str] = []
    page.on(
        "console",
        lambda m: errors.append(m.text) if m.type == "error" and "favicon" not in m.location.get("url", "") else None,
    )
    page.on("pageerror", lambda e: errors.append(str(e)))
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
        assert time.monotonic() < deadline and not errors, (errors, page.text_content("#status"))
        time.sleep(0.1)
    page.wait_for_selector("#status:has-text('done')")
    assert page.is_visible("#run-unsteered .prompt-view")
    page.click(f"#run-unsteered .cell.tok[data-offset='{offset}']")
    spans = page.eval_on_selector_all(
        "#run-unsteered .ptok",
        "s => s.map(e => [Number(e.dataset.position), Number(e.dataset.shade), Number(e.dataset.contribution),"
        " e.textContent, getComputedStyle(e).backgroundColor])",
    )
    want = {i["position"]: i for i in expected["inputs"]}
    assert [s[0] for s in spans] == sorted(want)  # the whole prompt, in order
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
    with page.expect_request(lambda r: r.url.endswith("/v1/completions"), timeout=10_000) as sent:
        page.click("#generate")
    body = sent.value.post_data_json
    assert body["prompt"] == "Tell me about the ocean." and body["top_p"] == 1 and body["max_tokens"] == 256
    page.wait_for_selector("#run-unsteered .block.frozen .concept", timeout=120_000)  # a whole block
    page.click("#stop")
    page.wait_for_selector("#status:has-text('stopped')")
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
