"""The official Python clients, unchanged, through oqp.

Run by tests/clients/run.sh against oqp in single-box mode in front of the
fake Ollama, with auth on. It uses only what a user would set:
OLLAMA_HOST and OLLAMA_API_KEY for ollama-python, base_url and api_key for
openai-python, base_url with api_key (x-api-key) or auth_token (Bearer) for
anthropic-python. Every check runs; any failure makes the exit status 1.

The fleet is mixed: OQP_CHAT_MODEL and OQP_EMBED_MODEL are served by the fake
Ollama, OQP_ENGINE_CHAT_MODEL and OQP_ENGINE_EMBED_MODEL by llama-servers
(random weights: checks look at shapes, never at text; generations are bounded
with num_predict/max_tokens). LangChain's ChatOllama (langchain-ollama) runs
against both kinds of model.

Environment: OLLAMA_HOST (http://127.0.0.1:PORT of oqp), OLLAMA_API_KEY (an
oqp key), OQP_CHAT_MODEL (default llama3.2), OQP_EMBED_MODEL (default
all-minilm), OQP_ENGINE_CHAT_MODEL (default tiny-chat), OQP_ENGINE_EMBED_MODEL
(default tiny-embed), OQP_SPENT_KEY (an oqp key whose token budget is spent
after one answer).
"""

import base64
from importlib import metadata
import math
import os
import struct
import sys
import traceback

import json

import anthropic
from langchain_ollama import ChatOllama
import ollama
import openai

HOST = os.environ["OLLAMA_HOST"]
KEY = os.environ["OLLAMA_API_KEY"]
CHAT = os.environ.get("OQP_CHAT_MODEL", "llama3.2")
EMBED = os.environ.get("OQP_EMBED_MODEL", "all-minilm")
ENGINE_CHAT = os.environ.get("OQP_ENGINE_CHAT_MODEL", "tiny-chat")
ENGINE_EMBED = os.environ.get("OQP_ENGINE_EMBED_MODEL", "tiny-embed")
# An engine's random-weight model writes until its context is full unless told to stop.
SHORT = {"num_predict": 8}
SPENT = os.environ.get("OQP_SPENT_KEY", "")
TEXTS = ["The sky is blue because of Rayleigh scattering.", "Grass is green."]

CHECKS = []


def check(name):
    def register(function):
        CHECKS.append((name, function))
        return function

    return register


def expect(condition, message):
    if not condition:
        raise AssertionError(message)


def ollama_client():
    # Host and key come from OLLAMA_HOST and OLLAMA_API_KEY, as for any user.
    return ollama.Client()


def openai_client():
    return openai.OpenAI(base_url=HOST.rstrip("/") + "/v1", api_key=KEY, max_retries=0)


def is_vector(values):
    return len(values) > 0 and all(isinstance(v, float) and math.isfinite(v) for v in values)


# ---- ollama-python ---------------------------------------------------------


@check("ollama: list")
def ollama_list():
    names = [m.model for m in ollama_client().list().models]
    expect(any(n.startswith(CHAT) for n in names), f"{CHAT} not in {names}")
    expect(any(n.startswith(EMBED) for n in names), f"{EMBED} not in {names}")


@check("ollama: show")
def ollama_show():
    shown = ollama_client().show(CHAT)
    expect(shown.details is not None, f"no details: {shown}")
    expect(shown.modelinfo, "no model_info")


@check("ollama: ps")
def ollama_ps():
    loaded = [m.model for m in ollama_client().ps().models]
    expect(any(n.startswith(CHAT) for n in loaded), f"{CHAT} not loaded: {loaded}")


@check("ollama: generate")
def ollama_generate():
    answer = ollama_client().generate(model=CHAT, prompt="Why is the sky blue?")
    expect(answer.done, f"not done: {answer}")
    expect(answer.response, "empty response")


