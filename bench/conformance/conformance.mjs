// What the Node clients people build on do against kvserve: the official openai SDK and the Vercel AI SDK
// (its default OpenAI provider, which speaks the Responses API, and its Anthropic provider, which speaks the
// Messages API), and Anthropic's own SDK (its tool runner, on message threads). One line per check, PASS or FAIL with why; the exit code is the number of failures.
// Run by bench/conformance.py: KVSERVE_BASE=http://.../v1 MODEL=...
import Anthropic from "@anthropic-ai/sdk";
import { betaTool } from "@anthropic-ai/sdk/helpers/beta/json-schema";
import OpenAI from "openai";
import { zodResponseFormat } from "openai/helpers/zod";
import { createAnthropic } from "@ai-sdk/anthropic";
import { createOpenAI } from "@ai-sdk/openai";
import { Output, generateObject, generateText, isStepCount, streamText, tool } from "ai";
import { z } from "zod";

const base = process.env.KVSERVE_BASE;
const model = process.env.MODEL;
const client = new OpenAI({ baseURL: base, apiKey: "unused", maxRetries: 0 });
const provider = createOpenAI({ baseURL: base, apiKey: "unused" });
const sentToAnthropic = [];  // the bodies the Anthropic provider sent, to say what it asked for
const anthropic = createAnthropic({
  baseURL: base, apiKey: "unused",
  fetch: async (url, init) => { sentToAnthropic.push(JSON.parse(init.body)); return fetch(url, init); },
});
const weather = { city: z.enum(["Paris", "Rome", "Berlin"]).describe("the city") };
let failures = 0;

async function check(name, body) {
  try {
    console.log(`PASS ${name}: ${await body()}`);
  } catch (error) {
    failures += 1;
    console.log(`FAIL ${name}: ${String(error?.message ?? error).split("\n")[0].slice(0, 300)}`);
  }
}

function expect(condition, what) {
  if (!condition) throw new Error(what);
}

await check("openai-node chat.completions.create", async () => {
  const r = await client.chat.completions.create({
    model, messages: [{ role: "user", content: "What is the capital of France?" }], max_tokens: 12, temperature: 0,
  });
  expect(r.choices[0].message.content, "no content");
  return JSON.stringify(r.choices[0].message.content);
});

await check("openai-node session continued by header, streamed with usage", async () => {
  const messages = [{ role: "user", content: "Name a colour." }];
  const headers = { "X-Session-ID": `node-${Date.now()}` };
  const first = await client.chat.completions.create({ model, messages, max_tokens: 8, temperature: 0 }, { headers });
  messages.push({ role: "assistant", content: first.choices[0].message.content }, { role: "user", content: "Another." });
  const stream = await client.chat.completions.create(
    { model, messages, max_tokens: 8, temperature: 0, stream: true, stream_options: { include_usage: true } },
    { headers },
  );
  let text = "", usage = null;
  for await (const chunk of stream) {
    text += chunk.choices[0]?.delta?.content ?? "";
    usage = chunk.usage ?? usage;
  }
  const cached = usage.prompt_tokens_details.cached_tokens;
  expect(cached >= first.usage.prompt_tokens, `turn 2 reused ${cached} tokens`);
  return `turn 2 reused ${cached} of ${usage.prompt_tokens} prompt tokens`;
});

await check("openai-node chat.completions.parse with zodResponseFormat", async () => {
  const Capital = z.object({ country: z.string().max(20), capital: z.string().max(20) });
  const r = await client.chat.completions.parse({
    model, messages: [{ role: "user", content: "The capital of Italy, as JSON." }],
    response_format: zodResponseFormat(Capital, "capital"), max_tokens: 40, temperature: 0,
  });
  expect(r.choices[0].message.parsed, "nothing parsed");
  return JSON.stringify(r.choices[0].message.parsed);
});

await check("openai-node tools: required call, then its result", async () => {
  const tools = [{
    type: "function",
    function: { name: "get_weather", parameters: z.toJSONSchema(z.object(weather)) },
  }];
  const messages = [{ role: "user", content: "What is the weather in Rome?" }];
  const first = await client.chat.completions.create({
    model, messages, tools, tool_choice: "required", parallel_tool_calls: false, max_tokens: 40, temperature: 0,
  });
  const call = first.choices[0].message.tool_calls[0];
  expect(call.function.name === "get_weather", "no call");
  messages.push(first.choices[0].message, { role: "tool", tool_call_id: call.id, content: "sunny, 21 C" });
  const second = await client.chat.completions.create({ model, messages, tools, max_tokens: 16, temperature: 0 });
  return `${call.function.arguments} -> ${JSON.stringify(second.choices[0].message.content)}`;
});

