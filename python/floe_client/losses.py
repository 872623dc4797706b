"""floe's GRPO advantages and policy losses in plain Python (no numpy, no torch).

The same formulas as the Rust crate `floe-rl` (`advantage.rs`, `policy_loss.rs`,
`reduction.rs`, `kl.rs`, `loss.rs`), so a driver that computes its own loss gets the
numbers floe's engine would. Tokens of a mini-batch lie end to end: every per-token list
has length ``sum(seq_lens)``; names end in ``_s`` (per sequence) or ``_t`` (per token).
"""

import math

#: Added to the group's standard deviation in GRPO's normalisation.
GRPO_STD_EPSILON = 1e-6
#: Clamp of every log-ratio before ``exp``.
LOG_RATIO_CLAMP = 20.0
#: Clamp of the k3 KL value.
K3_VALUE_CLAMP = 10.0

POLICY_LOSSES = ("regular", "dual_clip", "cispo", "importance_sampling", "cross_entropy")
REDUCTIONS = (
    "token_mean",
    "sequence_mean",
    "seq_mean_token_sum_norm",
    "seq_mean_token_sum",
    "prompt_mean",
)
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")


def grpo_advantages(scores_s, group_ids, norm_by_std=True, epsilon=GRPO_STD_EPSILON):
    """One advantage per sequence: ``(r - mean_g) / (std_g + epsilon)``.

    ``std_g`` is the unbiased (n - 1) standard deviation of the sequence's group; a group
    of one sample uses mean 0 and std 1. Without ``norm_by_std``: ``r - mean_g``.
    """
    if len(scores_s) != len(group_ids):
        raise ValueError(
            f"{len(scores_s)} scores but {len(group_ids)} group ids; give one per sequence"
        )
    members = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    advantages_s = [0.0] * len(scores_s)
    for idx in members.values():
        if len(idx) == 1:
            mean, std = 0.0, 1.0
        else:
            n = len(idx)
            mean = sum(scores_s[i] for i in idx) / n
            var = sum((scores_s[i] - mean) ** 2 for i in idx) / (n - 1)
            std = math.sqrt(var)
        for i in idx:
            if norm_by_std:
                advantages_s[i] = (scores_s[i] - mean) / (std + epsilon)
            else:
                advantages_s[i] = scores_s[i] - mean
    return advantages_s


def broadcast_to_tokens(values_s, seq_lens, mask_t=None):
    """Each sequence's value on each of its tokens (times the mask when given)."""
    _check_seqs(values_s, seq_lens, "values_s")
    out_t = []
    for value, n in zip(values_s, seq_lens):
        out_t.extend([value] * n)
    if mask_t is not None:
        _check_tokens(mask_t, seq_lens, "mask_t")
        out_t = [v * m for v, m in zip(out_t, mask_t)]
    return out_t


def token_weights(reduction, loss_mask_t, seq_lens, group_ids=None, max_seq_len=None):
    """``w_t * mask_t`` of each token under ``reduction`` over the whole mini-batch.

    Sequences with no valid token get weight 0 rather than a division by zero.
    """
    _check_tokens(loss_mask_t, seq_lens, "loss_mask_t")
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; expected one of {REDUCTIONS}")
    if group_ids is None:
        group_ids = list(range(len(seq_lens)))
    _check_seqs(group_ids, seq_lens, "group_ids")
    if reduction == "seq_mean_token_sum_norm" and max_seq_len is None:
        raise ValueError("seq_mean_token_sum_norm needs max_seq_len")
    num_tokens = sum(loss_mask_t)
    b = len(seq_lens)
    group_tokens = {}
    for (start, end), g in zip(_ranges(seq_lens), group_ids):
        group_tokens[g] = group_tokens.get(g, 0.0) + sum(loss_mask_t[start:end])
    p = len(group_tokens)
    weights_t = [0.0] * len(loss_mask_t)
    for (start, end), g in zip(_ranges(seq_lens), group_ids):
        if reduction == "token_mean":
            w = _safe_inv(num_tokens)
        elif reduction == "sequence_mean":
            w = _safe_inv(b * sum(loss_mask_t[start:end]))
        elif reduction == "seq_mean_token_sum_norm":
            w = _safe_inv(b * max_seq_len)
        elif reduction == "seq_mean_token_sum":
            w = _safe_inv(b)
        else:
            w = _safe_inv(p * group_tokens[g])
        for t in range(start, end):
            weights_t[t] = w * loss_mask_t[t]
    return weights_t


