#!/usr/bin/env python3
"""floe against the PyTorch peer: reads the `RESULT {...}` lines that `floe bench` and
peer_torch.py print (e.g. device_bench.sh's bench.log) and prints floe/peer for each
(mode, model, batch) both measured."""
import json
import sys


def main(path):
    floe, peer = {}, {}
    for line in open(path, encoding="utf-8"):
        if not line.startswith("RESULT "):
            continue
        r = json.loads(line[len("RESULT "):])
        rate = r.get("tok_s", r.get("new_tok_s"))
        key = (r["mode"], r["model"], r["batch"])
        (peer if "gpu" in r else floe)[key] = rate
    for key in sorted(floe.keys() & peer.keys()):
        mode, model, batch = key
        unit = "tokens/s" if mode == "train" else "new tokens/s"
        print(f"ratio {mode} {model} batch {batch}: floe {floe[key]:,.0f} / peer {peer[key]:,.0f} "
              f"{unit} = {floe[key] / peer[key]:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1])