@check("ollama: generate, streamed")
def ollama_generate_streamed():
    chunks = list(ollama_client().generate(model=CHAT, prompt="Why is the sky blue?", stream=True))
    expect(len(chunks) >= 2, f"{len(chunks)} chunks")
    expect(chunks[-1].done and not any(c.done for c in chunks[:-1]), "done only on the last chunk")
    expect("".join(c.response for c in chunks), "no text")


@check("ollama: chat")
def ollama_chat():
    answer = ollama_client().chat(model=CHAT, messages=[{"role": "user", "content": "Hello!"}])
    expect(answer.message.role == "assistant", f"role {answer.message.role}")
    expect(answer.message.content, "empty message")


@check("ollama: chat, streamed")
def ollama_chat_streamed():
    chunks = list(
        ollama_client().chat(model=CHAT, messages=[{"role": "user", "content": "Hello!"}], stream=True)
    )
    expect(len(chunks) >= 2, f"{len(chunks)} chunks")
    expect(chunks[-1].done, "the last chunk is done")
    expect("".join(c.message.content for c in chunks), "no text")


@check("ollama: embed")
def ollama_embed():
    answer = ollama_client().embed(model=EMBED, input=TEXTS)
    expect(len(answer.embeddings) == len(TEXTS), f"{len(answer.embeddings)} vectors")
    expect(all(is_vector(v) for v in answer.embeddings), "not float vectors")
    again = ollama_client().embed(model=EMBED, input=TEXTS[0])
    expect(again.embeddings[0] == answer.embeddings[0], "the same text, a different vector")


@check("ollama: a missing key is refused")
def ollama_without_key():
    saved = os.environ.pop("OLLAMA_API_KEY")
    try:
        ollama.Client().list()
    except ollama.ResponseError as error:
        expect(error.status_code == 401, f"status {error.status_code}")
    else:
        raise AssertionError("listed models without a key")
    finally:
        os.environ["OLLAMA_API_KEY"] = saved


# ---- ollama-python against llama-server (translated by oqp) -----------------


@check("ollama: list, show and ps name the engines' models too")
def ollama_engine_inventory():
    client = ollama_client()
    names = [m.model for m in client.list().models]
    for model in (CHAT, EMBED, ENGINE_CHAT, ENGINE_EMBED):
        expect(any(n.split(":")[0] == model for n in names), f"{model} not in {names}")
    shown = client.show(ENGINE_CHAT)
    expect(shown.details is not None, f"no details: {shown}")
    expect(shown.capabilities and "completion" in shown.capabilities, f"{shown.capabilities}")
    loaded = [m.model for m in client.ps().models]
    expect(any(n.split(":")[0] == ENGINE_CHAT for n in loaded), f"{ENGINE_CHAT} not in {loaded}")


@check("ollama: chat with an engine, streamed and not")
def ollama_engine_chat():
    messages = [{"role": "user", "content": "Hello!"}]
    answer = ollama_client().chat(model=ENGINE_CHAT, messages=messages, options=SHORT)
    expect(answer.done and answer.message.role == "assistant", f"{answer}")
    expect(answer.done_reason in ("stop", "length"), f"done_reason {answer.done_reason}")
    expect(answer.eval_count and answer.eval_count <= 8, f"eval_count {answer.eval_count}")
    expect(answer.total_duration and answer.total_duration > 0, f"{answer.total_duration}")
    chunks = list(
        ollama_client().chat(model=ENGINE_CHAT, messages=messages, options=SHORT, stream=True)
    )
    expect(len(chunks) >= 2, f"{len(chunks)} chunks")
    expect(chunks[-1].done and not any(c.done for c in chunks[:-1]), "done only on the last chunk")
    expect(all(c.model == ENGINE_CHAT for c in chunks), f"models {[c.model for c in chunks]}")


