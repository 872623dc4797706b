"""tinker-cookbook's RL loop (`rl.train.main`, `ArithmeticDatasetBuilder`,
`importance_sampling`) against `floe serve`, offline, unmodified.

The embedded tiny model starts from random weights, so it never emits the role_colon
stop sequence on its own and every rollout would score the same (-0.1): GRPO would
see no signal. A short supervised warm start through the plain SDK (cross-entropy
on a handful of rendered arithmetic conversations) teaches it the answer format
first; the RL loop then starts from that checkpoint (`load_checkpoint_path`).

Environment: TINKER_BASE_URL, TINKER_API_KEY (the SDK's), FLOE_BASE_MODEL (the
server's name of the model), FLOE_TOKENIZER_DIR (its tokenizer as an HF folder),
FLOE_LOG_DIR, and the sizes FLOE_SFT_STEPS, FLOE_RL_STEPS, FLOE_GROUPS,
FLOE_GROUP_SIZE, FLOE_RL_LR. Prints one line `COOKBOOK_RESULT {json}` with the
reward curve.
"""

import asyncio
import json
import logging
import os
import sys

import numpy as np
import tinker
from transformers import AutoTokenizer

from tinker_cookbook import renderers
from tinker_cookbook.recipes.math_rl.arithmetic_env import (
    ArithmeticDatasetBuilder,
    ArithmeticEnv,
)
from tinker_cookbook.rl import train
from tinker_cookbook.supervised.data import conversation_to_datum
from tinker_cookbook.tokenizer_utils import get_tokenizer, register_tokenizer

BASE_MODEL = os.environ["FLOE_BASE_MODEL"]
TOKENIZER_DIR = os.environ["FLOE_TOKENIZER_DIR"]
LOG_DIR = os.environ["FLOE_LOG_DIR"]
SFT_STEPS = int(os.environ.get("FLOE_SFT_STEPS", "20"))
RL_STEPS = int(os.environ.get("FLOE_RL_STEPS", "12"))
GROUPS = int(os.environ.get("FLOE_GROUPS", "8"))
GROUP_SIZE = int(os.environ.get("FLOE_GROUP_SIZE", "8"))
RL_LR = float(os.environ.get("FLOE_RL_LR", "3e-4"))
RENDERER = "role_colon"
MAX_TOKENS = 8

# The cookbook looks tokenizers up by model name; the server's name is not a Hub id.
register_tokenizer(BASE_MODEL, lambda: AutoTokenizer.from_pretrained(TOKENIZER_DIR))


def warm_start() -> str:
    """Supervised steps on arithmetic conversations; returns the saved state's path."""
    renderer = renderers.get_renderer(RENDERER, tokenizer=get_tokenizer(BASE_MODEL))
    service = tinker.ServiceClient()
    trainer = service.create_lora_training_client(
        base_model=BASE_MODEL,
        rank=8,
        seed=0,
        user_metadata={"renderer_name": RENDERER},
    )
    # Seeds far from the RL dataset's batch indices, so RL problems are unseen.
    rng = np.random.RandomState(10_000)
    for step in range(SFT_STEPS):
        data = []
        for _ in range(16):
            x, y = rng.randint(0, 101), rng.randint(0, 101)
            convo = ArithmeticEnv.standard_fewshot_prefix() + [
                {"role": "user", "content": f"What is {x} + {y}?"},
                {"role": "assistant", "content": str(x + y)},
            ]
            data.append(
                conversation_to_datum(
                    convo,
                    renderer,
                    max_length=None,
                    train_on_what=renderers.TrainOnWhat.LAST_ASSISTANT_MESSAGE,
                )
            )
        fwdbwd = trainer.forward_backward(data, "cross_entropy")
        optim = trainer.optim_step(tinker.AdamParams(learning_rate=3e-3))
        loss = fwdbwd.result().metrics["loss:sum"]
        optim.result()
        print(f"sft step {step}: loss:sum {loss:.3f}", flush=True)
    return trainer.save_state("warm-start").result().path


def reward_curve() -> list[float]:
    """`env/all/reward/total` of every RL step, from the cookbook's metrics.jsonl."""
    rewards = []
    with open(os.path.join(LOG_DIR, "metrics.jsonl")) as lines:
        for line in lines:
            record = json.loads(line)
            if "env/all/reward/total" in record:
                rewards.append(record["env/all/reward/total"])
    return rewards


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    warm = warm_start()
    config = train.Config(
        learning_rate=RL_LR,
        dataset_builder=ArithmeticDatasetBuilder(
            batch_size=GROUPS,
            group_size=GROUP_SIZE,
            model_name_for_tokenizer=BASE_MODEL,
            renderer_name=RENDERER,
            n_batches=RL_STEPS,
        ),
        model_name=BASE_MODEL,
        renderer_name=RENDERER,
        recipe_name="floe_cookbook_ci",
        max_tokens=MAX_TOKENS,
        log_path=LOG_DIR,
        load_checkpoint_path=warm,
        loss_fn="importance_sampling",
        eval_every=0,
        # Periodic saves (named weights + sampler weights, then sampling from them) and
        # rolling saves (each deletes the previous one) on steps that never coincide.
        save_every=5,
        rolling_save_every=3,
        lora_rank=8,
    )
    asyncio.run(train.main(config))
    with open(os.path.join(LOG_DIR, "checkpoints.jsonl")) as lines:
        final_state = [json.loads(line) for line in lines][-1]["state_path"]
    run_id = final_state.removeprefix("tinker://").split("/")[0]
    rest = tinker.ServiceClient().create_rest_client()
    checkpoints = rest.list_checkpoints(run_id).result().checkpoints
    run = rest.get_training_run(run_id).result()
    result = {
        "warm_start": warm,
        "rewards": reward_curve(),
        "run_id": run_id,
        "renderer_name": (run.user_metadata or {}).get("renderer_name"),
        "checkpoints": sorted(c.checkpoint_id for c in checkpoints),
    }
    print("COOKBOOK_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
