"""Multi-turn text-to-SQL episodes played through `floe serve`'s OpenAI-compatible `/v1` by
an agent written with the unmodified `openai` SDK, and trained on through the Tinker SDK.

Each episode is floe's multi-turn SQL env (`text2sql_multiturn`, SkyRL-SQL), stepped
through `floe env` (so the observations and the reward are exactly those `floe train`
gets): the model thinks, runs a query as `<sql>...</sql>` and reads the result back as an
observation, and answers with `<solution>...</solution>`. The agent keeps the episode as
token ids, never re-tokenizing text: the first turn goes through `chat.completions` (the
server renders the chat template), later turns through `completions` with the token ids so
far as the prompt; the sampled `token_ids` and their log-probs come back with every turn,
and each observation is spliced in as the tokens floe's trainer would add (the end-of-turn
token when a stop string ended the turn, then the template's user turn and the next
assistant header, from `/v1/tokenize`). The episodes then train the policy being sampled
(a Tinker LoRA training client; `/v1` samples its current weights by its model id) with
the `importance_sampling` loss on the sampler's log-probs and `optim_step`.

Run against a server (`floe serve --model tiny=embedded:tiny`):

    FLOE_API_KEY=tml-... python multiturn_sql_agent.py --server http://127.0.0.1:8000 \
        --model tiny --floe path/to/floe --steps 2

`--check` also asserts what the CI test checks: every turn's tokens and log-probs are what
the engine samples for that prompt and seed (Tinker `sample` of the same weights), the
whole spliced episode scores to the sampled log-probs in one forward pass (no drift across
turns), and training changed the weights.
"""

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile

import openai
import tinker
from tinker import types

SYSTEM = (
    "You answer questions about a SQLite database by writing SQL. Think first in "
    "<think>...</think>. Then either explore with one query in <sql>...</sql> (its result "
    "comes back in <observation>...</observation>), or give the final query in "
    "<solution>...</solution>."
)
STOPS = ["</sql>", "</solution>"]
# The conversation floe's trainer renders observations after (rollout.rs), so that the
# template's rendering of the observation alone can be cut out of it.
BASE_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "I am a user."},
]
# The end-of-turn token of Qwen's chat template (what floe's trainer adds after a turn a
# stop string ended).
END_OF_TURN = "<|im_end|>"

SCHEMA = "CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT, age INTEGER, city TEXT)"
ROWS = [(1, "Ann", 34, "Oslo"), (2, "Bo", 27, "Lima"), (3, "Cy", 45, "Oslo"), (4, "Di", 19, "Rome")]
QUESTIONS = [
    ("How many users are there?", "SELECT COUNT(*) FROM users"),
    ("Which users live in Oslo?", "SELECT name FROM users WHERE city = 'Oslo'"),
    ("What is the age of the oldest user?", "SELECT MAX(age) FROM users"),
]


def make_database(path):
    with sqlite3.connect(path) as db:
        db.execute(SCHEMA)
        db.executemany("INSERT INTO users VALUES (?, ?, ?, ?)", ROWS)


