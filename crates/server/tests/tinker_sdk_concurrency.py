"""100 concurrent samples through the unmodified tinker SDK on one sampling client of a
server whose engine queue is far smaller (run by tests/faults.rs): the server answers
429 to what does not fit, the SDK backs off and re-submits, and every sample returns.

Environment: TINKER_BASE_URL, TINKER_API_KEY, FLOE_BASE_MODEL.
"""

import asyncio
import os

import tinker
from tinker import types

SAMPLES = 100
MAX_TOKENS = 4


async def main():
    service = tinker.ServiceClient()
    sampler = await service.create_sampling_client_async(base_model=os.environ["FLOE_BASE_MODEL"])
    prompt = types.ModelInput.from_ints([11, 12, 13])
    results = await asyncio.gather(
        *(
            sampler.sample_async(
                prompt, 1, types.SamplingParams(max_tokens=MAX_TOKENS, seed=seed, stop=[])
            )
            for seed in range(SAMPLES)
        )
    )
    lengths = [len(result.sequences[0].tokens) for result in results]
    assert lengths == [MAX_TOKENS] * SAMPLES, lengths
    assert all(len(result.sequences[0].logprobs) == MAX_TOKENS for result in results)
    print(f"{SAMPLES} samples answered")


if __name__ == "__main__":
    asyncio.run(main())
