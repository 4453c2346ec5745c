// The playground: chat on a session, and what the K/V cache did for each turn, measured.
import { call, metrics, state, streamChat } from "./api.js";

const $ = (id) => document.getElementById(id);
const TIERS = ["device", "host", "disk", "shared"];
let stored = {}; // this key's sessions made here: id -> {model, system, turns, made (ms)}
let current = null; // the session id chatting now
let running = null; // the AbortController of the turn streaming now
let busy = false; // a turn is being sent (set before its first await: a double Enter sends one)

// Sessions belong to a tenant: each key keeps its own list in this browser.
function place() {
  let hash = 0;
  for (const c of state.key) hash = (hash * 31 + c.charCodeAt(0)) >>> 0;
  return `kvserve-sessions:${state.key ? hash.toString(16) : "no-key"}`;
}

function load() {
  stored = JSON.parse(localStorage.getItem(place()) || "{}");
}

function save() {
  localStorage.setItem(place(), JSON.stringify(stored));
}

function status(text, isError = false) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
}

function element(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "onclick") node.onclick = value;
    else if (name === "disabled") node.disabled = Boolean(value);
    else if (name === "style") node.style.cssText = value; // CSSOM: the page's CSP refuses style attributes
    else node.setAttribute(name, value);
  }
  node.append(...children);
  return node;
}

// The messages a turn sends: the system prompt, every earlier completed turn, then its own user message.
function conversation(session, upto) {
  const messages = session.system ? [{ role: "system", content: session.system }] : [];
  for (const turn of session.turns.slice(0, upto)) {
    messages.push({ role: "user", content: turn.user }, { role: "assistant", content: turn.assistant });
  }
  return messages;
}

function settings(session) {
  const model = session?.model || $("model").value; // a session answers with its own model only
  return { model, temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value) };
}

async function newSession() {
  const body = { model: $("model").value };
  if ($("system").value.trim()) body.system = $("system").value.trim();
  const made = await call("POST", "/v1/sessions", body);
  stored[made.id] = { model: made.model, system: body.system || "", turns: [], made: Date.now() };
  save();
  select(made.id);
  await refresh();
}

function select(id) {
  current = id;
  $("session-name").textContent = id ? `session ${id}` : "no session: make one";
  if (id && stored[id]) $("model").value = stored[id].model;
  renderTurns();
}

async function send(event) {
  event.preventDefault();
  const text = $("message").value.trim();
  if (!text || busy) return;
  busy = true;
  try {
    if (!current || !stored[current]) await newSession();
    await turn(text, current);
  } finally {
    busy = false;
  }
}

async function turn(text, id) {
  const session = stored[id];
  const messages = [...conversation(session, session.turns.length), { role: "user", content: text }];
  const live = { user: text, assistant: "", status: "streaming" };
  session.turns.push(live);
  renderTurns();
  running = new AbortController();
  $("stop").disabled = false;
  $("message").value = "";
  try {
    const done = await streamChat({ ...settings(session), messages }, {
      signal: running.signal, sessionId: id, onText: (reply) => { live.assistant = reply; renderLive(live); },
    });
    Object.assign(live, { assistant: done.text, status: "done", stats: stats(done) });
    status(`turn ${session.turns.length}: ${live.stats.cached} of ${live.stats.prompt} prompt tokens from the cache`);
  } catch (error) {
    session.turns.pop(); // a stopped or failed turn did not happen: the session is as before it
    status(error.name === "AbortError" ? "stopped: the turn was not recorded" : error.message, error.name !== "AbortError");
    $("turns").dataset.stopped = String(error.name === "AbortError");
  } finally {
    running = null;
    $("stop").disabled = true;
    save();
    renderTurns();
    refresh();
  }
}

function stats(turn) {
  const usage = turn.usage || { prompt_tokens: 0, completion_tokens: 0, prompt_tokens_details: { cached_tokens: 0 } };
  const decodeMs = turn.endMs - turn.firstMs;
  return {
    ttft: Math.round(turn.firstMs),
    tps: usage.completion_tokens > 1 && decodeMs > 0 ? (usage.completion_tokens - 1) / (decodeMs / 1000) : null,
    prompt: usage.prompt_tokens,
    cached: usage.prompt_tokens_details.cached_tokens,
    source: turn.source,
    completion: usage.completion_tokens,
  };
}

