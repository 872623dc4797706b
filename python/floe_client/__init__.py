"""floe's engine verbs over HTTP and floe's GRPO losses in plain Python.

``FloeClient(url).create_engine(...)`` gives an :class:`Engine` on a ``floe serve``
server (its native API under ``/floe/v1``); :mod:`floe_client.losses` holds the GRPO
advantages and policy losses of the Rust crate ``floe-rl``.
"""

from .client import (
    CROSS_ENTROPY,
    Engine,
    FloeClient,
    FloeError,
    policy_loss_spec,
    sample_request,
    tinker_loss_spec,
    train_response,
)
from .losses import (
    broadcast_to_tokens,
    grpo_advantages,
    kl_estimate,
    policy_loss,
    surrogate,
    token_weights,
)

__all__ = [
    "CROSS_ENTROPY",
    "Engine",
    "FloeClient",
    "FloeError",
    "broadcast_to_tokens",
    "grpo_advantages",
    "kl_estimate",
    "policy_loss",
    "policy_loss_spec",
    "sample_request",
    "surrogate",
    "tinker_loss_spec",
    "token_weights",
    "train_response",
]