await check("openai-node responses: two turns by previous_response_id", async () => {
  const first = await client.responses.create({ model, input: "Name a river.", max_output_tokens: 12, temperature: 0 });
  const second = await client.responses.create({
    model, input: "Where is it?", previous_response_id: first.id, max_output_tokens: 12, temperature: 0,
  });
  const cached = second.usage.input_tokens_details.cached_tokens;
  expect(cached >= first.usage.input_tokens, `reused ${cached}`);
  return `${JSON.stringify(second.output_text)} (reused ${cached} tokens)`;
});

await check("ai-sdk generateText, two turns (default provider: Responses API)", async () => {
  const messages = [{ role: "user", content: "Say hello." }];
  const first = await generateText({ model: provider(model), messages, maxOutputTokens: 8, temperature: 0 });
  messages.push(...first.response.messages, { role: "user", content: "Say it again." });
  const sent = [];
  const watched = createOpenAI({
    baseURL: base, apiKey: "unused", fetch: async (url, init) => { sent.push(JSON.parse(init.body)); return fetch(url, init); },
  });
  const second = await generateText({ model: watched(model), messages, maxOutputTokens: 8, temperature: 0 });
  const references = sent[0].input.filter((item) => item.type === "item_reference").length;
  expect(references > 0, "turn 2 sent no item_reference");
  const cached = second.usage.inputTokenDetails?.cacheReadTokens ?? second.usage.cachedInputTokens;
  return `${JSON.stringify(first.text)} then ${JSON.stringify(second.text)}; turn 2 sent ${references} item_reference, reused ${cached} tokens`;
});

await check("ai-sdk generateText with a tool, two steps", async () => {
  const result = await generateText({
    model: provider(model),
    prompt: "What is the weather in Berlin?",
    tools: {
      weather: tool({
        description: "The weather in a city",
        inputSchema: z.object(weather),
        execute: async ({ city }) => `sunny in ${city}`,
      }),
    },
    toolChoice: "required",
    providerOptions: { openai: { parallelToolCalls: false } },  // a 135M model repeats a call it may repeat
    stopWhen: isStepCount(2),
    maxOutputTokens: 40,
    temperature: 0,
  });
  const calls = result.steps.flatMap((step) => step.toolCalls);
  expect(calls.length > 0, "no tool call");
  return `${calls.map((c) => `${c.toolName}(${JSON.stringify(c.input)})`).join(", ")}, ${result.steps.length} steps`;
});

await check("ai-sdk generateObject", async () => {
  const { object } = await generateObject({
    model: provider(model),
    schema: z.object({ name: z.string().max(20), age: z.number().int().min(0).max(120) }),
    prompt: "Invent a person.",
    maxOutputTokens: 40,
    temperature: 0,
  });
  return JSON.stringify(object);
});

await check("ai-sdk generateText with Output.object", async () => {
  const { output } = await generateText({
    model: provider(model),
    output: Output.object({ schema: z.object({ city: z.enum(["Paris", "Rome", "Berlin"]), sunny: z.boolean() }) }),
    prompt: "Is it sunny in Rome?",
    maxOutputTokens: 30,
    temperature: 0,
  });
  return JSON.stringify(output);
});

await check("ai-sdk streamText", async () => {
  const result = streamText({ model: provider(model), prompt: "Count to three.", maxOutputTokens: 12, temperature: 0 });
  let text = "";
  for await (const part of result.textStream) text += part;
  expect(text, "no text");
  return JSON.stringify(text);
});

const weatherTool = tool({
  description: "The weather in a city",
  inputSchema: z.object(weather),
  execute: async ({ city }) => `sunny in ${city}`,
});
const oneCall = { anthropic: { disableParallelToolUse: true } };  // a 135M model repeats a call it may repeat