@check("ollama: generate with an engine, streamed and not")
def ollama_engine_generate():
    answer = ollama_client().generate(model=ENGINE_CHAT, prompt="Why?", options=SHORT)
    expect(answer.done and isinstance(answer.response, str), f"{answer}")
    expect(answer.prompt_eval_count and answer.prompt_eval_count > 0, f"{answer}")
    chunks = list(
        ollama_client().generate(model=ENGINE_CHAT, prompt="Why?", options=SHORT, stream=True)
    )
    expect(chunks[-1].done and not any(c.done for c in chunks[:-1]), "done only on the last chunk")


@check("ollama: embed with an engine")
def ollama_engine_embed():
    answer = ollama_client().embed(model=ENGINE_EMBED, input=TEXTS)
    expect(len(answer.embeddings) == len(TEXTS), f"{len(answer.embeddings)} vectors")
    expect(all(is_vector(v) for v in answer.embeddings), "not float vectors")
    again = ollama_client().embed(model=ENGINE_EMBED, input=TEXTS[1])
    expect(len(again.embeddings[0]) == len(answer.embeddings[1]), "another dimension")
    expect(
        all(abs(a - b) < 1e-4 for a, b in zip(again.embeddings[0], answer.embeddings[1])),
        "the same text, a different vector",
    )


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
VERDICT = {
    "type": "object",
    "properties": {"verdict": {"type": "string", "enum": ["sunny", "rainy"]}},
    "required": ["verdict"],
}
# Longer than any answer VERDICT's grammar allows (about 215 characters at most).
VERDICT_TOKENS = 256


def expect_verdict(content):
    """content is JSON of VERDICT's shape: one property, one of the enum's values."""
    text = content.strip()
    # The grammar also allows the object fenced as a Markdown JSON block.
    if text.startswith("```json") and text.endswith("```"):
        text = text[len("```json") : -len("```")]
    try:
        parsed = json.loads(text)
    except ValueError as error:
        raise AssertionError(f"not JSON ({error}): {content!r}") from None
    expect(isinstance(parsed, dict) and list(parsed) == ["verdict"], f"not the schema's shape: {parsed}")
    expect(parsed["verdict"] in ("sunny", "rainy"), f"not the schema's shape: {parsed}")


# The turn a model would have made, and its tool's answer: the next turn is asked for.
ROUND_TRIP = [
    {"role": "user", "content": "Is it sunny in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": '{"sky": "clear"}', "tool_name": "get_weather"},
]


@check("ollama: a tool call round trip with a JSON schema format, on an engine")
def ollama_engine_tools():
    client = ollama_client()
    answer = client.chat(model=ENGINE_CHAT, messages=ROUND_TRIP, tools=TOOLS, options=SHORT)
    expect(answer.done and answer.message.role == "assistant", f"{answer}")
    expect(answer.prompt_eval_count and answer.prompt_eval_count > 0, f"{answer}")
    # The schema reaches the engine as its response_format, which llama-server enforces with
    # a grammar: the answer is JSON of the schema's shape. The grammar allows a short answer
    # only (one enum property, at most 23 characters of white space at each of its few
    # places), so VERDICT_TOKENS always lets it end.
    shaped = client.chat(
        model=ENGINE_CHAT,
        messages=ROUND_TRIP,
        tools=TOOLS,
        format=VERDICT,
        options={"num_predict": VERDICT_TOKENS, "temperature": 0},
    )
    expect(shaped.done and shaped.message.role == "assistant", f"{shaped}")
    expect(shaped.done_reason == "stop", f"cut: {shaped}")
    expect_verdict(shaped.message.content)
    streamed = "".join(
        part.message.content or ""
        for part in client.chat(
            model=ENGINE_CHAT,
            messages=ROUND_TRIP,
            tools=TOOLS,
            format=VERDICT,
            options={"num_predict": VERDICT_TOKENS, "temperature": 1.0, "seed": 7},
            stream=True,
        )
    )
    expect_verdict(streamed)