class FloeEnv:
    """An env of floe's, stepped through `floe env` (JSON lines on its stdin/stdout)."""

    def __init__(self, floe):
        self.process = subprocess.Popen(
            [floe, "env"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def call(self, command):
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        answer = json.loads(self.process.stdout.readline())
        if "error" in answer:
            raise RuntimeError(f"floe env: {answer['error']}")
        return answer

    def reset(self, env_class, prompt, extras):
        return self.call({"reset": {"env_class": env_class, "prompt": prompt, "extras": extras}})["prompt"]

    def step(self, text):
        return self.call({"step": text})

    def close(self):
        self.process.stdin.close()
        self.process.wait()


def extra(obj, name):
    """A floe extension field of an SDK object (the SDK keeps unknown fields)."""
    value = getattr(obj, name, None)
    if value is None and obj.model_extra:
        value = obj.model_extra.get(name)
    assert value is not None, f"{name} missing from {obj}"
    return value


class Agent:
    def __init__(self, client, model, max_tokens, max_turns):
        self.client = client
        self.model = model
        self.max_tokens = max_tokens
        self.max_turns = max_turns
        [self.end_of_turn] = self.tokenize(prompt=END_OF_TURN, add_special_tokens=False)["tokens"]
        self.base_text = self.tokenize(messages=BASE_CONVERSATION, add_generation_prompt=False)["prompt"]

    def tokenize(self, **body):
        return self.client.post("/tokenize", cast_to=object, body={"model": self.model, **body})

    def observation_tokens(self, messages):
        """The tokens after an assistant turn's end token for `messages` (the next user
        turn and assistant header), as floe's trainer makes them."""
        with_text = self.tokenize(messages=BASE_CONVERSATION + messages)["prompt"]
        assert with_text.startswith(self.base_text), "the template re-renders the base"
        tail = with_text[len(self.base_text):]
        return self.tokenize(prompt="\n" + tail, add_special_tokens=False)["tokens"]

    def sample_turn(self, messages, context, seed):
        """One assistant turn: (token ids, log-probs, text)."""
        params = dict(
            model=self.model, max_tokens=self.max_tokens, seed=seed, temperature=1.0,
            stop=STOPS, extra_body={"include_stop_str_in_output": True},
        )
        if messages is not None:
            reply = self.client.chat.completions.create(messages=messages, logprobs=True, **params)
            choice = reply.choices[0]
            logprobs = [t.logprob for t in choice.logprobs.content]
            text = choice.message.content
        else:
            reply = self.client.completions.create(prompt=context, **params)
            choice = reply.choices[0]
            logprobs = choice.logprobs.token_logprobs
            text = choice.text
            # The server sampled after exactly the ids the agent holds.
            assert extra(reply, "prompt_token_ids") == context
        return extra(reply, "prompt_token_ids"), extra(choice, "token_ids"), logprobs, text

    def play(self, env, question, db_path, gold, seed):
        """One episode: its prompt ids, then every token after it with its loss mask and
        log-prob (observations masked out), its reward and its turns."""
        prompt = env.reset(
            "text2sql_multiturn",
            [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": f"Database schema:\n{SCHEMA}\n\nQuestion: {question}"}],
            {"db_path": db_path, "reward_spec": {"ground_truth": gold}, "max_turns": self.max_turns},
        )
        episode = {"response": [], "mask": [], "logprobs": [], "turns": [], "reward": 0.0}
        context = None
        for turn in range(self.max_turns):
            turn_seed = seed * 16 + turn
            prompt_ids, ids, logprobs, text = self.sample_turn(
                prompt if turn == 0 else None, context, turn_seed
            )
            if turn == 0:
                episode["prompt"] = prompt_ids
                context = list(prompt_ids)
            episode["turns"].append({"prompt": list(context), "tokens": ids, "logprobs": logprobs, "seed": turn_seed})
            episode["response"] += ids
            episode["mask"] += [1.0] * len(ids)
            episode["logprobs"] += logprobs
            context += ids
            step = env.step(text)
            episode["reward"] += step["reward"]
            if step["done"]:
                break
            observation = [] if ids and ids[-1] == self.end_of_turn else [self.end_of_turn]
            observation += self.observation_tokens(step["observations"])
            episode["response"] += observation
            episode["mask"] += [0.0] * len(observation)
            episode["logprobs"] += [0.0] * len(observation)
            context += observation
        return episode


def datum(episode, advantage):
    """The episode as a Tinker datum for `importance_sampling`: the sampled tokens carry
    the advantage, the prompt and the observations none."""
    tokens = episode["prompt"] + episode["response"]
    before = len(episode["prompt"]) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * before + episode["logprobs"],
            "advantages": [0.0] * before + [advantage * m for m in episode["mask"]],
        },
    )


def check_sampled(training, agent, episodes):
    """Every turn's tokens and log-probs are what the engine samples for its prompt and
    seed, and the spliced episode scores to them in one forward pass."""
    sampler = training.save_weights_and_get_sampling_client().result()
    for episode in episodes:
        for turn in episode["turns"]:
            again = sampler.sample(
                prompt=types.ModelInput.from_ints(turn["prompt"]),
                num_samples=1,
                sampling_params=types.SamplingParams(
                    max_tokens=agent.max_tokens, seed=turn["seed"], temperature=1.0, stop=STOPS
                ),
            ).result().sequences[0]
            assert list(again.tokens) == turn["tokens"], (again.tokens, turn["tokens"])
            assert list(again.logprobs) == turn["logprobs"], (again.logprobs, turn["logprobs"])
    scored = training.forward([datum(e, 0.0) for e in episodes], "importance_sampling").result()
    worst = 0.0
    for episode, out in zip(episodes, scored.loss_fn_outputs):
        model = out["logprobs"].tolist()[len(episode["prompt"]) - 1:]
        for lp, sampled, m in zip(model, episode["logprobs"], episode["mask"]):
            if m:
                worst = max(worst, abs(lp - sampled))
    assert worst < 1e-3, f"the spliced episodes score {worst} away from their sampled log-probs"
    return worst


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True, help="floe serve's root, http://host:port")
    parser.add_argument("--model", required=True, help="a base model the server offers")
    parser.add_argument("--floe", default="floe", help="the floe binary (for `floe env`)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--group", type=int, default=2, help="episodes per question")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per turn")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--check", action="store_true", help="assert what the CI test checks")
    args = parser.parse_args()
    key = os.environ["FLOE_API_KEY"]

    service = tinker.ServiceClient(base_url=args.server, api_key=key)
    training = service.create_lora_training_client(base_model=args.model, rank=8, seed=1).result()
    model_id = training.get_info().model_id
    client = openai.OpenAI(base_url=f"{args.server}/v1", api_key=key)
    agent = Agent(client, model_id, args.max_tokens, args.max_turns)
    env = FloeEnv(args.floe)
    work = tempfile.mkdtemp(prefix="floe-sql-agent-")
    db_path = os.path.join(work, "users.sqlite")
    make_database(db_path)

    # Advantages: reward minus a running mean of past rewards (a group baseline carries no
    # signal while every episode scores alike, as an untrained model's do).
    baseline = 0.0
    for step in range(args.steps):
        episodes = [
            agent.play(env, question, db_path, gold, seed=(step * 100 + q) * args.group + k)
            for q, (question, gold) in enumerate(QUESTIONS)
            for k in range(args.group)
        ]
        rewards = [e["reward"] for e in episodes]
        mean = sum(rewards) / len(rewards)
        if args.check:
            worst = check_sampled(training, agent, episodes)
            print(f"step {step}: sampled tokens and log-probs check out (scored within {worst:.1e})")
            tokens = episodes[0]["prompt"] + episodes[0]["response"]
            probe = [types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
            )]
            before = training.forward(probe, "cross_entropy").result().metrics["loss:sum"]
        batch = [datum(e, e["reward"] - baseline) for e in episodes]
        result = training.forward_backward(batch, "importance_sampling").result()
        training.optim_step(types.AdamParams(learning_rate=args.lr)).result()
        if args.check:
            after = training.forward(probe, "cross_entropy").result().metrics["loss:sum"]
            assert after != before, "the optimizer step left the weights as they were"
        baseline = 0.5 * baseline + 0.5 * mean
        turns = sum(len(e["turns"]) for e in episodes) / len(episodes)
        print(
            f"step {step}: {len(episodes)} episodes, mean reward {mean:.3f}, "
            f"{turns:.2f} turns each, loss {result.metrics['loss:sum']:.4f}"
        )
    env.close()
    print("multi-turn SQL agent OK")


if __name__ == "__main__":
    main()
    # Leave without the Tinker SDK's interpreter teardown (its background threads).
    sys.stdout.flush()
    os._exit(0)