await check("ai-sdk anthropic generateText with a tool, two steps (Messages API)", async () => {
  const result = await generateText({
    model: anthropic(model), prompt: "What is the weather in Rome?", tools: { weather: weatherTool },
    toolChoice: "required", providerOptions: oneCall, stopWhen: isStepCount(2), maxOutputTokens: 40, temperature: 0,
  });
  const calls = result.steps.flatMap((step) => step.toolCalls);
  expect(calls.length > 0, "no tool call");
  return `${calls.map((c) => `${c.toolName}(${JSON.stringify(c.input)})`).join(", ")}, ${result.steps.length} steps`;
});

await check("ai-sdk anthropic streamText with a tool (eager_input_streaming)", async () => {
  const before = sentToAnthropic.length;
  const result = streamText({
    model: anthropic(model), prompt: "What is the weather in Paris?", tools: { weather: weatherTool },
    toolChoice: "required", providerOptions: oneCall, maxOutputTokens: 40, temperature: 0,
  });
  const kinds = {};
  let input = "";
  for await (const part of result.fullStream) {
    kinds[part.type] = (kinds[part.type] ?? 0) + 1;
    if (part.type === "tool-input-delta") input += part.delta;
    if (part.type === "error") throw new Error(String(part.error?.message ?? part.error));
  }
  const eager = sentToAnthropic[before].tools.map((t) => t.eager_input_streaming);
  expect(eager.every((flag) => flag === true), `the provider sent eager_input_streaming ${eager}`);
  const calls = await result.toolCalls;
  expect(calls.length > 0, "no tool call");
  return `sent eager_input_streaming: true; ${kinds["tool-input-delta"] ?? 0} input delta(s) ${input} -> ` +
    `${calls.map((c) => `${c.toolName}(${JSON.stringify(c.input)})`).join(", ")}`;
});

for (const [name, which] of [["OpenAI provider (Responses API)", provider], ["Anthropic provider (Messages API)", anthropic]]) {
  await check(`ai-sdk tool loop, a call then its answer in text: ${name}`, async () => {
    const result = await generateText({
      model: which(model), prompt: "What is the weather in Berlin?", tools: { weather: weatherTool },
      prepareStep: ({ stepNumber }) => ({ toolChoice: stepNumber === 0 ? "required" : "auto" }),
      providerOptions: { openai: { parallelToolCalls: false }, ...oneCall }, stopWhen: isStepCount(2),
      maxOutputTokens: 48, temperature: 0,
    });
    const calls = result.steps.flatMap((step) => step.toolCalls);
    expect(calls.length === 1, `${calls.length} calls`);
    expect(result.text.trim() !== "", "step 2 answered with no text");
    return `${calls[0].toolName}(${JSON.stringify(calls[0].input)}) -> ${JSON.stringify(result.text)}`;
  });
}

await check("anthropic-node beta.messages.toolRunner: three steps on one message thread", async () => {
  const sent = [];
  const claude = new Anthropic({
    baseURL: base.replace(/\/v1$/, ""), apiKey: "unused", maxRetries: 0,
    fetch: async (url, init) => { sent.push(JSON.parse(init.body)); return fetch(url, init); },
  });
  const cities = [];
  const getWeather = betaTool({
    name: "get_weather", description: "The current weather in a city",
    inputSchema: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
    run: async ({ city }) => { cities.push(city); return `It is sunny in ${city} and 22 degrees.`; },
  });
  const runner = claude.beta.messages.toolRunner({
    model, max_tokens: 64, tools: [getWeather], tool_choice: { type: "any" }, max_iterations: 3, temperature: 0,
    messages: [{ role: "user", content: "What is the weather in Paris?" }],
  });
  const reads = [];
  for await (const message of runner) reads.push(message.usage.cache_read_input_tokens);
  expect(reads.length === 3, `${reads.length} steps`);
  expect(reads.slice(1).every((n) => n > 0), `cache reads per step ${reads}`);
  const threads = sent.map((body) => body.thread?.type ?? "none");
  expect(threads.join() === "create,continue,continue", `threads ${threads}`);
  expect(sent.slice(1).every((body) => body.messages.length === 1), "a continue sent more than its new turn");
  return `threads ${threads.join(", ")}; cache reads per step ${reads.join(", ")}; called for ${cities.join(", ")}`;
});

process.exit(failures);