@check("ollama: one client, an Ollama model and an engine's (mixed fleet)")
def ollama_mixed_fleet():
    client = ollama_client()
    for model in (CHAT, ENGINE_CHAT):
        answer = client.chat(model=model, messages=[{"role": "user", "content": "Hi"}], options=SHORT)
        expect(answer.model.split(":")[0] == model, f"{model} answered as {answer.model}")
        expect(answer.done, f"{model}: not done")
    for model in (EMBED, ENGINE_EMBED):
        vectors = client.embed(model=model, input=TEXTS).embeddings
        expect(len(vectors) == 2 and all(is_vector(v) for v in vectors), f"{model}: not vectors")


@check("langchain: ChatOllama, an Ollama model and an engine's, invoked and streamed")
def langchain_chat_ollama():
    for model in (CHAT, ENGINE_CHAT):
        chat = ChatOllama(model=model, base_url=HOST, num_predict=8)
        message = chat.invoke("Hello!")
        expect(isinstance(message.content, str), f"{model}: {message}")
        expect(message.usage_metadata and message.usage_metadata["output_tokens"] > 0, f"{model}")
        chunks = list(chat.stream("Hello!"))
        expect(len(chunks) >= 2, f"{model}: {len(chunks)} chunks")


# ---- openai-python ---------------------------------------------------------


@check("openai: chat and embeddings, an Ollama model and an engine's (mixed fleet)")
def openai_mixed_fleet():
    client = openai_client()
    for model in (CHAT, ENGINE_CHAT):
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8
        )
        expect(answer.choices[0].message is not None, f"{model}: {answer}")
        expect(answer.usage.completion_tokens <= 8, f"{model}: {answer.usage}")
    for model in (EMBED, ENGINE_EMBED):
        data = client.embeddings.create(model=model, input=TEXTS, encoding_format="float").data
        expect(len(data) == 2 and all(is_vector(d.embedding) for d in data), f"{model}")


def float_vectors():
    answer = openai_client().embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    return [item.embedding for item in sorted(answer.data, key=lambda d: d.index)]


@check("openai: embeddings, float")
def openai_embeddings_float():
    vectors = float_vectors()
    expect(len(vectors) == len(TEXTS), f"{len(vectors)} vectors")
    expect(all(is_vector(v) for v in vectors), "not float vectors")


@check("openai: embeddings, base64")
def openai_embeddings_base64():
    answer = openai_client().embeddings.create(model=EMBED, input=TEXTS, encoding_format="base64")
    items = sorted(answer.data, key=lambda d: d.index)
    expect(len(items) == len(TEXTS), f"{len(items)} vectors")
    expected = float_vectors()
    for item, floats in zip(items, expected):
        expect(isinstance(item.embedding, str), f"not base64: {type(item.embedding)}")
        raw = base64.b64decode(item.embedding)
        decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
        expect(len(decoded) == len(floats), f"{len(decoded)} vs {len(floats)} dimensions")
        expect(all(abs(a - b) < 1e-6 for a, b in zip(decoded, floats)), "base64 differs from float")


@check("openai: embeddings, library default")
def openai_embeddings_default():
    # The library asks for base64 and decodes it itself.
    answer = openai_client().embeddings.create(model=EMBED, input=TEXTS[0])
    expect(is_vector(answer.data[0].embedding), "not a float vector")


@check("openai: chat")
def openai_chat():
    answer = openai_client().chat.completions.create(
        model=CHAT, messages=[{"role": "user", "content": "Hello!"}]
    )
    expect(answer.choices[0].message.content, "empty message")
    expect(answer.choices[0].finish_reason == "stop", f"finish {answer.choices[0].finish_reason}")


@check("openai: chat, streamed")
def openai_chat_streamed():
    stream = openai_client().chat.completions.create(
        model=CHAT, messages=[{"role": "user", "content": "Hello!"}], stream=True
    )
    chunks = list(stream)
    expect(len(chunks) >= 2, f"{len(chunks)} chunks")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expect(text, "no text")
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    expect(finishes == ["stop"], f"finish reasons {finishes}")


