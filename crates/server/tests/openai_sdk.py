"""The unmodified `openai` SDK against `floe serve`'s /v1 routes (run by tests/openai.rs).

Reads OPENAI_BASE_URL, OPENAI_API_KEY and FLOE_BASE_MODEL. Checks that chat, streamed
chat and completions return the sampled token ids with one log-prob each (and, asked,
their top alternatives: chat's `top_logprobs`, completions' `logprobs`), that the same
prompt and seed give the same tokens and log-probs on every route, that streams arrive
token by token while the engine decodes (also with a stop string across tokens, and
beside other clients' requests) and add up to the non-streamed result, that a multi-turn
tool-call episode renders, and that bad requests raise the SDK's 4xx errors.
"""

import concurrent.futures
import os
import time

import openai
from openai import OpenAI

MODEL = os.environ["FLOE_BASE_MODEL"]
client = OpenAI()  # OPENAI_BASE_URL, OPENAI_API_KEY (sent as Authorization: Bearer)


def extra(obj, name):
    """A floe extension field (the SDK keeps unknown fields)."""
    value = getattr(obj, name, None)
    if value is None and obj.model_extra:
        value = obj.model_extra.get(name)
    assert value is not None, f"{name} missing from {obj}"
    return value


messages = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2 + 3?"},
]
chat = client.chat.completions.create(
    model=MODEL, messages=messages, max_tokens=8, seed=3, n=2, logprobs=True
)
prompt = extra(chat, "prompt_token_ids")
assert len(chat.choices) == 2
whole = {}
for choice in chat.choices:
    tokens = extra(choice, "token_ids")
    logprobs = [t.logprob for t in choice.logprobs.content]
    assert len(tokens) == len(logprobs) > 0, choice
    assert all(lp <= 0.0 for lp in logprobs)
    assert choice.finish_reason in ("stop", "length")
    whole[choice.index] = (tokens, logprobs, choice.message.content)
assert chat.usage.prompt_tokens == len(prompt)

# Top log-probs: the SDK reads them; asking changes neither the tokens nor their log-probs.
top = client.chat.completions.create(
    model=MODEL, messages=messages, max_tokens=8, seed=3, n=2, logprobs=True, top_logprobs=3
)
for choice in top.choices:
    tokens, logprobs, _ = whole[choice.index]
    assert extra(choice, "token_ids") == tokens
    assert [t.logprob for t in choice.logprobs.content] == logprobs
    for item in choice.logprobs.content:
        alternatives = item.top_logprobs
        assert len(alternatives) == 3, item
        assert all(a.logprob >= b.logprob for a, b in zip(alternatives, alternatives[1:])), item
        assert item.logprob <= alternatives[0].logprob, item
        assert all(isinstance(a.token, str) and a.bytes is not None for a in alternatives)
first = top.choices[0].logprobs.content[0].top_logprobs
streamed_first = None
for chunk in client.chat.completions.create(
    model=MODEL, messages=messages, max_tokens=8, seed=3, n=2, logprobs=True, top_logprobs=3,
    stream=True,
):
    for choice in chunk.choices:
        if choice.index == 0 and choice.logprobs and choice.logprobs.content and streamed_first is None:
            streamed_first = choice.logprobs.content[0].top_logprobs
assert streamed_first == first, (streamed_first, first)
legacy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, seed=3, logprobs=2)
assert len(legacy.choices[0].logprobs.top_logprobs) == len(legacy.choices[0].logprobs.tokens)
assert all(1 <= len(m) <= 2 for m in legacy.choices[0].logprobs.top_logprobs)

# Completions over the rendered prompt ids: the same samples.
completion = client.completions.create(
    model=MODEL, prompt=prompt, max_tokens=8, seed=3, n=2
)
for choice in completion.choices:
    tokens, logprobs, _ = whole[choice.index]
    assert extra(choice, "token_ids") == tokens
    assert choice.logprobs.token_logprobs == logprobs

# Streaming: the same tokens, log-probs and text.
streamed = {i: ([], [], "") for i in whole}
for chunk in client.chat.completions.create(
    model=MODEL, messages=messages, max_tokens=8, seed=3, n=2, stream=True
):
    for choice in chunk.choices:
        tokens, logprobs, text = streamed[choice.index]
        ids = (choice.model_extra or {}).get("token_ids")
        if ids:
            tokens.extend(ids)
            logprobs.extend(t.logprob for t in choice.logprobs.content)
        streamed[choice.index] = (tokens, logprobs, text + (choice.delta.content or ""))
assert streamed == whole, (streamed, whole)

# Token-by-token streaming: a long completion arrives in many chunks, spread over the
# time the engine decodes, and adds up to the non-streamed result of the same seed.
def streamed_completion(prompt, seed, max_tokens, stop=None):
    """(tokens, logprobs, text, finish_reason, seconds at each token chunk, usage)."""
    tokens, logprobs, text, finish, times, usage = [], [], "", None, [], None
    started = time.monotonic()
    for chunk in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, seed=seed, stop=stop,
        stream=True, stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            ids = (choice.model_extra or {}).get("token_ids")
            if ids:
                times.append(time.monotonic() - started)
                tokens.extend(ids)
                logprobs.extend(choice.logprobs.token_logprobs)
            text += choice.text
            finish = choice.finish_reason or finish
    return tokens, logprobs, text, finish, times, usage


