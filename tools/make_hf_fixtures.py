#!/usr/bin/env python3
"""Hugging Face parity fixtures for floe's model layer, and checks of what floe writes.

Needs torch and transformers (the GPU machine has both; everything runs on its CPU in
float64, so no GPU is used). Three modes:

  # 1. Make the fixtures: tiny random Qwen3 (f32, tied, explicit head_dim), Qwen2 (bf16,
  #    untied, qkv bias) and Llama (bf16, untied, llama3 RoPE scaling) models saved with
  #    save_pretrained, plus hf_parity.json: per-token log-probs of the next token for
  #    sequences of unequal lengths and 16-token greedy continuations, computed in float64
  #    from the saved (reloaded) weights. Writes OUT/fixtures.tar.
  python3 tools/make_hf_fixtures.py --out OUT

  # 2. Check a folder of models floe saved (sub-folders named after fixtures, optionally
  #    with a suffix, e.g. qwen3_tiny.sharded): transformers loads each and its log-probs
  #    must equal the fixture's.
  python3 tools/make_hf_fixtures.py --check-floe-save DIR --fixtures crates/model/tests/fixtures

  # 3. Check a tokenizer folder floe saved: AutoTokenizer loads it, and its encodings and
  #    chat-template renderings equal floe's, recorded in DIR/floe_expected.json.
  python3 tools/make_hf_fixtures.py --check-tokenizer DIR

  # 4. On the GPU: a random Qwen3 of the 0.6B shape saved in bf16 to DIR/model, and
  #    DIR/expected.json with next-token log-probs of a packed batch of random sequences,
  #    computed by transformers in float32 and in bf16 from the saved weights. floe's CUDA
  #    side: FLOE_HF_PARITY_DIR=DIR cuda_transformer --ignored hf_parity_at_0_6b.
  python3 tools/make_hf_fixtures.py --scale-parity DIR

Bump FIXTURE_VERSION whenever the fixture format or content changes; the Rust test
refuses other versions and prints the command above.
"""
import argparse
import json
import math
import os
import sys
import tarfile
import tempfile

FIXTURE_VERSION = 1
SEQ_LENGTHS = [2, 9, 24, 40]
PROMPT_LENGTHS = [4, 7]
NEW_TOKENS = 16
VOCAB = 256

MODELS = {
    "qwen3_tiny": dict(arch="qwen3", dtype="float32", tie=True),
    "qwen2_tiny": dict(arch="qwen2", dtype="bfloat16", tie=False),
    "llama_tiny": dict(arch="llama", dtype="bfloat16", tie=False),
}


def build_config(arch, tie):
    import transformers as tf

    major = int(tf.__version__.split(".")[0])
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=tie)
    if arch == "qwen3":
        # head_dim 32 differs from hidden / heads = 16, as in real Qwen3 models.
        return tf.Qwen3Config(head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6, bos_token_id=1,
                              eos_token_id=2, **common)
    if arch == "qwen2":
        return tf.Qwen2Config(rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=None,
                              eos_token_id=[1, 2], **common)
    # llama3 RoPE scaling with a short original context, so it changes several frequencies.
    scaling = dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)
    if major >= 5:
        rope = dict(rope_parameters=dict(rope_theta=10000.0, **scaling))
    else:
        rope = dict(rope_theta=10000.0, rope_scaling=scaling)
    return tf.LlamaConfig(rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, **rope, **common)


def build_model(arch, tie, seed):
    import torch
    import transformers as tf

    cfg = build_config(arch, tie)
    cfg._attn_implementation = "eager"
    cls = {"qwen3": tf.Qwen3ForCausalLM, "qwen2": tf.Qwen2ForCausalLM,
           "llama": tf.LlamaForCausalLM}[arch]
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    # Weights large enough that the next-token distributions are peaked (transformers'
    # init of std 0.02 gives nearly uniform log-probs, which would test little).
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name or name.startswith("lm_head"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[1]))
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None, "Qwen2 lost its qkv bias"
    return model


def load_f64(path):
    import torch
    import transformers as tf

    try:
        model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                        attn_implementation="eager")
    except TypeError:
        model = tf.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float64,
                                                        attn_implementation="eager")
    return model.eval()


