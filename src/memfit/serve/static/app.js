// memfit serve's page: the inputs (kept in the URL), the plan's progress, its table, the shown setup's memory
// (a stacked bar against the card, a line over the traced steps) and what to run. Plain DOM and SVG.
"use strict";

const COLORS = {
  parameters: "#2358c4", frozen_parameters: "#7f9fdc", quantized_weights: "#4c7bd9", gradients: "#e0792b",
  optimizer_state: "#c0392b", kahan_compensation: "#8e44ad", activations: "#27ae60", logits_and_loss: "#16a085",
  temporaries: "#f1c40f", inputs: "#95a5a6", workspaces: "#7f8c8d", allocator_reserve: "#bdc3c7",
  non_pytorch: "#34495e",
};
const NAMES = {
  parameters: "parameters", frozen_parameters: "frozen parameters", quantized_weights: "4-bit weights",
  gradients: "gradients", optimizer_state: "optimizer state", kahan_compensation: "Kahan compensation",
  activations: "activations", logits_and_loss: "logits and loss", temporaries: "temporaries", inputs: "inputs",
  workspaces: "workspaces", allocator_reserve: "allocator reserve", non_pytorch: "outside PyTorch (CUDA context; NCCL on several GPUs)",
};
const PHASE_COLORS = { forward: "#e8f5e9", backward: "#fff3e0", optimizer: "#fde7e9", other: "#f4f5f7" };
const SVG = "http://www.w3.org/2000/svg";
const form = document.getElementById("inputs");
let current = null;     // the job being followed
let generation = 0;     // plans asked for so far: a job asked for by an older one is cancelled on arrival
let pending = null;     // a planned re-plan after an input changed
let defaults = {};
let extra = new URLSearchParams();  // inputs of the link with no field on the page (margin, lora-rank, ...): kept