// The same turn's prompt again, with no cache at all (cache_prompt: false, no session): what it costs unsaved.
async function recompute(index) {
  const session = stored[current];
  const turn = session.turns[index];
  const messages = [...conversation(session, index), { role: "user", content: turn.user }];
  status(`turn ${index + 1}: recomputing its prompt without the cache...`);
  const again = await streamChat({ ...settings(session), messages, max_tokens: 1, cache_prompt: false }, {});
  turn.nocache = { ttft: Math.round(again.firstMs), cached: again.usage.prompt_tokens_details.cached_tokens };
  save();
  renderTurns();
  status(`turn ${index + 1}: ${turn.stats.ttft} ms with the cache, ${turn.nocache.ttft} ms without`);
}

async function fork(index) {
  const made = await call("POST", `/v1/sessions/${current}/fork`, { turn: index + 1 });
  const parent = stored[current];
  const turns = structuredClone(parent.turns.slice(0, index + 1));
  stored[made.id] = { model: parent.model, system: parent.system, turns, made: Date.now() };
  save();
  select(made.id);
  status(`forked after turn ${index + 1}: ${made.id}`);
  await refresh();
}

async function rewind(index) {
  await call("POST", `/v1/sessions/${current}/rewind`, { turn: index + 1 });
  stored[current].turns = stored[current].turns.slice(0, index + 1);
  save();
  renderTurns();
  await refresh();
}

async function remove(id) {
  await call("DELETE", `/v1/sessions/${id}`);
  delete stored[id];
  save();
  if (current === id) select(null);
  await refresh();
}

function renderLive(turn) {
  const last = $("turns").lastElementChild;
  if (last) last.querySelector(".assistant").textContent = turn.assistant;
}

function bar(stats) {
  const holder = element("div", { class: "bar", "data-testid": "turn-bar", "data-cached": stats.cached, "data-computed": stats.prompt - stats.cached, "data-source": stats.source });
  const total = Math.max(stats.prompt, 1);
  if (stats.cached) holder.append(element("span", { class: `cached ${stats.source}`, style: `width:${(100 * stats.cached) / total}%`, title: `${stats.cached} cached (${stats.source})` }));
  holder.append(element("span", { class: "computed", style: `width:${(100 * (stats.prompt - stats.cached)) / total}%`, title: `${stats.prompt - stats.cached} computed` }));
  return holder;
}

function renderTurns() {
  const list = $("turns");
  list.replaceChildren();
  const session = stored[current];
  for (const [index, turn] of (session?.turns || []).entries()) {
    const item = element("li", { "data-testid": "turn", "data-status": turn.status || "done" },
      element("p", { class: "user" }, turn.user), element("p", { class: "assistant" }, turn.assistant));
    if (turn.stats) {
      const s = turn.stats;
      const saving = turn.nocache ? `; without the cache ${turn.nocache.ttft} ms (${(turn.nocache.ttft / Math.max(s.ttft, 1)).toFixed(1)}x)` : "";
      item.append(
        bar(s),
        element("p", { class: "stats", "data-testid": "turn-stats" },
          `TTFT ${s.ttft} ms, ${s.tps ? s.tps.toFixed(1) : "-"} tok/s; prompt ${s.prompt}: ${s.cached} cached (${s.source}), ${s.prompt - s.cached} computed${saving}`),
        element("div", { class: "actions" },
          element("button", { "data-testid": "recompute", onclick: () => recompute(index).catch((e) => status(e.message, true)) }, "recompute without cache"),
          element("button", { "data-testid": "fork", onclick: () => fork(index).catch((e) => status(e.message, true)) }, "fork here"),
          element("button", { "data-testid": "rewind", onclick: () => rewind(index).catch((e) => status(e.message, true)) }, "rewind to here")),
      );
    }
    list.append(item);
  }
  renderChart(session?.turns.filter((t) => t.stats) || []);
}

