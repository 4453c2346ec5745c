// The server's public API, as the playground uses it: JSON calls, a streamed chat turn, the metrics it shows.

export const state = { key: localStorage.getItem("kvserve-key") || "" };

function headers(extra = {}) {
  const found = { "Content-Type": "application/json", ...extra };
  if (state.key) found.Authorization = `Bearer ${state.key}`;
  return found;
}

export async function call(method, path, body) {
  const response = await fetch(path, { method, headers: headers(), body: body === undefined ? undefined : JSON.stringify(body) });
  const text = await response.text();
  const data = text ? JSON.parse(text) : {};
  if (!response.ok) throw new Error(data.error?.message || `${response.status} ${response.statusText}`);
  return data;
}

// One streamed chat turn. Returns what the page draws: the reply, its usage, where its cached K/V came from,
// and when its first token and its end arrived (ms since the request left).
export async function streamChat(body, { signal, onText, sessionId }) {
  const started = performance.now();
  const extra = sessionId ? { "X-Session-ID": sessionId } : {};
  const payload = { ...body, stream: true, stream_options: { include_usage: true } };
  const response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(extra), body: JSON.stringify(payload), signal });
  if (!response.ok) {
    const data = await response.json().catch(() => ({}));
    throw new Error(data.error?.message || `${response.status} ${response.statusText}`);
  }
  const turn = { text: "", usage: null, source: response.headers.get("X-Cache-Source") || "none", firstMs: null, endMs: null };
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffered += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffered.indexOf("\n\n")) >= 0) {
      const block = buffered.slice(0, cut);
      buffered = buffered.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: {")) continue;
        const event = JSON.parse(line.slice(6));
        if (event.error) throw new Error(event.error.message);
        const piece = event.choices?.[0]?.delta?.content;
        if (piece) {
          if (turn.firstMs === null) turn.firstMs = performance.now() - started;
          turn.text += piece;
          onText?.(turn.text);
        }
        if (event.usage) turn.usage = event.usage;
      }
    }
  }
  turn.endMs = performance.now() - started;
  if (turn.firstMs === null) turn.firstMs = turn.endMs;
  return turn;
}

// The Prometheus text of /metrics, as {name: [{labels, value}]} for the few gauges the page shows.
export async function metrics() {
  const response = await fetch("/metrics", { headers: headers() });
  if (!response.ok) throw new Error(`/metrics: ${response.status}`);
  const found = {};
  for (const line of (await response.text()).split("\n")) {
    const match = line.match(/^(kvserve:[a-z_]+)(?:\{([^}]*)\})? ([0-9.e+-]+|NaN)$/);
    if (!match) continue;
    const labels = Object.fromEntries([...(match[2] || "").matchAll(/(\w+)="([^"]*)"/g)].map((m) => [m[1], m[2]]));
    (found[match[1]] ||= []).push({ labels, value: Number(match[3]) });
  }
  return found;
}
