// specmoe's page: a playground over the server's own /v1 API and a live view of the engine
// (/ui/events). Plain script, no framework, no build step. Streams are read with fetch()
// rather than EventSource so that both can send the API key.
"use strict";

const HISTORY = 240;  // points kept per chart: a minute at four events a second
const KEY_STORE = "specmoe-api-key";
const LEDGER_COLORS = ["#334155", "#94a3b8", "#60a5fa", "#f59e0b", "#a78bfa", "#f472b6", "#22d3ee"];

const $ = (id) => document.getElementById(id);
const state = {
  model: null,
  keyRequired: false,
  key: sessionStorage.getItem(KEY_STORE) || "",
  live: null,       // AbortController of the live stream
  request: null,    // AbortController of the answer being streamed
  chat: [],         // the conversation so far, in chat mode
  history: { tokens: [], running: [], waiting: [], transfer: [] },
  cells: [],        // the expert map's cells, block by block
  mapShape: "",
};

// --- formatting ----------------------------------------------------------------------------

function fmtBytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i === 0 || n >= 100 ? 0 : 1)} ${units[i]}`;
}
const fmtNum = (x, digits = 1) => (x === null || x === undefined ? "-" : x.toFixed(digits));
const fmtPct = (x) => (x === null || x === undefined ? "-" : `${Math.round(100 * x)} %`);

// --- talking to the server -----------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h.Authorization = `Bearer ${state.key}`;
  return h;
}

// The data lines of a server-sent event stream, as they arrive.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) if (line.startsWith("data: ")) yield line.slice(6);
    }
  }
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error ? body.error.message : `HTTP ${response.status}`;
  } catch (e) {
    return `HTTP ${response.status}`;
  }
}

// --- the API key ---------------------------------------------------------------------------

function forgetKey() {
  state.key = "";
  sessionStorage.removeItem(KEY_STORE);
}

function lock(message) {
  $("key-form").hidden = false;
  $("key-button").hidden = !state.keyRequired;
  $("key-message").textContent = message || "";
  setConnection("locked", "API key needed");
  $("live-message").textContent = "The live view needs the API key.";
  $("key-input").focus();
}

function unlocked() {
  return !state.keyRequired || Boolean(state.key);
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  state.key = $("key-input").value.trim();
  sessionStorage.setItem(KEY_STORE, state.key);
  $("key-message").textContent = "";
  $("key-form").hidden = true;
  connectLive();
});
$("key-button").addEventListener("click", () => lock(""));

// --- the live view -------------------------------------------------------------------------

function setConnection(kind, text) {
  $("connection").dataset.state = kind;
  $("connection").textContent = text;
}

async function connectLive() {
  if (state.live) state.live.abort();
  if (!unlocked()) { lock(""); return; }
  const controller = new AbortController();
  state.live = controller;
  try {
    const response = await fetch("/ui/events", { headers: headers(), signal: controller.signal });
    if (response.status === 401) {
      forgetKey();
      lock(`The server refused the key: ${await errorMessage(response)}`);
      return;
    }
    if (!response.ok) throw new Error(await errorMessage(response));
    setConnection("live", "live");
    $("live-message").textContent = "";
    for await (const data of sseData(response)) showEvent(JSON.parse(data));
    throw new Error("the server closed the live view");
  } catch (err) {
    if (controller.signal.aborted) return;
    setConnection("error", "reconnecting");
    $("live-message").textContent = `Live view interrupted (${err.message}); reconnecting.`;
    setTimeout(() => { if (state.live === controller) connectLive(); }, 2000);
  }
}

function push(series, value) {
  series.push(value);
  if (series.length > HISTORY) series.shift();
}

function showEvent(ev) {
  $("live-tokens-per-s").textContent = fmtNum(ev.tokens_per_s);
  $("live-running").textContent = ev.running;
  $("live-waiting").textContent = ev.waiting;
  $("live-tokens-per-step").textContent = fmtNum(ev.tokens_per_step, 2);
  $("live-acceptance").textContent = fmtPct(ev.acceptance_rate);
  $("live-transfer-rate").textContent = fmtBytes(ev.transfer_bytes_per_s);
  $("live-bytes-per-token").textContent = fmtBytes(ev.transfer_bytes_per_token);
  $("live-generated").textContent = ev.generated_tokens;
  $("live-requests").textContent = ev.requests;
  const h = state.history;
  push(h.tokens, ev.tokens_per_s);
  push(h.running, ev.running);
  push(h.waiting, ev.waiting);
  push(h.transfer, ev.transfer_bytes_per_s / 1e6);
  drawChart($("chart-tokens"), [[h.tokens, "--tokens"]]);
  drawChart($("chart-requests"), [[h.running, "--running"], [h.waiting, "--waiting"]]);
  drawChart($("chart-transfer"), [[h.transfer, "--transfer"]]);
  if (ev.engine) showEngine(ev.engine);
}

// A line chart of the last HISTORY values of each series, newest on the right.
function drawChart(canvas, series) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr)) { canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr); }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const top = Math.max(1e-9, ...series.flatMap(([values]) => values));
  const styles = getComputedStyle(document.documentElement);
  for (const [values, color] of series) {
    ctx.strokeStyle = styles.getPropertyValue(color);
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    values.forEach((v, i) => {
      const x = w - (values.length - 1 - i) * (w / (HISTORY - 1));
      const y = h - 4 - (v / top) * (h - 18);
      if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
  }
  ctx.fillStyle = styles.getPropertyValue("--muted");
  ctx.font = "10px system-ui, sans-serif";
  ctx.fillText(`max ${top >= 100 ? Math.round(top) : top.toPrecision(2)}`, 4, 11);
}

function showEngine(engine) {
  const parts = [`policy ${engine.policy}`];
  if (engine.gamma !== null) parts.push(`\u03b3 ${engine.gamma}`);
  if (engine.draft_experts !== null) parts.push(`${engine.draft_experts} draft experts/block`);
  if (engine.draft_quant && engine.draft_quant !== "none") parts.push(`draft: ${engine.draft_quant} copies of all experts`);
  if (engine.offload) parts.push(`offload: ${engine.offload}`);
  $("engine-summary").textContent = parts.join(" \u00b7 ");
  showMap(engine);
  showLedger(engine.memory);
}

function buildMap(engine) {
  const map = $("expert-map");
  map.replaceChildren();
  map.style.gridTemplateColumns = `auto repeat(${engine.experts}, minmax(0.6em, 1fr))`;
  state.cells = engine.blocks.map((layer) => {
    const label = document.createElement("span");
    label.className = "row-label";
    label.textContent = `block ${layer}`;
    map.append(label);
    return Array.from({ length: engine.experts }, (_, e) => {
      const cell = document.createElement("div");
      cell.className = "cell";
      cell.dataset.block = layer;
      cell.dataset.expert = e;
      map.append(cell);
      return cell;
    });
  });
  state.mapShape = `${engine.blocks.join(",")}x${engine.experts}`;
}

const STATE_WORDS = [[1, "draft expert"], [2, "in the device pool"], [4, "fetched in the last step"]];

function showMap(engine) {
  if (state.mapShape !== `${engine.blocks.join(",")}x${engine.experts}`) buildMap(engine);
  const top = Math.max(1, ...engine.load.flat());
  const counts = { draft: 0, device: 0, fetched: 0, offload: 0 };
  engine.state.forEach((row, b) => row.forEach((s, e) => {
    const cell = state.cells[b][e];
    const load = engine.load[b][e];
    if (cell.dataset.state !== String(s)) cell.dataset.state = s;
    cell.dataset.load = load;
    cell.style.setProperty("--load", (load / top).toFixed(3));
    const words = STATE_WORDS.filter(([bit]) => s & bit).map(([, w]) => w);
    cell.title = `block ${engine.blocks[b]}, expert ${e}: ${words.length ? words.join(", ") : "only in the offload tier"}; ` +
      `${load} tokens routed since the last update`;
    if (s & 1) counts.draft++;
    if (s & 2) counts.device++;
    if (s & 4) counts.fetched++;
    if (s === 0) counts.offload++;
  }));
  for (const [name, n] of Object.entries(counts)) $(`count-${name}`).textContent = n;
  const span = engine.load_window_s ? ` over ${engine.load_window_s.toFixed(2)} s` : "";
  $("map-caption").textContent = `${engine.blocks.length} MoE blocks \u00d7 ${engine.experts} experts; ` +
    `pool of ${engine.pool_slots ?? "all"} slots; load${span}`;
}

function showLedger(memory) {
  const items = Object.entries(memory.items).filter(([, n]) => n > 0);
  const whole = memory.limit ?? memory.used;
  const bar = $("ledger-bar");
  bar.replaceChildren();
  const body = $("ledger").tBodies[0];
  body.replaceChildren();
  items.forEach(([name, n], i) => {
    const color = LEDGER_COLORS[i % LEDGER_COLORS.length];
    const part = document.createElement("div");
    part.style.width = `${(100 * n) / whole}%`;
    part.style.background = color;
    part.title = `${name}: ${fmtBytes(n)}`;
    bar.append(part);
    addLedgerRow(body, name, n, whole, color);
  });
  if (memory.draft_experts_bytes) addLedgerRow(body, "of the pool: draft experts (pinned)", memory.draft_experts_bytes, whole, null);
  if (memory.limit !== null) addLedgerRow(body, "free", memory.limit - memory.used, whole, "#ffffff");
  $("ledger-caption").textContent = memory.limit === null
    ? `${fmtBytes(memory.used)} used (no --device-memory limit)`
    : `${fmtBytes(memory.used)} of ${fmtBytes(memory.limit)} (--device-memory) reserved; peak ${fmtBytes(memory.peak)}`;
}

function addLedgerRow(body, name, n, whole, color) {
  const row = body.insertRow();
  const swatch = document.createElement("span");
  swatch.className = "swatch";
  if (color) { swatch.style.background = color; swatch.style.border = "1px solid #cbd5e1"; }
  row.insertCell().append(swatch, name);
  const size = row.insertCell();
  size.className = "num";
  size.textContent = fmtBytes(n);
  const share = row.insertCell();
  share.className = "num";
  share.textContent = `${((100 * n) / whole).toFixed(1)} %`;
}

// --- the playground ------------------------------------------------------------------------

const mode = () => document.querySelector('input[name="mode"]:checked').value;

function numberField(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text);
}

function requestBody(prompt) {
  const body = {
    model: state.model, max_tokens: numberField("max-tokens"), temperature: numberField("temperature"),
    top_p: numberField("top-p"), top_k: numberField("top-k"), seed: numberField("seed"),
    stream: true, specmoe_stats: true,
  };
  if (mode() === "chat") body.messages = [...state.chat, { role: "user", content: prompt }];
  else body.prompt = prompt;
  return body;
}

function addExchange(prompt) {
  const box = document.createElement("div");
  box.className = "exchange";
  const asked = document.createElement("div");
  asked.className = "prompt";
  asked.textContent = prompt;
  const answer = document.createElement("div");
  answer.className = "answer";
  answer.dataset.state = "streaming";
  const text = document.createElement("span");
  text.className = "text";
  const stats = document.createElement("div");
  stats.className = "answer-stats";
  answer.append(text, stats);
  if (mode() === "chat") {
    const who = (role) => Object.assign(document.createElement("div"), { className: "role", textContent: role });
    box.append(who("user"), asked, who("assistant"), answer);
  } else {
    box.append(asked, answer);
  }
  $("transcript").append(box);
  return { answer, text, stats };
}

function describeStats(s) {
  const parts = [
    `${fmtNum(s.decode_tokens_per_s)} tokens/s`,
    `${fmtNum(s.tokens_per_step, 2)} tokens/step`,
    s.drafted ? `acceptance ${fmtPct(s.acceptance_rate)}` : "no drafts",
    `${fmtBytes(s.transfer_bytes_per_token)} moved/token`,
    `policy ${s.policy}`,
    `${s.completion_tokens} tokens in ${s.steps} steps`,
  ];
  return parts.join(" \u00b7 ");
}

async function send(prompt) {
  const kind = mode();
  const view = addExchange(prompt);
  const controller = new AbortController();
  state.request = controller;
  $("send").disabled = true;
  $("stop").disabled = false;
  let reply = "";
  try {
    const url = kind === "chat" ? "/v1/chat/completions" : "/v1/completions";
    const response = await fetch(url, { method: "POST", headers: headers(), body: JSON.stringify(requestBody(prompt)),
      signal: controller.signal });
    if (response.status === 401) { forgetKey(); lock("The server refused the key."); }
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices && chunk.choices[0];
      const piece = choice ? (kind === "chat" ? choice.delta.content : choice.text) : "";
      if (piece) { reply += piece; view.text.textContent = reply; }
      if (chunk.specmoe_stats) view.stats.textContent = describeStats(chunk.specmoe_stats);
    }
    if (kind === "chat") state.chat.push({ role: "user", content: prompt }, { role: "assistant", content: reply });
    view.answer.dataset.state = "done";
  } catch (err) {
    view.answer.dataset.state = controller.signal.aborted ? "stopped" : "error";
    view.stats.textContent = controller.signal.aborted ? "stopped" : err.message;
  } finally {
    state.request = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    view.answer.scrollIntoView({ block: "nearest" });
  }
}

$("prompt-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const prompt = $("prompt").value;
  $("prompt-error").textContent = "";
  if (!unlocked()) {
    $("prompt-error").textContent = "Enter the server's API key first.";
    lock("");
    return;
  }
  if (!prompt.trim()) { $("prompt-error").textContent = "Write a prompt first."; return; }
  send(prompt);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) $("prompt-form").requestSubmit();
});
$("stop").addEventListener("click", () => state.request && state.request.abort());
$("clear").addEventListener("click", () => { state.chat = []; $("transcript").replaceChildren(); });
document.querySelectorAll('input[name="mode"]').forEach((radio) => radio.addEventListener("change", () => {
  state.chat = [];
  $("prompt").placeholder = mode() === "chat" ? "A message (Ctrl+Enter sends)" : "A prompt to continue (Ctrl+Enter sends)";
}));

// --- start ---------------------------------------------------------------------------------

async function start() {
  const info = await (await fetch("/ui/info")).json();
  state.model = info.model;
  state.keyRequired = info.api_key_required;
  $("model").textContent = info.model;
  $("key-button").hidden = !state.keyRequired;
  connectLive();
}

start();