function formatBytes(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes, unit = 0;
  while (Math.abs(value) >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return unit === 0 ? `${value} B` : `${value.toFixed(1)} ${units[unit]}`;
}

function el(tag, attributes = {}, text = "") {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  if (text) node.textContent = text;
  return node;
}

function svg(tag, attributes = {}, text = "") {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  if (text) node.textContent = text;
  return node;
}

function show(id, visible) { document.getElementById(id).hidden = !visible; }

// --- the inputs ---------------------------------------------------------------------------------------------
function query() {
  const params = new URLSearchParams(extra);
  for (const element of form.elements) {
    if (!element.name) continue;
    if (element.type === "checkbox") { if (element.checked) params.set(element.name, "1"); }
    else if (element.value.trim() !== "" && !(element.name === "precision" && element.value === "auto")
             && !(element.name === "task" && element.value === "auto")) params.set(element.name, element.value.trim());
  }
  return params;
}

function fillFrom(params) {
  const fields = new Set();
  for (const element of form.elements) {
    if (!element.name) continue;
    fields.add(element.name);
    if (element.type === "checkbox") element.checked = ["1", "true", "yes", "on", ""].includes(params.get(element.name));
    else if (params.has(element.name)) {
      const value = params.get(element.name);
      if (element.tagName === "SELECT" && ![...element.options].some((option) => option.value === value)) {
        element.append(el("option", { value }, value));  // a value the page does not list: kept, the server checks it
      }
      element.value = value;
    }
  }
  extra = new URLSearchParams([...params].filter(([name]) => !fields.has(name)));
}

async function read(answer) {
  // a JSON answer, or the error it carries as one line
  let body = null;
  try { body = await answer.json(); } catch { body = null; }
  if (!answer.ok) throw new Error(body?.error ?? `memfit: error: the server answered ${answer.status}`);
  return body;
}

async function loadOptions() {
  const options = await read(await fetch("/api/options"));
  defaults = options.defaults;
  const models = document.getElementById("models");
  for (const name of [...options.presets, ...options.cached]) models.append(el("option", { value: name }));
  const task = form.elements.task, device = form.elements.device, precision = form.elements.precision;
  for (const name of options.tasks) task.append(el("option", { value: name }, name));
  for (const profile of options.profiles) {
    device.append(el("option", { value: profile.name },
      `${profile.name}: ${profile.description} (${formatBytes(profile.memory_bytes)})`));
  }
  for (const name of options.precisions) precision.append(el("option", { value: name }, name));
  const optIns = document.getElementById("opt-ins");
  for (const item of options.opt_ins) {
    const label = el("label", { title: `--${item.key}` });
    const help = item.help.replace(/^opt-in[:,] ?/, "");
    label.append(el("input", { type: "checkbox", name: item.key }), el("code", {}, item.key.replace(/^allow-/, "")),
                 document.createTextNode(help));
    optIns.append(label);
  }
  form.elements.model.placeholder = `preset, model directory or org/name (${defaults.model})`;
  form.elements["seq-len"].placeholder = defaults["seq-len"];
  form.elements["effective-batch"].placeholder = defaults["effective-batch"];
  device.value = defaults.device;
}

// --- the plan -----------------------------------------------------------------------------------------------
async function cancelCurrent() {
  if (current === null) return;
  const id = current;
  current = null;
  await fetch(`/api/jobs/${id}`, { method: "DELETE" }).catch(() => {});
}

async function plan() {
  clearTimeout(pending);
  const mine = ++generation;
  await cancelCurrent();
  const params = query();
  history.replaceState(null, "", `?${params}`);
  const share = document.getElementById("share"), json = document.getElementById("json");
  share.href = `?${params}`; json.href = `/api/plan?${params}`;
  share.hidden = json.hidden = false;
  show("error", false);
  delete document.body.dataset.state;
  for (const id of ["verdict", "memory", "plan-table", "run"]) document.getElementById(id).classList.add("stale");
  let job;
  try {
    job = await read(await fetch(`/api/jobs?${params}`, { method: "POST" }));
  } catch (error) {
    if (mine === generation) fail(error.message);
    return;
  }
  if (mine !== generation) {  // the inputs changed while it was being asked for
    fetch(`/api/jobs/${job.id}`, { method: "DELETE" }).catch(() => {});
    return;
  }
  current = job.id;
  show("status", true);
  follow(job.id).catch((error) => { if (current === job.id) { current = null; fail(error.message); } });
}

async function follow(id) {
  let planShown = false;
  while (current === id) {
    const job = await read(await fetch(`/api/jobs/${id}`));
    if (current !== id) return;
    progress(job);
    if (job.plan && !planShown) { renderPlan(job.plan); planShown = true; }
    if (["done", "failed", "cancelled"].includes(job.state)) {
      current = null;
      show("status", false);
      if (job.memory) renderMemory(job.memory);
      else { show("memory", false); show("run", false); }
      if (!job.plan) { show("verdict", false); show("plan-table", false); }
      if (job.state === "failed") fail(job.error);
      document.body.dataset.state = job.state;
      return;
    }
    await new Promise((resolve) => setTimeout(resolve, 400));
  }
}

function progress(job) {
  const text = document.getElementById("status-text");
  if (job.state === "queued") text.textContent = "waiting for the plans before it…";
  else if (job.state === "planned") text.textContent = `planned from ${job.traces} traces; tracing the setup's memory…`;
  else {
    const techniques = job.techniques.length ? ` (${job.techniques.join(", ")})` : "";
    text.textContent = `planning: ${job.traces} traces${techniques}, ${job.seconds.toFixed(1)} s`;
  }
}

function fail(message) {
  const error = document.getElementById("error");
  error.textContent = message;
  show("error", true);
  show("status", false);
}

function renderPlan(made) {
  const verdict = document.getElementById("verdict");
  verdict.textContent = made.verdict;
  verdict.className = made.chosen ? "" : "nothing";
  show("verdict", true);
  const body = document.querySelector("#candidates tbody");
  body.replaceChildren();
  const chosen = made.chosen ? JSON.stringify(made.chosen) : null;
  made.candidates.forEach((candidate, index) => {
    const row = el("tr");
    if (JSON.stringify(candidate) === chosen) row.className = "chosen";
    const strategy = candidate.shard_group ? `hsdp (groups of ${candidate.shard_group})` : candidate.distributed;
    const ranks = candidate.world_size > 1 ? `${strategy}: ` : "";
    const optimizer = candidate.optimizer + (candidate.offload_optimizer ? " on the host" : "")
      + (candidate.freeze !== "none" ? `, freeze ${candidate.freeze}` : "")
      + (candidate.lora_rank ? `, ${candidate.quantize_base !== "none" ? "QLoRA" : "LoRA"} r=${candidate.lora_rank}` : "")
      + (candidate.reduce_every_micro_step ? ", gradients reduced every micro-step" : "");
    const fits = candidate.fits === null ? "–" : candidate.fits ? "yes" : "no";
    const peak = candidate.predicted_peak_bytes === null ? "–"
      : (candidate.exact ? "" : "~") + formatBytes(candidate.predicted_peak_bytes);
    const speed = candidate.relative_speed === null ? "–" : `${candidate.relative_speed.toFixed(2)}x`;
    const cells = [[String(index + 1), "num"], [`${ranks}${candidate.micro_batch_size} × ${candidate.accumulation_steps}`, ""],
      [candidate.precision, ""], [candidate.checkpointing + (candidate.loss_chunk ? `, loss/${candidate.loss_chunk}` : ""), ""],
      [optimizer, ""], [fits, fits], [peak, "num"], [candidate.predicted_samples_per_second.toFixed(1), "num"],
      [speed, "num"], [candidate.reason, ""]];
    for (const [text, kind] of cells) row.append(el("td", kind ? { class: kind } : {}, text));
    body.append(row);
  });
  show("plan-table", true);
  document.getElementById("plan-table").classList.remove("stale");
  verdict.classList.remove("stale");
}

// --- the memory ---------------------------------------------------------------------------------------------
function renderMemory(memory) {
  document.getElementById("which").textContent = memory.which === "chosen" ? "chosen" : "least-need";
  document.getElementById("setup").textContent =
    `${memory.setup}: ${formatBytes(memory.predicted_peak_bytes)} at its peak (in ${memory.peak_phase}), ` +
    `budget ${formatBytes(memory.budget_bytes)} (${formatBytes(memory.usable_bytes)} usable); ${memory.trace}`;
  drawBreakdown(memory);
  drawTimeline(memory);
  show("memory", true);
  document.getElementById("memory").classList.remove("stale");
  const run = memory.train_command !== null;
  if (run) {
    document.getElementById("train-command").textContent =
      `${memory.train_command}\n# add --data FILE (and --output-dir DIR) to train on your own data`;
    document.getElementById("trainer").textContent = memory.trainer ?? "(no Trainer setting runs this setup)";
    const notes = document.getElementById("notes");
    notes.replaceChildren(...memory.trainer_notes.map((line) => el("li", {}, line)));
  }
  show("run", run);
  document.getElementById("run").classList.remove("stale");
}

function drawBreakdown(memory) {
  const chart = document.getElementById("breakdown");
  const width = 1000, height = 90, left = 10, right = 10, top = 22, bar = 36;
  chart.setAttribute("viewBox", `0 0 ${width} ${height}`);
  chart.replaceChildren();
  const total = Math.max(memory.predicted_peak_bytes, memory.budget_bytes) * 1.04;
  const scale = (bytes) => left + (bytes / total) * (width - left - right);
  let at = 0;
  const legend = document.getElementById("legend");
  legend.replaceChildren();
  for (const [name, bytes] of Object.entries(memory.breakdown)) {
    if (bytes <= 0) continue;
    const rect = svg("rect", { x: scale(at), y: top, width: Math.max(0.5, scale(at + bytes) - scale(at)), height: bar,
      fill: COLORS[name] ?? "#999", "data-part": name });
    rect.append(svg("title", {}, `${NAMES[name] ?? name}: ${formatBytes(bytes)}`));
    chart.append(rect);
    at += bytes;
    const item = el("li");
    const swatch = el("span");
    swatch.style.background = COLORS[name] ?? "#999";
    item.append(swatch, document.createTextNode(`${NAMES[name] ?? name} ${formatBytes(bytes)}`));
    legend.append(item);
  }
  for (const [bytes, label, dash] of [[memory.budget_bytes, `card ${formatBytes(memory.budget_bytes)}`, ""],
                                      [memory.usable_bytes, `usable ${formatBytes(memory.usable_bytes)}`, "4 3"]]) {
    const x = scale(bytes);
    chart.append(svg("line", { x1: x, x2: x, y1: 12, y2: top + bar + 8, stroke: "#b3261e", "stroke-width": 2,
      "stroke-dasharray": dash }));
    chart.append(svg("text", { x: x - 4, y: dash ? height - 6 : 11, "text-anchor": "end", "font-size": 11,
      fill: "#b3261e" }, label));
  }
}

function drawTimeline(memory) {
  const chart = document.getElementById("timeline");
  const width = 1000, height = 260, left = 70, right = 10, top = 14, bottom = 28;
  chart.setAttribute("viewBox", `0 0 ${width} ${height}`);
  chart.replaceChildren();
  const points = memory.timeline.bytes;
  const room = memory.usable_bytes - memory.breakdown.non_pytorch;  // what the allocator may hold
  const peak = Math.max(...points);
  const high = (room <= peak * 4 ? Math.max(peak, room) : peak) * 1.08;  // a far budget would flatten the line
  const x = (index) => left + (index / Math.max(1, points.length - 1)) * (width - left - right);
  const y = (bytes) => top + (1 - bytes / high) * (height - top - bottom);
  for (const phase of memory.timeline.phases) {
    const band = svg("rect", { x: x(phase.start), y: top, width: Math.max(0.5, x(phase.end - 1) - x(phase.start)),
      height: height - top - bottom, fill: PHASE_COLORS[phase.name] ?? PHASE_COLORS.other, "data-phase": phase.name });
    band.append(svg("title", {}, phase.name));
    chart.append(band);
  }
  for (let step = 0; step <= 4; step += 1) {
    const bytes = (high / 4) * step;
    chart.append(svg("text", { x: left - 6, y: y(bytes) + 4, "text-anchor": "end", "font-size": 11, fill: "#5b6475" },
      formatBytes(bytes)));
  }
  const line = points.map((bytes, index) => `${x(index).toFixed(1)},${y(bytes).toFixed(1)}`).join(" ");
  chart.append(svg("polyline", { points: line, fill: "none", stroke: "#2358c4", "stroke-width": 1.5 }));
  const label = `usable less what is outside PyTorch: ${formatBytes(room)}`;
  if (room <= high) {
    chart.append(svg("line", { x1: left, x2: width - right, y1: y(room), y2: y(room), stroke: "#b3261e",
      "stroke-dasharray": "4 3" }));
  }
  chart.append(svg("text", { x: width - right - 4, y: room <= high ? y(room) - 4 : top + 10, "text-anchor": "end",
    "font-size": 11, fill: "#b3261e" }, room <= high ? label : `${label} (far above)`));
  const names = [...new Set(memory.timeline.phases.map((phase) => phase.name))];
  names.forEach((name, index) => {
    chart.append(svg("rect", { x: left + index * 110, y: height - 18, width: 10, height: 10,
      fill: PHASE_COLORS[name] ?? PHASE_COLORS.other, stroke: "#999" }));
    chart.append(svg("text", { x: left + index * 110 + 14, y: height - 9, "font-size": 11 }, name));
  });
  document.getElementById("timeline-note").textContent =
    `Allocated bytes after each of ${memory.timeline.events.toLocaleString()} allocations and frees of the ` +
    `traced steps (the first creates the optimizer's state), peak ${formatBytes(memory.timeline.peak_bytes)}; ` +
    "the allocator's reserve and what is outside PyTorch (the CUDA context, NCCL's buffers) come on top.";
}

// --- wiring -------------------------------------------------------------------------------------------------
form.addEventListener("submit", (event) => { event.preventDefault(); plan(); });
form.addEventListener("input", () => {  // inputs changed: the running plan is for other inputs
  generation += 1;
  cancelCurrent();
  for (const id of ["verdict", "memory", "plan-table", "run"]) document.getElementById(id).classList.add("stale");
  show("status", false);
  clearTimeout(pending);
  if (form.elements.model.value.trim()) pending = setTimeout(plan, 900);
});

loadOptions().then(() => {
  const params = new URLSearchParams(location.search);
  fillFrom(params);
  if (params.has("model")) plan();
}).catch((error) => fail(error.message));