def surrogate(loss, logprob, old_logprob, advantage, eps_clip_low=0.2, eps_clip_high=0.2,
              clip_ratio_c=3.0, cispo_eps_clip_low=1.0, cispo_eps_clip_high=4.0):
    """One token's surrogate loss ``l`` and ``dl/dlogprob`` under ``loss``."""
    if loss not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {loss!r}; expected one of {POLICY_LOSSES}")
    if loss == "cross_entropy":
        return -logprob, -1.0
    log_ratio = logprob - old_logprob
    clamped = min(max(log_ratio, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)
    r = math.exp(clamped)
    dr = r if clamped == log_ratio else 0.0
    if loss == "importance_sampling":
        return -advantage * r, -advantage * dr
    if loss == "cispo":
        low, high = 1.0 - cispo_eps_clip_low, 1.0 + cispo_eps_clip_high
        weight = min(max(r, low), high)
        return -advantage * weight * logprob, -advantage * weight
    low, high = 1.0 - eps_clip_low, 1.0 + eps_clip_high
    unclipped = -advantage * r
    clipped = -advantage * min(max(r, low), high)
    # The clipped term wins only strictly outside the bounds, where it is constant in r.
    if clipped > unclipped:
        value, grad = clipped, 0.0
    else:
        value, grad = unclipped, -advantage * dr
    if loss == "dual_clip":
        bound = -clip_ratio_c * advantage
        if advantage < 0.0 and value > bound:
            return bound, 0.0
    return value, grad


def kl_estimate(estimator, logprob, ref_logprob):
    """One token's KL estimate against the reference and its derivative in ``logprob``."""
    delta = logprob - ref_logprob
    if estimator == "k1":
        return delta, 1.0
    if estimator == "abs":
        return abs(delta), (0.0 if delta == 0 else math.copysign(1.0, delta))
    if estimator == "k2":
        return 0.5 * delta * delta, delta
    if estimator == "k3":
        clamped = min(max(delta, -LOG_RATIO_CLAMP), LOG_RATIO_CLAMP)
        value = math.exp(-clamped) + clamped - 1.0
        if clamped != delta or abs(value) > K3_VALUE_CLAMP:
            grad = 0.0
        else:
            grad = 1.0 - math.exp(-clamped)
        return min(max(value, -K3_VALUE_CLAMP), K3_VALUE_CLAMP), grad
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def policy_loss(logprobs_t, old_logprobs_t, advantages_t, loss_mask_t, seq_lens,
                group_ids=None, policy_loss_type="regular", loss_reduction="token_mean",
                eps_clip_low=0.2, eps_clip_high=0.2, clip_ratio_c=3.0,
                cispo_eps_clip_low=1.0, cispo_eps_clip_high=4.0, max_seq_len=None,
                ref_logprobs_t=None, kl_loss_coef=0.0, kl_estimator_type="k3"):
    """floe's policy loss of one mini-batch: ``(loss, dloss/dlogprob per token)``.

    ``L = sum_t w_t * l_t + kl_loss_coef * sum_t v_t * kl_t`` with the reduction's
    weights ``w_t`` and the KL's per-sequence token mean ``v_t = mask_t / (B * n_i)``.
    The same as the engine's ``{"Policy": {...}}`` loss without entropy bonus or
    off-policy correction.
    """
    for name, values in (("logprobs_t", logprobs_t), ("old_logprobs_t", old_logprobs_t),
                         ("advantages_t", advantages_t)):
        _check_tokens(values, seq_lens, name)
    weights_t = token_weights(loss_reduction, loss_mask_t, seq_lens, group_ids, max_seq_len)
    loss = 0.0
    grads_t = [0.0] * len(weights_t)
    for t, w in enumerate(weights_t):
        if w == 0.0:
            continue
        value, grad = surrogate(
            policy_loss_type, logprobs_t[t], old_logprobs_t[t], advantages_t[t],
            eps_clip_low=eps_clip_low, eps_clip_high=eps_clip_high, clip_ratio_c=clip_ratio_c,
            cispo_eps_clip_low=cispo_eps_clip_low, cispo_eps_clip_high=cispo_eps_clip_high)
        loss += w * value
        grads_t[t] = w * grad
    if ref_logprobs_t is not None and kl_loss_coef != 0.0:
        _check_tokens(ref_logprobs_t, seq_lens, "ref_logprobs_t")
        b = len(seq_lens)
        kl = 0.0
        for start, end in _ranges(seq_lens):
            v = _safe_inv(b * sum(loss_mask_t[start:end]))
            for t in range(start, end):
                if loss_mask_t[t] == 0.0:
                    continue
                value, grad = kl_estimate(kl_estimator_type, logprobs_t[t], ref_logprobs_t[t])
                kl += v * loss_mask_t[t] * value
                grads_t[t] += kl_loss_coef * v * loss_mask_t[t] * grad
        loss += kl_loss_coef * kl
    return loss, grads_t


def _ranges(seq_lens):
    start = 0
    for n in seq_lens:
        yield start, start + n
        start += n


def _safe_inv(x):
    return 0.0 if x == 0 else 1.0 / x


def _check_tokens(values, seq_lens, name):
    if len(values) != sum(seq_lens):
        raise ValueError(f"{name} has {len(values)} entries; seq_lens sum to {sum(seq_lens)}")


def _check_seqs(values, seq_lens, name):
    if len(values) != len(seq_lens):
        raise ValueError(f"{name} has {len(values)} entries for {len(seq_lens)} sequences")
