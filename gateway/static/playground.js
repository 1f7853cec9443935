// The playground's controls: settings, the steering panel (concept search through
// /v1/concepts), and runs of /v1/chat/completions (chat template on) or /v1/completions with
// stream_denoise, one column per run (steered, and unsteered with the same seed when comparing).
import { Api } from "./api.js";
import { descriptions, RunView, titleOf } from "./render.js";

const $ = (id) => document.getElementById(id);
const api = new Api(() => $("api_key").value.trim());
const chosen = new Map(); // concept id -> label
let model = null;
let controller = null;

function status(text, isError = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", isError);
}

async function loadModel() {
  try {
    const { data } = await api.get("/models");
    model = data[0]?.id ?? null;
    $("model").textContent = `model: ${model ?? "none"}`;
    status(model ? "ready" : "no model is being served", !model);
  } catch (err) {
    status(`${err.message}; set the API key`, true);
  }
}

// ---- steering panel ------------------------------------------------------------------------
let searchTimer = 0;
async function search() {
  const q = $("concept_search").value.trim();
  try {
    const { data } = await api.get(`/concepts?limit=12&search=${encodeURIComponent(q)}`);
    $("concept_results").replaceChildren(
      ...data.filter((c) => c.type === "known").map((c) => item(`+ ${c.label}`, `add ${c.label}`, () => choose(c))),
    );
  } catch (err) {
    status(err.message, true);
  }
}

function item(text, label, onClick) {
  const li = document.createElement("li");
  const button = document.createElement("button");
  button.type = "button";
  button.textContent = text;
  button.setAttribute("aria-label", label);
  button.addEventListener("click", onClick);
  li.append(button);
  return li;
}

function choose(concept) {
  chosen.set(concept.id, concept.label);
  renderChosen();
}

function renderChosen() {
  $("chosen").replaceChildren(
    ...[...chosen].map(([id, label]) =>
      item(`${label} ✕`, `remove ${label}`, () => {
        chosen.delete(id);
        renderChosen();
        $("concept_search").focus();
      }),
    ),
  );
}

// ---- requests --------------------------------------------------------------------------------
const number = (id) => Number($(id).value);

function steering() {
  if (!chosen.size) return null;
  const mode = document.querySelector("input[name=mode]:checked").value;
  const strength = number("strength");
  return { concepts: [...chosen.keys()], preset: mode, strength: mode === "suppress" ? -strength : strength };
}

function requestBody(steer, chat) {
  const body = {
    model, max_tokens: number("max_tokens"), temperature: number("temperature"),
    top_p: number("top_p"), seed: number("seed"), tokens_per_step: number("tokens_per_step"),
    return_token_ids: true,
  };
  // An instruct model learned steering on chat-formatted prompts only: through chat the server
  // wraps the prompt in the model's template; plain completions take it as it is.
  if (chat) body.messages = [{ role: "user", content: $("prompt").value }];
  else body.prompt = $("prompt").value;
  if ($("attribution").checked) body.attribution = { top_k: number("top_k") };
  if ($("input_attribution").checked) {
    // Every prompt position (up to 256) for every token: the page shades the whole prompt.
    body.attribution = { top_k: number("top_k"), inputs: { top_k: 256, steps: number("input_steps"), scope: "prompt" } };
  }
  if (steer) body.steering = steer;
  return body;
}

// A chat chunk as the view reads a completion's: the delta's content is the text. The opening
// chunk (the assistant's role, no tokens) completes no block, so it is skipped.
function asCompletion(kind, choice) {
  if (kind === "step" || !choice.delta) return choice;
  return choice.delta.role ? null : { ...choice, text: choice.delta.content ?? "" };
}

async function stream(view, steer, chat, signal) {
  const body = { ...requestBody(steer, chat), stream: true, stream_denoise: true };
  for await (const { kind, data } of api.stream(chat ? "/chat/completions" : "/completions", body, signal)) {
    for (const choice of data.choices) {
      const c = asCompletion(kind, choice);
      if (c) view.push(kind, c);
    }
  }
}

