// One generation on screen: a row of 64 cells per diffusion block (mask cells that fill in as the
// step events commit tokens, out of order), a concept panel beside each block that builds up
// with the block and freezes when it completes, and the final text. Events only queue work;
// the DOM changes once per animation frame, however many events arrived in between.

const BLOCK = 64;
// Why the ε share can be negative: it is the residual's signed share of the mass of the
// token's logit (the API's epsilon_pct, a mean over the chunk): below zero, the concepts
// together overshoot the logit and the residual pulls it back.
const EPSILON_HELP =
  "ε share: the part of the token's logit that the listed concept heads do not explain (the residual), " +
  "as a signed share of the attribution mass, averaged over the block. Negative: the concepts together " +
  "push the logit past its value and the residual pulls it back.";

export class RunView {
  constructor(root, title, maxTokens, chat) {
    this.root = root;
    this.maxTokens = maxTokens;
    this.chat = chat; // the prompt went through the chat template (the run may fall back: see playground.js)
    this.blocks = new Map(); // block index -> Block
    this.completed = 0; // block events seen: the next one completes block `completed`
    this.pending = [];
    this.dirty = new Set();
    this.frame = 0;
    root.querySelector("h2").textContent = title;
    this.blocksEl = root.querySelector(".blocks");
    this.textEl = root.querySelector(".final-text");
    // Input attribution: completion offset -> the token's inputs; prompt position -> its input.
    this.inputs = new Map();
    this.promptTokens = new Map();
    this.promptView = root.querySelector(".prompt-view");
    this.promptEl = root.querySelector(".prompt-tokens");
    this.selected = null;
    this.blocksEl.addEventListener("click", (e) => {
      const cell = e.target.closest(".cell.tok");
      if (cell) this.select(Number(cell.dataset.offset));
    });
  }

  addInputs(inputs) {
    let grew = false;
    for (const t of inputs?.tokens || []) {
      this.inputs.set(t.offset, t);
      for (const i of t.inputs) {
        if (!this.promptTokens.has(i.position)) {
          this.promptTokens.set(i.position, i);
          grew = true;
        }
      }
    }
    if (grew) this.renderPrompt();
  }

  // In chat the positions are the templated prompt's, and the page shows all of it, not only the
  // user's words: the template's own tokens (the turn headers, the blank line that opens the
  // answer) often carry the largest contributions, and the shades are relative to the largest.
  // Its special tokens have no text; each shows as a marker that names its id on hover. A token of
  // line breaks (the template's blank lines) shows them as ↵ before breaking, so it can be shaded.
  renderPrompt() {
    const spans = [...this.promptTokens].sort((a, b) => a[0] - b[0]).map(([position, input]) => {
      const span = document.createElement("span");
      span.className = input.text ? "ptok" : "ptok special";
      span.dataset.position = position;
      span.textContent = shownInput(input.text);
      span.dataset.label = input.text ? `position ${position}` : `template token ${input.token_id} · position ${position}`;
      span.title = span.dataset.label;
      return span;
    });
    this.promptView.querySelector("h3").firstChild.textContent = this.chat ? "Prompt, as the chat template wraps it " : "Prompt ";
    this.promptEl.replaceChildren(...spans);
    this.promptView.hidden = false;
    if (this.selected !== null) this.select(this.selected);
  }

  // Shade the prompt by the input attribution of the generated token at `offset`.
  select(offset) {
    const token = this.inputs.get(offset);
    if (!token) return;
    this.selected = offset;
    for (const cell of this.blocksEl.querySelectorAll(".cell.selected")) cell.classList.remove("selected");
    this.blocksEl.querySelector(`.cell[data-offset="${offset}"]`)?.classList.add("selected");
    const by = new Map(token.inputs.map((i) => [i.position, i.contribution]));
    const top = Math.max(...token.inputs.map((i) => Math.abs(i.contribution)), 1e-12);
    for (const span of this.promptEl.children) {
      const c = by.get(Number(span.dataset.position)) ?? 0;
      const shade = Math.abs(c) / top;
      span.dataset.contribution = c;
      span.dataset.shade = shade.toFixed(3);
      span.style.backgroundColor = c < 0 ? `rgba(209, 73, 63, ${shade})` : `rgba(47, 111, 223, ${shade})`;
      span.title = `${span.dataset.label} · contribution ${c.toExponential(2)}`;
    }
    this.promptView.querySelector("h3 .muted").textContent =
      `shaded by the input attribution of ${JSON.stringify(token.text)} (offset ${offset}): blue raises its logit, red lowers it`;
  }

  push(kind, choice) {
    this.pending.push([kind, choice]);
    if (!this.frame) this.frame = requestAnimationFrame(() => this.flush());
  }

  flush() {
    this.frame = 0;
    for (const [kind, c] of this.pending.splice(0)) {
      if (kind === "step") this.step(c);
      else if (c.finish_reason) this.finish(c);
      else this.blockDone(c);
    }
    for (const block of this.dirty) block.renderPanel();
    this.dirty.clear();
  }

  block(index, offset) {
    let block = this.blocks.get(index);
    if (!block) {
      block = new Block(index, offset, this.maxTokens);
      this.blocks.set(index, block);
      this.blocksEl.append(block.el);
    }
    return block;
  }

  step(c) {
    const block = this.block(c.block, c.block_offset);
    c.offsets.forEach((offset, i) => block.land(offset, c.tokens[i], c.token_ids[i], c.step));
    block.step = c.step;
    if (c.attribution) block.chunk = c.attribution.chunk;
    this.dirty.add(block);
  }