@check("openai: a wrong key is refused")
def openai_wrong_key():
    client = openai.OpenAI(base_url=HOST.rstrip("/") + "/v1", api_key="sk-wrong", max_retries=0)
    try:
        client.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "hi"}])
    except openai.AuthenticationError:
        return
    raise AssertionError("a wrong key was served")


# ---- the agents' APIs: anthropic-python on /v1/messages, openai on /v1/responses ----


def anthropic_client(**credentials):
    # What Claude Code does with ANTHROPIC_BASE_URL: the root, not /v1.
    credentials = credentials or {"api_key": KEY}
    return anthropic.Anthropic(base_url=HOST.rstrip("/"), max_retries=0, **credentials)


@check("anthropic: messages, x-api-key")
def anthropic_messages():
    message = anthropic_client().messages.create(
        model=CHAT, max_tokens=64, messages=[{"role": "user", "content": "Hello!"}]
    )
    expect(message.content and message.content[0].text, "no text")
    expect(message.usage.output_tokens > 0, f"usage {message.usage}")


@check("anthropic: messages streamed, Bearer (auth_token)")
def anthropic_messages_streamed():
    client = anthropic_client(auth_token=KEY)
    with client.messages.stream(
        model=CHAT, max_tokens=64, messages=[{"role": "user", "content": "Hello!"}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    expect(text, "no text")
    expect(final.usage.output_tokens > 0, f"usage {final.usage}")


@check("anthropic: a wrong key is refused")
def anthropic_wrong_key():
    try:
        anthropic_client(api_key="sk-wrong").messages.create(
            model=CHAT, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    except anthropic.AuthenticationError:
        return
    raise AssertionError("a wrong key was served")


@check("openai: responses")
def openai_responses():
    response = openai_client().responses.create(model=CHAT, input="Hello!")
    expect(response.output_text, "no text")
    expect(response.usage.output_tokens > 0, f"usage {response.usage}")


@check("openai: responses streamed")
def openai_responses_streamed():
    events = list(openai_client().responses.create(model=CHAT, input="Hello!", stream=True))
    kinds = [event.type for event in events]
    expect(kinds[0] == "response.created", f"events {kinds}")
    expect(kinds[-1] == "response.completed", f"events {kinds}")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    expect(text, "no text")


@check("a spent budget raises each SDK's rate-limit error")
def spent_budget():
    expect(SPENT, "OQP_SPENT_KEY is not set")
    first = anthropic_client(api_key=SPENT)
    # The first answer spends the budget of one token; the next requests are refused.
    first.messages.create(model=CHAT, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    try:
        first.messages.create(model=CHAT, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        raise AssertionError("anthropic: a spent budget was served")
    except anthropic.RateLimitError as error:
        expect("budget exceeded" in str(error), str(error))
    client = openai.OpenAI(base_url=HOST.rstrip("/") + "/v1", api_key=SPENT, max_retries=0)
    try:
        client.responses.create(model=CHAT, input="hi")
        raise AssertionError("openai: a spent budget was served")
    except openai.RateLimitError as error:
        expect("budget exceeded" in str(error), str(error))


def main():
    names = ("ollama", "openai", "anthropic", "langchain-ollama")
    versions = {name: metadata.version(name) for name in names}
    print(
        f"ollama-python {versions['ollama']}, openai-python {versions['openai']}, "
        f"anthropic-python {versions['anthropic']}, "
        f"langchain-ollama {versions['langchain-ollama']}, through {HOST}"
    )
    failed = []
    for name, function in CHECKS:
        try:
            function()
        except Exception as error:  # noqa: BLE001 - every failure is reported
            failed.append(name)
            print(f"FAIL {name}: {type(error).__name__}: {error}")
            traceback.print_exc(limit=3, file=sys.stdout)
        else:
            print(f"ok   {name}")
    print(f"{len(CHECKS) - len(failed)} of {len(CHECKS)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
