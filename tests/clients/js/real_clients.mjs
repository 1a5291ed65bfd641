// ollama-js, unchanged, through oqp (run by tests/clients/run.sh).
//
// The fleet is mixed: OQP_CHAT_MODEL and OQP_EMBED_MODEL are served by the fake
// Ollama, OQP_ENGINE_CHAT_MODEL and OQP_ENGINE_EMBED_MODEL by llama-servers (random
// weights: checks look at shapes, never at text; generations are bounded with
// num_predict). ollama-js sends OLLAMA_API_KEY only to ollama.com: the oqp key goes in
// the client's `headers`, and the host as a user passes OLLAMA_HOST to it. Every check
// runs; any failure makes the exit status 1.

import { readFileSync } from "node:fs";
import { Ollama } from "ollama";

const host = process.env.OLLAMA_HOST;
const CHAT = process.env.OQP_CHAT_MODEL ?? "llama3.2";
const EMBED = process.env.OQP_EMBED_MODEL ?? "all-minilm";
const ENGINE_CHAT = process.env.OQP_ENGINE_CHAT_MODEL ?? "tiny-chat";
const ENGINE_EMBED = process.env.OQP_ENGINE_EMBED_MODEL ?? "tiny-embed";
const SHORT = { num_predict: 8 };
const TEXTS = ["The sky is blue because of Rayleigh scattering.", "Grass is green."];

const client = new Ollama({
  host,
  headers: { Authorization: `Bearer ${process.env.OLLAMA_API_KEY}` },
});
const checks = [];
const check = (name, run) => checks.push([name, run]);

function expect(condition, message) {
  if (!condition) throw new Error(message);
}

const base = (name) => name.split(":")[0];
const isVector = (values) =>
  values.length > 0 && values.every((v) => typeof v === "number" && Number.isFinite(v));

async function collect(stream) {
  const chunks = [];
  for await (const chunk of stream) chunks.push(chunk);
  return chunks;
}

check("list, show and ps: both kinds of host", async () => {
  const names = (await client.list()).models.map((m) => base(m.name));
  for (const model of [CHAT, EMBED, ENGINE_CHAT, ENGINE_EMBED]) {
    expect(names.includes(model), `${model} not in ${names}`);
  }
  for (const model of [CHAT, ENGINE_CHAT]) {
    const shown = await client.show({ model });
    expect(shown.details && shown.model_info, `${model}: ${JSON.stringify(shown)}`);
  }
  const loaded = (await client.ps()).models.map((m) => base(m.name));
  expect(loaded.includes(ENGINE_CHAT), `${ENGINE_CHAT} not in ${loaded}`);
});

for (const model of [CHAT, ENGINE_CHAT]) {
  check(`chat (${model}), streamed and not`, async () => {
    const messages = [{ role: "user", content: "Hello!" }];
    const answer = await client.chat({ model, messages, options: SHORT });
    expect(answer.done && answer.message.role === "assistant", JSON.stringify(answer));
    expect(typeof answer.message.content === "string", "no content");
    const chunks = await collect(
      await client.chat({ model, messages, options: SHORT, stream: true }),
    );
    expect(chunks.length >= 2, `${chunks.length} chunks`);
    expect(chunks.at(-1).done && !chunks.slice(0, -1).some((c) => c.done), "done on the last only");
  });

  check(`generate (${model}), streamed and not`, async () => {
    const answer = await client.generate({ model, prompt: "Why?", options: SHORT });
    expect(answer.done && typeof answer.response === "string", JSON.stringify(answer));
    const chunks = await collect(
      await client.generate({ model, prompt: "Why?", options: SHORT, stream: true }),
    );
    expect(chunks.at(-1).done && !chunks.slice(0, -1).some((c) => c.done), "done on the last only");
  });
}

for (const model of [EMBED, ENGINE_EMBED]) {
  check(`embed (${model})`, async () => {
    const answer = await client.embed({ model, input: TEXTS });
    expect(answer.embeddings.length === TEXTS.length, `${answer.embeddings.length} vectors`);
    expect(answer.embeddings.every(isVector), "not float vectors");
  });
}

check("a tool call round trip with a JSON schema format, on an engine", async () => {
  const tools = [
    {
      type: "function",
      function: {
        name: "get_weather",
        description: "The weather in a city",
        parameters: {
          type: "object",
          properties: { city: { type: "string" } },
          required: ["city"],
        },
      },
    },
  ];
  const format = {
    type: "object",
    properties: { verdict: { type: "string", enum: ["sunny", "rainy"] } },
    required: ["verdict"],
  };
  const messages = [
    { role: "user", content: "Is it sunny in Paris?" },
    {
      role: "assistant",
      content: "",
      tool_calls: [{ function: { name: "get_weather", arguments: { city: "Paris" } } }],
    },
    { role: "tool", content: '{"sky": "clear"}', tool_name: "get_weather" },
  ];
  const answer = await client.chat({ model: ENGINE_CHAT, messages, tools, options: SHORT });
  expect(answer.done && answer.message.role === "assistant", JSON.stringify(answer));
  // The schema reaches the engine as its response_format, which llama-server enforces with a
  // grammar: the answer is JSON of the schema's shape. The grammar allows a short answer only
  // (one enum property, at most 23 characters of white space at each of its few places), so
  // 256 tokens always let it end.
  const expectVerdict = (content) => {
    let text = content.trim();
    // The grammar also allows the object fenced as a Markdown JSON block.
    if (text.startsWith("```json") && text.endsWith("```")) text = text.slice(7, -3);
    let parsed;
    try {
      parsed = JSON.parse(text);
    } catch (error) {
      throw new Error(`not JSON (${error.message}): ${JSON.stringify(content)}`);
    }
    const keys = parsed && typeof parsed === "object" && !Array.isArray(parsed) ? Object.keys(parsed) : [];
    expect(keys.length === 1 && ["sunny", "rainy"].includes(parsed.verdict), `not the schema's shape: ${content}`);
  };
  const shaped = await client.chat({
    model: ENGINE_CHAT,
    messages,
    tools,
    format,
    options: { num_predict: 256, temperature: 0 },
  });
  expect(shaped.done && shaped.message.role === "assistant", JSON.stringify(shaped));
  expect(shaped.done_reason === "stop", `cut: ${JSON.stringify(shaped)}`);
  expectVerdict(shaped.message.content);
  let streamed = "";
  for await (const part of await client.chat({
    model: ENGINE_CHAT,
    messages,
    tools,
    format,
    options: { num_predict: 256, temperature: 1.0, seed: 7 },
    stream: true,
  })) {
    streamed += part.message.content ?? "";
  }
  expectVerdict(streamed);
});

const version = JSON.parse(
  readFileSync(new URL("./node_modules/ollama/package.json", import.meta.url)),
).version;
console.log(`ollama-js ${version}, through ${host}`);
let failed = 0;
for (const [name, run] of checks) {
  try {
    await run();
    console.log(`ok   ollama-js: ${name}`);
  } catch (error) {
    failed += 1;
    console.log(`FAIL ollama-js: ${name}: ${error?.stack ?? error}`);
  }
}
console.log(`${checks.length - failed} of ${checks.length} ollama-js checks passed`);
process.exit(failed ? 1 : 0);