def next_token_logprobs(model, ids):
    """log p(ids[t+1] | ids[..=t]) for t < len(ids) - 1, in float64."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[t, ids[t + 1]].item() for t in range(len(ids) - 1)]


def greedy(model, prompt, new_tokens):
    """Greedy continuation (argmax, lowest id on ties) and the smallest top-1/top-2 gap."""
    import torch

    ids, min_gap = list(prompt), math.inf
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
            top = torch.topk(logits, 2).values
            min_gap = min(min_gap, (top[0] - top[1]).item())
            ids.append(int(torch.argmax(logits).item()))
    return ids[len(prompt):], min_gap


def make(out):
    import torch
    import transformers as tf

    gen = torch.Generator().manual_seed(1234)
    sequences = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in SEQ_LENGTHS]
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    fixture = {"version": FIXTURE_VERSION, "generator": "tools/make_hf_fixtures.py",
               "torch": torch.__version__, "transformers": tf.__version__,
               "sequences": sequences, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for seed, (name, spec) in enumerate(MODELS.items()):
            model = build_model(spec["arch"], spec["tie"], seed)
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
            path = os.path.join(tmp, name)
            model.to(dtype).save_pretrained(path)
            # Everything below comes from the files as saved (bf16 rounding included).
            ref = load_f64(path)
            rotary = getattr(ref.model, "rotary_emb", None)
            fixture["models"][name] = {
                "dir": name,
                "architecture": type(ref).__name__,
                "dtype": spec["dtype"],
                "tie_word_embeddings": spec["tie"],
                "logprobs": [next_token_logprobs(ref, s) for s in sequences],
                "greedy": [],
                "inv_freq": rotary.inv_freq.double().tolist() if rotary is not None else None,
            }
            for p in prompts:
                cont, gap = greedy(ref, p, NEW_TOKENS)
                fixture["models"][name]["greedy"].append(
                    {"prompt": p, "continuation": cont, "min_top2_gap": gap})
            print(f"{name}: files {sorted(os.listdir(path))}, min greedy gap "
                  f"{min(g['min_top2_gap'] for g in fixture['models'][name]['greedy']):.4f}")
        with open(os.path.join(tmp, "hf_parity.json"), "w") as f:
            json.dump(fixture, f, indent=1)
            f.write("\n")
        os.makedirs(out, exist_ok=True)
        with tarfile.open(os.path.join(out, "fixtures.tar"), "w") as tar:
            tar.add(os.path.join(tmp, "hf_parity.json"), arcname="hf_parity.json")
            for name in MODELS:
                for file in sorted(os.listdir(os.path.join(tmp, name))):
                    tar.add(os.path.join(tmp, name, file), arcname=f"{name}/{file}")
    print("wrote", os.path.join(out, "fixtures.tar"))


def check_floe_save(root, fixtures):
    with open(os.path.join(fixtures, "hf_parity.json")) as f:
        fixture = json.load(f)
    checked, worst = 0, 0.0
    for entry in sorted(os.listdir(root)):
        # A folder is named after its fixture, optionally with a suffix: qwen3_tiny.sharded.
        name = entry.split(".")[0]
        expected = fixture["models"].get(name)
        path = os.path.join(root, entry)
        if expected is None or not os.path.isdir(path):
            continue
        model = load_f64(path)
        assert type(model).__name__ == expected["architecture"], (name, type(model).__name__)
        diff = max(abs(a - b)
                   for seq, want in zip(fixture["sequences"], expected["logprobs"])
                   for a, b in zip(next_token_logprobs(model, seq), want))
        print(f"{entry}: transformers loads floe's save as {type(model).__name__}; "
              f"max |logprob - fixture| = {diff:.3e}")
        worst, checked = max(worst, diff), checked + 1
    if checked == 0:
        sys.exit(f"no fixture-named folders under {root}")
    if worst > 1e-6:
        sys.exit(f"FAIL: floe-saved models differ from the fixtures by {worst:.3e}")
    print(f"OK: {checked} floe-saved models match")


def check_tokenizer(root):
    import transformers as tf

    with open(os.path.join(root, "floe_expected.json")) as f:
        expected = json.load(f)
    tok = tf.AutoTokenizer.from_pretrained(root)
    failures = 0
    for case in expected["encode"]:
        got = tok.encode(case["text"], add_special_tokens=False)
        if got != case["ids"]:
            failures += 1
            print(f"encode mismatch for {case['text']!r}: hf {got} floe {case['ids']}")
        back = tok.decode(case["ids"], skip_special_tokens=False)
        if back != case["text"]:
            failures += 1
            print(f"decode mismatch: hf {back!r} floe {case['text']!r}")
    for case in expected["chat"]:
        got = tok.apply_chat_template(case["messages"], tokenize=False,
                                      add_generation_prompt=case["add_generation_prompt"],
                                      **case["extra"])
        if got != case["rendered"]:
            failures += 1
            print(f"chat mismatch:\n hf   {got!r}\n floe {case['rendered']!r}")
    for key in ("eos_token", "pad_token"):
        if getattr(tok, key) != expected[key]:
            failures += 1
            print(f"{key}: hf {getattr(tok, key)!r} floe {expected[key]!r}")
    print(f"tokenizer: vocab {len(tok)}, {len(expected['encode'])} encodings, "
          f"{len(expected['chat'])} chat renderings, {failures} mismatches")
    if failures:
        sys.exit("FAIL: tokenizer check")
    print("OK: transformers agrees with floe's tokenizer and chat template")


SCALE_SEQ_LENGTHS = [2048, 1000, 517, 300, 129, 40]


def scale_parity(out):
    import torch
    import transformers as tf

    cfg = tf.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                         num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                         max_position_embeddings=40960, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(cfg).to(torch.float32)
    # Peaked next-token distributions, as for the tiny fixtures (transformers' own init
    # gives nearly uniform log-probs); smaller per-layer scale keeps 28 layers stable.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.5 * noise / math.sqrt(p.shape[1]))
    model_dir = os.path.join(out, "model")
    model.to(torch.bfloat16).save_pretrained(model_dir)
    del model
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
            for n in SCALE_SEQ_LENGTHS]
    expected = dict(sequences=seqs)
    for dtype, key in [(torch.float32, "logprobs_f32"), (torch.bfloat16, "logprobs_bf16")]:
        m = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                    attn_implementation="sdpa").cuda().eval()
        rows = []
        with torch.no_grad():
            for ids in seqs:
                logits = m(input_ids=torch.tensor([ids], device="cuda")).logits[0].float()
                logp = torch.log_softmax(logits, dim=-1)
                target = torch.tensor(ids[1:], device="cuda")
                rows.append(logp[:-1].gather(1, target[:, None])[:, 0].double().tolist())
        expected[key] = rows
        del m
        torch.cuda.empty_cache()
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f)
    flat = [x for r in expected["logprobs_f32"] for x in r]
    diff = [abs(a - b) for ra, rb in zip(expected["logprobs_f32"], expected["logprobs_bf16"])
            for a, b in zip(ra, rb)]
    print(f"scale parity: {len(flat)} log-probs, f32 mean {sum(flat) / len(flat):.3f}, "
          f"min {min(flat):.3f}; transformers bf16 vs f32: max {max(diff):.4f}, "
          f"mean {sum(diff) / len(diff):.5f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", help="folder for fixtures.tar")
    p.add_argument("--check-floe-save", metavar="DIR")
    p.add_argument("--fixtures", default="crates/model/tests/fixtures")
    p.add_argument("--check-tokenizer", metavar="DIR")
    p.add_argument("--scale-parity", metavar="DIR")
    args = p.parse_args()
    if not (args.out or args.check_floe_save or args.check_tokenizer or args.scale_parity):
        p.error("give --out, --check-floe-save, --check-tokenizer or --scale-parity")
    if args.scale_parity:
        scale_parity(args.scale_parity)
    if args.out:
        make(args.out)
    if args.check_floe_save:
        check_floe_save(args.check_floe_save, args.fixtures)
    if args.check_tokenizer:
        check_tokenizer(args.check_tokenizer)


if __name__ == "__main__":
    main()