def whole_completion(prompt, seed, max_tokens, stop=None):
    done = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, seed=seed, stop=stop
    )
    choice = done.choices[0]
    return extra(choice, "token_ids"), choice.logprobs.token_logprobs, choice.text, choice.finish_reason, done.usage


LONG = 96
long_prompt = "SELECT name FROM"
seed = next(
    s for s in range(64)
    if whole_completion(long_prompt, s, LONG)[3] == "length"
)
tokens, logprobs, text, finish, usage = whole_completion(long_prompt, seed, LONG)
s_tokens, s_logprobs, s_text, s_finish, times, s_usage = streamed_completion(long_prompt, seed, LONG)
assert (s_tokens, s_logprobs, s_text, s_finish) == (tokens, logprobs, text, finish), (s_text, text)
assert s_usage.completion_tokens == usage.completion_tokens == LONG, (s_usage, usage)
assert len(times) > LONG // 2, f"{len(times)} token chunks for {LONG} tokens"
# The first tokens arrive while the rest are still being decoded. A server that sent the
# chunks in one burst at the end never shows this; a loaded machine (tests in parallel)
# can stall one prefill past half the time, so three tries get the chance to.
for _ in range(2):
    if times[0] < 0.5 * times[-1]:
        break
    times = streamed_completion(long_prompt, seed, LONG)[4]
assert times[0] < 0.5 * times[-1], f"first token at {times[0]:.3f}s, last at {times[-1]:.3f}s"
print(f"streamed {LONG} tokens in {len(times)} chunks: first {times[0]:.3f}s, last {times[-1]:.3f}s")

# A stop string that spans tokens: its text is held back, never sent, and the chunks add
# up to the non-streamed text cut before it.
pieces = client.completions.create(
    model=MODEL, prompt=long_prompt, max_tokens=LONG, seed=seed
).choices[0].logprobs.tokens


def plain(piece):
    return piece.isascii() and piece.isprintable() and piece.strip() != ""


# Two neighbouring tokens of plain text (the embedded model's random weights also emit
# bytes that are no UTF-8): the stop string is their text, so it spans both.
i = next(i for i in range(len(pieces) // 3, len(pieces) - 1) if plain(pieces[i]) and plain(pieces[i + 1]))
stop = pieces[i] + pieces[i + 1]
cut = whole_completion(long_prompt, seed, LONG, stop=[stop])
s_cut = streamed_completion(long_prompt, seed, LONG, stop=[stop])
assert s_cut[:4] == cut[:4], (s_cut[2], cut[2], stop)
assert cut[3] == "stop" and stop not in cut[2], (cut, stop)

# Streams batched with other clients' requests on the engine, each joining the running
# batch at whatever step it arrives: each is its own. Tokens, text and finish exactly; the
# log-probs up to rounding (the CPU GEMM rounds a row a few ulp apart in steps of other
# row counts, as server.md says).
def check_stream(seed):
    whole = whole_completion(long_prompt, seed, 32)
    streamed = streamed_completion(long_prompt, seed, 32)
    assert (streamed[0], streamed[2], streamed[3]) == (whole[0], whole[2], whole[3]), (seed, streamed[2], whole[2])
    assert len(streamed[1]) == len(whole[1]), seed
    assert all(abs(a - b) < 1e-5 for a, b in zip(streamed[1], whole[1])), (seed, streamed[1], whole[1])

with concurrent.futures.ThreadPoolExecutor(4) as pool:
    list(pool.map(check_stream, range(8)))

# A multi-turn tool-call episode renders through the chat template.
tools = [
    {
        "type": "function",
        "function": {
            "name": "run_sql",
            "description": "Run a SQL query",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
]
episode = [{"role": "user", "content": "How many users are there?"}]
first = client.chat.completions.create(
    model=MODEL, messages=episode, tools=tools, max_tokens=4, seed=1
)
episode += [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "run_sql", "arguments": '{"query": "SELECT COUNT(*) FROM users"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "3"},
]
second = client.chat.completions.create(
    model=MODEL, messages=episode, tools=tools, max_tokens=4, seed=1
)
assert len(extra(second, "prompt_token_ids")) > len(extra(first, "prompt_token_ids"))

# Errors arrive as the SDK's exceptions, with OpenAI's error body.
try:
    client.chat.completions.create(model="no-such-model", messages=messages)
    raise AssertionError("an unknown model was accepted")
except openai.NotFoundError as e:
    assert e.body["code"] == "model_not_found", e.body
try:
    client.chat.completions.create(model=MODEL, messages=messages, n=0)
    raise AssertionError("n=0 was accepted")
except openai.BadRequestError as e:
    assert "n 0" in e.body["message"], e.body

print("OpenAI SDK OK")
