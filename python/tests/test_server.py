"""floe_client against a running ``floe serve`` (skipped unless FLOE_TEST_URL is set).

The Rust test ``crates/cli/tests/python_client.rs`` starts a server on loopback with the
embedded tiny model under the name ``tiny`` and runs this file.
"""

import os
import tempfile
import unittest

from floe_client import (
    CROSS_ENTROPY,
    FloeClient,
    FloeError,
    policy_loss,
    policy_loss_spec,
    sample_request,
    train_response,
)

URL = os.environ.get("FLOE_TEST_URL")
MODEL = os.environ.get("FLOE_TEST_MODEL", "tiny")

PROMPT = [5, 17, 42, 9]


@unittest.skipUnless(URL, "set FLOE_TEST_URL to a floe serve offering FLOE_TEST_MODEL")
class AgainstServer(unittest.TestCase):
    def setUp(self):
        self.client = FloeClient(URL)
        self.engine = self.client.create_engine(base_model=MODEL)

    def tearDown(self):
        self.engine.close()

    def sample(self, n=3, seed=11):
        request = sample_request(0, PROMPT, n=n, temperature=1.0, max_new_tokens=6, seed=seed)
        return sorted(self.engine.sample([request]), key=lambda g: g["sample_index"])

    def scores(self, responses, weights="Policy"):
        outputs = self.engine.forward([{"prompt": PROMPT, "responses": responses}], weights)
        return [out["logprobs"] for out in outputs[0]]

    def test_info_lists_the_model(self):
        self.assertIn(MODEL, self.client.info()["models"])
        self.assertGreater(self.engine.info["vocab_size"], 0)
        self.assertIn("tokenizer.json", self.engine.tokenizer_files)

    def test_sampling_is_seeded_and_forward_matches_its_logprobs(self):
        first, again = self.sample(), self.sample()
        self.assertEqual([g["tokens"] for g in first], [g["tokens"] for g in again])
        scored = self.scores([g["tokens"] for g in first])
        for generation, logprobs in zip(first, scored):
            for a, b in zip(generation["logprobs"], logprobs):
                self.assertAlmostEqual(a, b, delta=1e-3)

    def test_server_loss_equals_the_python_loss(self):
        # Old log-probs shifted so ratios leave the clip range both ways.
        generations = self.sample(n=4)
        responses = [g["tokens"] for g in generations]
        current = self.scores(responses)
        self.engine.freeze_reference()
        # The frozen copy scores as the policy does; shifted, the KL term is not zero.
        reference = [[x - 0.25 for x in lp] for lp in self.scores(responses, "Reference")]
        advantages = [1.0, -0.5, 2.0, -1.5]
        shifts = [0.4, -0.4, 0.05, 0.3]
        train = [train_response(tokens, [a] * len(tokens), [x + s for x in lp],
                                ref_logprobs=ref)
                 for tokens, a, s, lp, ref in zip(responses, advantages, shifts, current,
                                                  reference)]
        algorithm = dict(policy_loss_type="dual_clip", loss_reduction="sequence_mean",
                         kl_loss_coef=0.1, kl_estimator_type="k3")
        loss, metrics = self.engine.forward_backward(
            [{"prompt": PROMPT, "responses": train}],
            policy_loss_spec(use_kl_loss=True, **algorithm))
        flat = lambda key: [x for r in train for x in r[key]]  # noqa: E731
        expected, _ = policy_loss(
            [x for lp in current for x in lp], flat("old_logprobs"), flat("advantages"),
            flat("loss_mask"), [len(r["tokens"]) for r in train],
            ref_logprobs_t=flat("ref_logprobs"), **algorithm)
        self.assertAlmostEqual(loss, expected, delta=1e-9)
        self.assertIn("policy/kl_loss", metrics)
        step = self.engine.optim_step(lr=1e-3)
        self.assertGreater(step["grad_norm"], 0.0)
        self.assertFalse(step["skipped"])

    def test_saved_state_restores_the_weights(self):
        responses = [g["tokens"] for g in self.sample(n=2)]
        before = self.scores(responses)
        state_id = self.engine.save_state()
        train = [train_response(t, [0.0] * len(t), [0.0] * len(t)) for t in responses]
        self.engine.forward_backward([{"prompt": PROMPT, "responses": train}], CROSS_ENTROPY)
        self.engine.optim_step(lr=1e-2)
        self.assertNotEqual(self.scores(responses), before)
        self.engine.load_state(state_id)
        self.assertEqual(self.scores(responses), before)

    def test_export_downloads_a_hugging_face_folder(self):
        with tempfile.TemporaryDirectory() as directory:
            paths = self.engine.export_hf(directory)
            names = sorted(os.path.basename(p) for p in paths)
            self.assertIn("config.json", names)
            self.assertIn("tokenizer.json", names)
            self.assertTrue(any(n.endswith(".safetensors") for n in names), names)

    def test_bad_requests_get_named_errors(self):
        vocab = self.engine.info["vocab_size"]
        with self.assertRaises(FloeError) as caught:
            self.engine.forward([{"prompt": PROMPT, "responses": [[vocab]]}])
        self.assertEqual(caught.exception.status, 400)
        self.assertIn("vocabulary", str(caught.exception))
        with self.assertRaises(FloeError) as caught:
            self.client.create_engine(base_model="no-such-model")
        self.assertEqual(caught.exception.status, 400)
        self.assertIn("no-such-model", str(caught.exception))
        with self.assertRaises(FloeError) as caught:
            self.engine.load_state("state-unknown")
        self.assertEqual(caught.exception.status, 404)


if __name__ == "__main__":
    unittest.main()