function renderChart(turns) {
  const svg = $("ttft-chart");
  svg.replaceChildren();
  const top = Math.max(1, ...turns.flatMap((t) => [t.stats.ttft, t.nocache?.ttft || 0]));
  const width = 600 / Math.max(turns.length, 1);
  const ns = "http://www.w3.org/2000/svg";
  const rect = (x, h, kind, label) => {
    const node = document.createElementNS(ns, "rect");
    for (const [k, v] of Object.entries({ x, y: 140 - h, width: width * 0.35, height: h, class: kind })) node.setAttribute(k, v);
    const title = document.createElementNS(ns, "title");
    title.textContent = label;
    node.append(title);
    svg.append(node);
  };
  turns.forEach((turn, i) => {
    rect(i * width + width * 0.1, (130 * turn.stats.ttft) / top, "with-cache", `turn ${i + 1}: ${turn.stats.ttft} ms`);
    if (turn.nocache) rect(i * width + width * 0.5, (130 * turn.nocache.ttft) / top, "no-cache", `turn ${i + 1} recomputed: ${turn.nocache.ttft} ms`);
    const text = document.createElementNS(ns, "text");
    for (const [k, v] of Object.entries({ x: i * width + width * 0.1, y: 155 })) text.setAttribute(k, v);
    text.textContent = `turn ${i + 1}`;
    svg.append(text);
  });
}

function bytes(n) {
  return n >= 1 << 20 ? `${(n / (1 << 20)).toFixed(1)} MiB` : n >= 1024 ? `${(n / 1024).toFixed(0)} KiB` : `${n} B`;
}

function renderSessions(list) {
  $("sessions").replaceChildren(...list.map((s) => {
    const tiers = TIERS.filter((t) => s.cache[t]?.bytes).map((t) => `${t} ${bytes(s.cache[t].exclusive_bytes ?? s.cache[t].bytes)} own + ${bytes(s.cache[t].shared_bytes ?? 0)} shared`);
    const known = s.id in stored;
    return element("li", { "data-testid": "session", "data-id": s.id, class: s.id === current ? "current" : "" },
      element("button", { class: "pick", disabled: !known, onclick: () => select(s.id), title: known ? "continue it" : "made elsewhere: its messages are not in this browser" }, s.id),
      element("span", {}, ` ${s.turns} turns, ${s.transcript_tokens} tokens; ${tiers.join("; ") || "no K/V held"}`),
      element("button", { class: "delete", "data-testid": "delete", onclick: () => remove(s.id).catch((e) => status(e.message, true)) }, "delete"));
  }));
}

function renderPool(found) {
  const rows = [];
  for (const { labels, value } of found["kvserve:kv_cache_usage_perc"] || []) rows.push([`${labels.model}: blocks in use`, `${(100 * value).toFixed(1)}%`]);
  for (const { labels, value } of found["kvserve:kv_cache_bytes"] || []) rows.push([`K/V held, ${labels.tier}`, bytes(value)]);
  $("pool").replaceChildren(...rows.flatMap(([name, value]) => [element("dt", {}, name), element("dd", {}, value)]));
}

async function refresh() {
  const asked = Date.now();
  try {
    const [list, found] = await Promise.all([call("GET", "/v1/sessions?limit=100"), metrics().catch(() => ({}))]);
    for (const [id, session] of Object.entries(stored)) {
      const isGone = !list.has_more && !list.data.some((s) => s.id === id) && (session.made || 0) < asked;
      if (isGone) delete stored[id]; // expired or deleted elsewhere (one made while this list was read is kept)
    }
    if (current && !stored[current]) select(null);
    save();
    renderSessions(list.data);
    renderPool(found);
  } catch (error) {
    status(error.message, true);
  }
}

async function start() {
  $("api-key").value = state.key;
  $("api-key").onchange = () => {
    state.key = $("api-key").value.trim();
    localStorage.setItem("kvserve-key", state.key);
    load();
    select(null);
    start();
  };
  $("new-session").onclick = () => newSession().catch((e) => status(e.message, true));
  $("composer").onsubmit = (event) => send(event).catch((e) => status(e.message, true));
  $("stop").onclick = () => running?.abort();
  try {
    const models = await call("GET", "/v1/models");
    $("model").replaceChildren(...models.data.map((m) => element("option", { value: m.id }, m.id)));
    status("ready");
  } catch (error) {
    status(`${error.message} (an API key may be needed)`, true);
  }
  await refresh();
}

load();
start();
setInterval(refresh, 5000);