// One run; true when it fell back. A base model has no chat template and refuses chat with
// chat_not_supported before it streams anything, so the run goes again as a plain completion
// (nothing is on screen yet) rather than failing, and the box is unchecked for the next runs.
async function run(view, steer, chat, signal) {
  try {
    await stream(view, steer, chat, signal);
    return false;
  } catch (err) {
    if (!chat || err.code !== "chat_not_supported") throw err;
    $("chat").checked = false;
    view.chat = false;
    status(`${model} has no chat template: sending the prompt as it is to /v1/completions…`);
    await stream(view, steer, false, signal);
    return true;
  }
}

function newView(title, chat) {
  const root = $("run-template").content.firstElementChild.cloneNode(true);
  root.id = `run-${title.toLowerCase()}`;
  $("runs").append(root);
  return new RunView(root, title, number("max_tokens"), chat);
}

async function generate(event) {
  event?.preventDefault();
  if (controller || !model) return;
  controller = new AbortController();
  $("runs").replaceChildren();
  const steer = steering();
  const chat = $("chat").checked; // read once: both runs of a compare go the same way
  const runs = [[steer ? "Steered" : "Unsteered", steer]];
  if ($("compare").checked && steer) runs.push(["Unsteered", null]);
  $("runs").classList.toggle("compare", runs.length > 1);
  setBusy(true);
  status($("compare").checked && !steer ? "generating (nothing to compare: no concept is steered)…" : "generating…");
  const meter = frameMeter();
  try {
    const fell = await Promise.all(runs.map(([title, s]) => run(newView(title, chat), s, chat, controller.signal)));
    status(fell.some(Boolean) ? `done (${model} has no chat template: sent to /v1/completions, chat template off)` : "done");
  } catch (err) {
    status(err.name === "AbortError" ? "stopped" : err.message, err.name !== "AbortError");
  } finally {
    $("perf").textContent = meter.stop();
    controller = null;
    setBusy(false);
  }
}

function setBusy(busy) {
  $("generate").disabled = busy;
  $("stop").disabled = !busy;
  document.body.classList.toggle("busy", busy);
}

// How smoothly the page rendered while tokens streamed in.
function frameMeter() {
  const start = performance.now();
  let last = start;
  let frames = 0;
  let worst = 0;
  let id = requestAnimationFrame(function tick(now) {
    frames++;
    worst = Math.max(worst, now - last);
    last = now;
    id = requestAnimationFrame(tick);
  });
  return {
    stop() {
      cancelAnimationFrame(id);
      const seconds = (performance.now() - start) / 1000;
      return `render: ${(frames / seconds).toFixed(0)} fps over ${seconds.toFixed(1)} s, slowest frame ${worst.toFixed(0)} ms`;
    },
  };
}

// A concept label's hover shows its catalog description, fetched once per concept (k=1: the
// route also asks a worker for the concept's top tokens, and one is enough).
async function describe(label) {
  const id = Number(label.dataset.conceptId);
  if (descriptions.has(id)) return;
  descriptions.set(id, "");
  try {
    const concept = await api.get(`/concepts/${id}?k=1`);
    descriptions.set(id, concept.description || "");
    label.title = titleOf(label.title, concept.description);
  } catch {
    descriptions.delete(id); // a later hover tries again
  }
}

// ---- wiring ----------------------------------------------------------------------------------
$("controls").addEventListener("submit", generate);
$("stop").addEventListener("click", () => controller?.abort());
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) generate(e);
});
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && controller) controller.abort();
});
$("concept_search").addEventListener("input", () => {
  clearTimeout(searchTimer);
  searchTimer = setTimeout(search, 150);
});
$("concept_search").addEventListener("keydown", (e) => {
  if (e.key === "Enter") {
    e.preventDefault(); // Enter here picks the first match instead of submitting the form
    $("concept_results").querySelector("button")?.click();
  }
});
$("strength").addEventListener("input", () => {
  $("strength_value").textContent = $("strength").value;
});
$("runs").addEventListener("mouseover", (e) => {
  const label = e.target.closest(".label[data-concept-id]");
  if (label) describe(label);
});
$("api_key").addEventListener("change", loadModel);
loadModel();
