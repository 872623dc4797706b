"""The unmodified `openai` SDK against `floe serve`'s /v1 routes (run by tests/openai.rs).

Reads OPENAI_BASE_URL, OPENAI_API_KEY and FLOE_BASE_MODEL. Checks that chat, streamed
chat and completions return the sampled token ids with one log-prob each, that the same
prompt and seed give the same tokens and log-probs on every route, that a multi-turn
tool-call episode renders, and that bad requests raise the SDK's 4xx errors.
"""

import os

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
