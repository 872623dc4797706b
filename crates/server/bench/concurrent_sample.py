"""Tokens/s of N concurrent native `sample` calls against one call with the same N
requests, on one engine of a running `floe serve` (docs/benchmarks.md, "floe serve: one
continuous batch (CPU)"). Standard library only.

    python3 crates/server/bench/concurrent_sample.py --url http://127.0.0.1:8123 --model tiny
"""

import argparse
import json
import threading
import time
import urllib.request


def post(url, body, key):
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-API-Key": key},
    )
    return urllib.request.urlopen(request, timeout=3600)


def sample(url, engine, requests, key):
    """The generations of one native sample call."""
    generations = []
    with post(f"{url}/floe/v1/engines/{engine}/sample", {"requests": requests}, key) as answer:
        for line in answer:
            event = json.loads(line)
            if "generation" in event:
                generations.append(event["generation"])
            elif "done" in event:
                return generations
            else:
                raise RuntimeError(event)
    raise RuntimeError("the stream ended without done")


def request(i, prompt_len, new_tokens):
    return {
        "id": i,
        "prompt": [3 + (i + j) % 50 for j in range(prompt_len)],
        "n": 1,
        "params": {
            "temperature": 1.0,
            "max_new_tokens": new_tokens,
            "seed": 1000 + i,
            "force_full_length": True,
        },
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8123")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--key", default="none")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()

    with post(
        f"{args.url}/floe/v1/engines",
        {"model": {"base_model": args.model}, "settings": {}},
        args.key,
    ) as answer:
        engine = json.load(answer)["engine_id"]
    requests = [request(i, args.prompt_len, args.new_tokens) for i in range(args.requests)]
    sample(args.url, engine, requests[:2], args.key)  # warm-up

    start = time.perf_counter()
    one_call = sample(args.url, engine, requests, args.key)
    one_call_s = time.perf_counter() - start

    results = [None] * len(requests)

    def one(i):
        results[i] = sample(args.url, engine, [requests[i]], args.key)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    concurrent_s = time.perf_counter() - start

    tokens = sum(len(g["tokens"]) for g in one_call)
    by_id = {g["request_id"]: g for g in one_call}
    same_tokens = all(r[0]["tokens"] == by_id[i]["tokens"] for i, r in enumerate(results))
    logprob_diff = max(
        abs(x - y)
        for i, r in enumerate(results)
        for x, y in zip(r[0]["logprobs"], by_id[i]["logprobs"])
    )
    print(
        json.dumps(
            {
                "requests": len(requests),
                "tokens": tokens,
                "one_call_tokens_per_s": round(tokens / one_call_s, 1),
                "concurrent_calls_tokens_per_s": round(tokens / concurrent_s, 1),
                "same_tokens": same_tokens,
                "max_logprob_diff": logprob_diff,
            }
        )
    )
    try:
        with urllib.request.urlopen(
            urllib.request.Request(f"{args.url}/floe/v1/stats", headers={"X-API-Key": args.key})
        ) as answer:
            print(json.dumps(json.load(answer)))
    except urllib.error.HTTPError:
        pass  # a server without the stats route (before batching)


if __name__ == "__main__":
    main()
