"""Drives a running `floe serve` with the unmodified tinker SDK (run by tests/sdk.rs).

Environment: TINKER_BASE_URL (the server), TINKER_API_KEY (a `tml-` key it accepts),
FLOE_BASE_MODEL (a served base model name). Exits non-zero on any failed check.
"""

import math
import os
import sys

import tinker
from tinker import types


def datum(tokens):
    """A next-token datum over `tokens`: input tokens[:-1], targets tokens[1:]."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": [1.0] * (len(tokens) - 1),
        },
    )


def main():
    service = tinker.ServiceClient(base_url=os.environ["TINKER_BASE_URL"])
    # A fixed seed: without one the server draws the adapters' A at random (as the SDK
    # documents), and the trajectory below would differ run to run.
    training = service.create_lora_training_client(
        base_model=os.environ["FLOE_BASE_MODEL"], rank=8, seed=5
    ).result()
    info = training.get_info()
    assert info.model_data.model_name == os.environ["FLOE_BASE_MODEL"], info

    batch = [datum([11, 12, 13, 14, 15, 16]), datum([21, 22, 23, 24])]
    positions = 5 + 3
    losses = []
    for _ in range(4):
        result = training.forward_backward(batch, "cross_entropy").result()
        loss = result.metrics["loss:sum"]
        assert len(result.loss_fn_outputs) == 2, result
        logprobs = [result.loss_fn_outputs[i]["logprobs"].tolist() for i in range(2)]
        assert [len(l) for l in logprobs] == [5, 3], logprobs
        # Sum semantics: the loss is minus the summed target log-probs.
        assert abs(loss + sum(sum(l) for l in logprobs)) < 1e-3 * positions, (loss, logprobs)
        losses.append(loss)
        training.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    print("cross_entropy losses:", losses)
    assert all(b < a for a, b in zip(losses, losses[1:])), losses

    # forward scores without a gradient: the trained weights fit the batch better
    # than before the last step.
    scored = training.forward(batch, "cross_entropy").result()
    assert scored.metrics["loss:sum"] < losses[-1], (scored.metrics, losses)

    sampler = training.save_weights_and_get_sampling_client()
    response = sampler.sample(
        prompt=types.ModelInput.from_ints([11, 12, 13]),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=7),
    ).result()
    assert len(response.sequences) == 2, response
    for sequence in response.sequences:
        assert 1 <= len(sequence.tokens) <= 4, sequence
        assert sequence.logprobs is not None and len(sequence.logprobs) == len(sequence.tokens)
        assert all(math.isfinite(l) and l <= 0.0 for l in sequence.logprobs), sequence
        assert sequence.stop_reason in ("stop", "length"), sequence
    print("samples:", [(s.tokens, s.stop_reason) for s in response.sequences])
    # Top-k sample log-probs: a [tokens, k] table per sequence, most likely first; the
    # sampled token's log-prob is at most the best one.
    ranked = sampler.sample(
        prompt=types.ModelInput.from_ints([11, 12, 13]),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=7),
        topk_sample_logprobs=3,
    ).result()
    for sequence in ranked.sequences:
        table = sequence.topk_logprobs_np
        assert table is not None and table.logprobs.shape == (len(sequence.tokens), 3), sequence
        for row, chosen in zip(table.logprobs.tolist(), sequence.logprobs):
            assert row == sorted(row, reverse=True) and row[0] <= 0.0, row
            assert chosen <= row[0] + 1e-4, (chosen, row)
        assert all(len(set(ids)) == 3 for ids in table.token_ids.tolist()), table
        assert len(sequence.topk_logprobs) == len(sequence.tokens), sequence
    try:
        sampler.sample(
            prompt=types.ModelInput.from_ints([11]),
            num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=1),
            topk_sample_logprobs=21,
        ).result()
        raise AssertionError("topk_sample_logprobs=21 was accepted")
    except tinker.BadRequestError as error:
        assert "topk_sample_logprobs" in str(error), error

    # The RL path: importance_sampling on the samples with their sampler log-probs; at
    # ratio 1 the loss is minus the summed advantages of the sampled positions.
    rl_batch = []
    expected = 0.0
    for sequence, advantage in zip(response.sequences, (1.0, -0.5)):
        tokens = [11, 12, 13] + list(sequence.tokens)
        n = len(tokens) - 1
        sampled = len(sequence.tokens)
        rl_batch.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "logprobs": [0.0] * (n - sampled) + list(sequence.logprobs),
                    "advantages": [0.0] * (n - sampled) + [advantage] * sampled,
                },
            )
        )
        expected -= advantage * sampled
    rl = training.forward_backward(rl_batch, "importance_sampling").result()
    assert abs(rl.metrics["loss:sum"] - expected) < 1e-2 * abs(expected) + 1e-3, (rl.metrics, expected)
    # dro over the wire: -sum(logp*A - beta/2*(logp - q)^2) with the model's log-probs of
    # every position (the prompt's too, whose q the batch sets to 0).
    model_logprobs = training.forward(rl_batch, "importance_sampling").result().loss_fn_outputs
    dro_expected = 0.0
    for i, rl_datum in enumerate(rl_batch):
        q = rl_datum.loss_fn_inputs["logprobs"].tolist()
        a = rl_datum.loss_fn_inputs["advantages"].tolist()
        for lp, qt, at in zip(model_logprobs[i]["logprobs"].tolist(), q, a):
            dro_expected -= lp * at - 0.5 * 0.05 * (lp - qt) ** 2
    dro = training.forward(rl_batch, "dro", loss_fn_config={"beta": 0.05}).result()
    assert abs(dro.metrics["loss:sum"] - dro_expected) < 1e-6 * abs(dro_expected) + 1e-6, (
        dro.metrics,
        dro_expected,
    )
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    # Checkpoints: save the state, resume it (weights and AdamW moments) as a new training
    # client, and sample a named sampler checkpoint through its own sampling session.
    before = training.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    state_path = training.save_state("resume-me").result().path
    assert state_path.startswith("tinker://") and state_path.endswith("/weights/resume-me"), state_path
    resumed = service.create_training_client_from_state_with_optimizer(state_path)
    after = resumed.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    assert abs(after - before) < 1e-3 * abs(before), (before, after)
    sampler_path = training.save_weights_for_sampler("snapshot-1").result().path
    checkpoint_sampler = service.create_sampling_client(model_path=sampler_path)
    again = checkpoint_sampler.sample(
        prompt=types.ModelInput.from_ints([11, 12]),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=2, temperature=0.0),
    ).result()
    assert len(again.sequences) == 1 and again.sequences[0].logprobs is not None, again
    print("SDK round trip OK")


if __name__ == "__main__":
    main()
    # The checks passed; leave without the SDK's interpreter teardown, whose background
    # threads have at times ended a passing run with a non-zero status under load.
    sys.stdout.flush()
    os._exit(0)