  blockDone(c) {
    const block = this.blocks.get(this.completed++);
    this.textEl.textContent += c.text;
    this.addInputs(c.attribution?.inputs);
    if (!block) return; // a block without step events: stream_denoise was off
    block.complete(c.token_ids.length);
    this.dirty.add(block);
  }

  finish(c) {
    this.textEl.textContent += c.text;
    this.addInputs(c.attribution?.inputs);
    for (const chunk of c.attribution?.chunks || []) {
      const block = [...this.blocks.values()].find((b) => b.offset <= chunk.start && chunk.start < b.offset + BLOCK);
      if (block) {
        block.chunk = chunk;
        this.dirty.add(block);
      }
    }
    this.root.classList.add("done");
  }
}

class Block {
  constructor(index, offset, maxTokens) {
    this.index = index;
    this.offset = offset; // completion offset of cell 0 (negative: the prompt's tail)
    this.landed = [];
    this.chunk = null;
    this.frozen = false;
    this.step = 0;
    this.el = document.createElement("div");
    this.el.className = "block";
    this.el.dataset.block = index;
    this.head = document.createElement("div");
    this.head.className = "block-head";
    const grid = document.createElement("div");
    grid.className = "cells";
    this.cells = [];
    this.expected = 0;
    for (let i = 0; i < BLOCK; i++) {
      const cell = document.createElement("span");
      const at = offset + i;
      cell.className = at < 0 ? "cell prompt" : at >= maxTokens ? "cell unused" : "cell mask";
      this.expected += cell.className === "cell mask";
      this.cells.push(cell);
      grid.append(cell);
    }
    this.panel = document.createElement("aside");
    this.panel.className = "concepts";
    this.panel.setAttribute("aria-label", `concepts of block ${index}`);
    this.el.append(this.head, grid, this.panel);
  }

  land(offset, text, tokenId, step) {
    const cell = this.cells[offset - this.offset];
    cell.textContent = visible(text);
    cell.title = `${JSON.stringify(text)} · token ${tokenId} · step ${step}`;
    cell.className = "cell tok fresh";
    cell.dataset.offset = offset;
    this.landed.push(offset);
  }

  complete(kept) {
    // The block's kept tokens are its first `kept` landed cells in position order; anything
    // after an end-of-turn or a stop string was dropped by the server.
    const order = [...this.landed].sort((a, b) => a - b);
    for (const offset of order.slice(kept)) this.cells[offset - this.offset].className = "cell dropped";
    for (const cell of this.cells) if (cell.classList.contains("mask")) cell.className = "cell unused";
    this.frozen = true;
  }

  renderPanel() {
    const state = this.frozen ? "final" : `building ${this.landed.length}/${this.expected}`;
    this.head.textContent = `block ${this.index} · step ${this.step} · ${state}`;
    this.el.classList.toggle("frozen", this.frozen);
    if (!this.chunk) {
      this.panel.replaceChildren(note("attribution off"));
      return;
    }
    const top = Math.max(...this.chunk.concepts.map((c) => Math.abs(c.contribution)), 1e-12);
    const list = document.createElement("ol");
    for (const c of this.chunk.concepts) list.append(conceptRow(c, top));
    const eps = document.createElement("div");
    eps.className = "eps";
    eps.title = EPSILON_HELP;
    eps.innerHTML = `<span>ε share</span><span class="bar"><span></span></span><span class="val"></span>`;
    const bar = eps.querySelector(".bar span");
    bar.style.width = `${Math.min(Math.abs(this.chunk.epsilon_pct), 100)}%`;
    bar.className = this.chunk.epsilon_pct < 0 ? "neg" : "";
    eps.querySelector(".val").textContent = `${this.chunk.epsilon_pct.toFixed(1)}%`;
    this.panel.replaceChildren(note(this.frozen ? "chunk concepts (final)" : "chunk concepts (so far)"), list, eps);
  }
}

function conceptRow(c, top) {
  const li = document.createElement("li");
  li.className = `concept ${c.type}`;
  li.innerHTML = `<span class="badge"></span><span class="label"></span><span class="bar"><span></span></span><span class="val"></span>`;
  li.querySelector(".badge").textContent = c.type === "known" ? "K" : "D";
  li.querySelector(".badge").title = c.type;
  // The badge says known or discovered, so the label drops the API's "Known: " / "Discovered: "
  // prefix; it wraps rather than being cut, and the hover shows it whole with the description.
  const label = li.querySelector(".label");
  label.textContent = c.label.replace(/^(Known|Discovered): /, "");
  label.title = titleOf(c.label, descriptions.get(c.id));
  if (c.type === "known") label.dataset.conceptId = c.id;
  const bar = li.querySelector(".bar span");
  bar.style.width = `${(100 * Math.abs(c.contribution)) / top}%`;
  bar.className = c.contribution < 0 ? "neg" : "pos";
  li.querySelector(".val").textContent = c.contribution.toExponential(2);
  return li;
}

// Known concept id -> its catalog description, filled by the page on a label's first hover.
export const descriptions = new Map();

export function titleOf(label, description) {
  return description ? `${label}\n${description}` : label;
}

function note(text) {
  const p = document.createElement("p");
  p.className = "muted";
  p.textContent = text;
  return p;
}

function shownInput(text) {
  if (!text) return "◆";
  return /^\n+$/.test(text) ? `${"↵".repeat(text.length)}\n` : text;
}

function visible(text) {
  return text.replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/ /g, "·");
}
