"""floe_client.losses on hand-computed numbers (no server needed)."""

import math
import unittest

from floe_client.losses import (
    broadcast_to_tokens,
    grpo_advantages,
    kl_estimate,
    policy_loss,
    surrogate,
    token_weights,
)


class GrpoAdvantages(unittest.TestCase):
    def test_groups_normalise_by_their_unbiased_std(self):
        adv = grpo_advantages([1.0, 0.0, 0.5, 0.5, 2.0], [0, 0, 1, 1, 2])
        std = math.sqrt(0.5)  # (0.25 + 0.25) / (2 - 1)
        self.assertAlmostEqual(adv[0], 0.5 / (std + 1e-6), places=12)
        self.assertAlmostEqual(adv[1], -0.5 / (std + 1e-6), places=12)
        # Equal rewards give exactly 0; a group of one uses mean 0 and std 1.
        self.assertEqual(adv[2:4], [0.0, 0.0])
        self.assertAlmostEqual(adv[4], 2.0 / (1.0 + 1e-6), places=12)

    def test_without_std_only_the_mean_is_removed(self):
        self.assertEqual(grpo_advantages([1.0, 0.0], [7, 7], norm_by_std=False), [0.5, -0.5])

    def test_mismatched_lengths_are_named(self):
        with self.assertRaisesRegex(ValueError, "2 scores but 1 group ids"):
            grpo_advantages([1.0, 0.0], [0])

    def test_broadcast(self):
        self.assertEqual(broadcast_to_tokens([2.0, -1.0], [2, 1], [1.0, 0.0, 1.0]),
                         [2.0, 0.0, -1.0])


class Reductions(unittest.TestCase):
    # Sequences of 1 and 3 tokens, the last one masked: 3 valid tokens.
    mask = [1.0, 1.0, 1.0, 0.0]

    def weights(self, reduction, group_ids=(1, 2), **kw):
        return token_weights(reduction, self.mask, [1, 3], group_ids=list(group_ids), **kw)

    def test_each_reduction(self):
        third = 1.0 / 3
        self.assertEqual(self.weights("token_mean"), [third, third, third, 0.0])
        self.assertEqual(self.weights("sequence_mean"), [0.5, 0.25, 0.25, 0.0])
        self.assertEqual(self.weights("seq_mean_token_sum"), [0.5, 0.5, 0.5, 0.0])
        self.assertEqual(self.weights("seq_mean_token_sum_norm", max_seq_len=4),
                         [0.125, 0.125, 0.125, 0.0])
        # One prompt group holding all 3 tokens, then two groups as the sequences.
        self.assertEqual(self.weights("prompt_mean", group_ids=(5, 5)),
                         [third, third, third, 0.0])
        self.assertEqual(self.weights("prompt_mean"), [0.5, 0.25, 0.25, 0.0])

    def test_unknown_reduction_is_named(self):
        with self.assertRaisesRegex(ValueError, "unknown reduction 'mean'"):
            self.weights("mean")


class Surrogates(unittest.TestCase):
    def test_ppo_clip(self):
        # r = e^0.5 > 1.2 with A > 0: the clipped term wins, no gradient.
        value, grad = surrogate("regular", 0.5, 0.0, 2.0)
        self.assertAlmostEqual(value, -2.0 * 1.2)
        self.assertEqual(grad, 0.0)
        # Inside the bounds: -A·r, gradient -A·r.
        r = math.exp(0.1)
        value, grad = surrogate("regular", 0.1, 0.0, 2.0)
        self.assertAlmostEqual(value, -2.0 * r)
        self.assertAlmostEqual(grad, -2.0 * r)

    def test_dual_clip_bounds_negative_advantages(self):
        value, grad = surrogate("dual_clip", 3.0, 0.0, -1.0, clip_ratio_c=3.0)
        self.assertEqual((value, grad), (3.0, 0.0))

    def test_cispo_and_importance_sampling(self):
        value, grad = surrogate("cispo", -1.0, -3.0, 0.5)  # r = e^2 clipped to 5
        self.assertAlmostEqual(value, -0.5 * 5.0 * -1.0)
        self.assertAlmostEqual(grad, -0.5 * 5.0)
        value, grad = surrogate("importance_sampling", 0.0, 0.0, 3.0)
        self.assertEqual((value, grad), (-3.0, -3.0))

    def test_k3(self):
        value, grad = kl_estimate("k3", 0.0, math.log(2.0))
        self.assertAlmostEqual(value, 2.0 - math.log(2.0) - 1.0)
        self.assertAlmostEqual(grad, 1.0 - 2.0)


class PolicyLoss(unittest.TestCase):
    def test_on_policy_token_mean_is_minus_the_mean_advantage(self):
        lp = [-1.0, -2.0, -0.5]
        loss, grads = policy_loss(lp, lp, [1.0, 1.0, -2.0], [1.0, 1.0, 1.0], [2, 1])
        self.assertAlmostEqual(loss, 0.0)
        self.assertEqual(grads, [-1.0 / 3, -1.0 / 3, 2.0 / 3])

    def test_kl_is_a_per_sequence_token_mean(self):
        lp = [0.0, 0.0, 0.0]
        ref = [0.0, 0.0, -1.0]
        loss, _ = policy_loss(lp, lp, [0.0] * 3, [1.0] * 3, [2, 1], ref_logprobs_t=ref,
                              kl_loss_coef=0.5, kl_estimator_type="k1")
        # Sequence 1 has KL 1 on its one token; mean over 2 sequences is 0.5.
        self.assertAlmostEqual(loss, 0.5 * 0.5)


if __name__ == "__main__":
    unittest.main()
