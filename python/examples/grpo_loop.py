"""A GRPO loop on one page against ``floe serve``, using only ``floe_client``.

The task is a toy with a verifiable reward: a completion's reward is the share of its
tokens whose id lies in the lower half of the vocabulary. Each step samples a group of
completions per prompt, turns rewards into GRPO advantages here in Python, scores the
old log-probs with ``forward`` and updates in two mini-batches with floe's PPO-clip loss
on the server. Before each update it also computes that loss in Python
(``floe_client.policy_loss``) from the current log-probs, and prints how far the two
agree, with how far the sampler's log-probs are from ``forward``'s.

    floe serve --model tiny=embedded:tiny --insecure-loopback &
    PYTHONPATH=python python3 python/examples/grpo_loop.py --url http://127.0.0.1:8000

Prints one JSON line per step, then ``{"summary": ...}``.
"""

import argparse
import json

from floe_client import (
    FloeClient,
    grpo_advantages,
    policy_loss,
    policy_loss_spec,
    sample_request,
    train_response,
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="tiny", help="a base model the server offers")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.prompts < 2:
        parser.error("--prompts must be at least 2 (the step updates in two mini-batches)")

    client = FloeClient(args.url)
    algorithm = {"policy_loss_type": "regular", "loss_reduction": "token_mean",
                 "eps_clip_low": 0.2, "eps_clip_high": 0.2, "use_kl_loss": False}
    history = []
    with client.create_engine(base_model=args.model) as engine:
        vocab = engine.info["vocab_size"]
        prompts_P = [[(7 * p + 3 * i + 1) % vocab for i in range(6)]
                     for p in range(args.prompts)]
        for step in range(1, args.steps + 1):
            requests = [
                sample_request(p, prompt, n=args.group_size, temperature=1.0,
                               max_new_tokens=args.max_new_tokens,
                               seed=args.seed * 1_000_003 + step * 1009 + p)
                for p, prompt in enumerate(prompts_P)
            ]
            generations = sorted(engine.sample(requests),
                                 key=lambda g: (g["request_id"], g["sample_index"]))
            tokens_S = [g["tokens"] for g in generations]
            rewards_S = [sum(t < vocab // 2 for t in tokens) / len(tokens)
                         for tokens in tokens_S]
            group_ids_S = [g["request_id"] for g in generations]
            advantages_S = grpo_advantages(rewards_S, group_ids_S)

            groups = [{"prompt": prompt,
                       "responses": [tokens_S[s] for s in range(len(tokens_S))
                                     if group_ids_S[s] == p]}
                      for p, prompt in enumerate(prompts_P)]
            old_P = engine.forward(groups)
            old_S = [out["logprobs"] for outputs in old_P for out in outputs]
            sampler_gap = max(abs(a - b) for g, old in zip(generations, old_S)
                              for a, b in zip(g["logprobs"], old))

            half = len(groups) // 2
            losses, grad_norms, loss_gaps = [], [], []
            for batch in (range(0, half), range(half, len(groups))):
                train_groups, logprob_groups = [], []
                for p in batch:
                    members = [s for s in range(len(tokens_S)) if group_ids_S[s] == p]
                    train_groups.append({"prompt": prompts_P[p], "responses": [
                        train_response(tokens_S[s], [advantages_S[s]] * len(tokens_S[s]),
                                       old_S[s]) for s in members]})
                    logprob_groups.append(groups[p])
                # The loss in Python, from the log-probs the update is about to see.
                current = [out["logprobs"] for outputs in engine.forward(logprob_groups)
                           for out in outputs]
                responses = [r for g in train_groups for r in g["responses"]]
                expected, _ = policy_loss(
                    [x for lp in current for x in lp],
                    [x for r in responses for x in r["old_logprobs"]],
                    [x for r in responses for x in r["advantages"]],
                    [x for r in responses for x in r["loss_mask"]],
                    [len(r["tokens"]) for r in responses],
                    policy_loss_type=algorithm["policy_loss_type"],
                    loss_reduction=algorithm["loss_reduction"],
                    eps_clip_low=algorithm["eps_clip_low"],
                    eps_clip_high=algorithm["eps_clip_high"])
                loss, _metrics = engine.forward_backward(train_groups,
                                                         policy_loss_spec(**algorithm))
                loss_gaps.append(abs(loss - expected))
                losses.append(loss)
                grad_norms.append(engine.optim_step(lr=args.lr, max_grad_norm=1.0)["grad_norm"])
            engine.sync_sampler_weights()
            record = {"step": step, "reward": sum(rewards_S) / len(rewards_S),
                      "losses": losses, "grad_norms": grad_norms,
                      "loss_gap": max(loss_gaps), "sampler_logprob_gap": sampler_gap}
            history.append(record)
            print(json.dumps(record), flush=True)
    print(json.dumps({"summary": {
        "steps": len(history),
        "first_reward": history[0]["reward"],
        "last_reward": history[-1]["reward"],
        "max_loss_gap": max(r["loss_gap"] for r in history),
        "max_sampler_logprob_gap": max(r["sampler_logprob_gap"] for r in history),
    }}))


if __name__ == "__main__":
    main()
