"""A thin client of floe's native engine API (``floe serve``, routes under ``/floe/v1``).

Standard library only. Each :class:`Engine` method is one HTTP call and blocks until the
server answers; :meth:`Engine.sample` yields generations as the server streams them.
Bodies are the JSON forms of the Rust types in ``crates/trainer/src/engine.rs``; see
``docs/server.md`` for the routes.
"""

import json
import os
import urllib.error
import urllib.request

#: Environment variable the API key is read from when none is given.
API_KEY_ENV = "FLOE_API_KEY"
PREFIX = "/floe/v1"

#: The supervised loss (mean negative log-likelihood over masked tokens).
CROSS_ENTROPY = "CrossEntropy"


class FloeError(Exception):
    """The server answered an error, or its answer was not what the API sends."""

    def __init__(self, message, status=None):
        super().__init__(message)
        #: The HTTP status, when the server answered one.
        self.status = status


def policy_loss_spec(**algorithm):
    """floe's RL policy loss, e.g. ``policy_loss_spec(policy_loss_type="regular",
    use_kl_loss=False)``; keys are ``trainer.algorithm`` keys, absent ones keep floe's
    defaults (note: ``use_kl_loss`` defaults to true and then needs reference log-probs).
    """
    return {"Policy": algorithm}


def tinker_loss_spec(loss, clip_low_threshold=0.8, clip_high_threshold=1.2, beta=0.05):
    """A Tinker loss (``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo``,
    ``gspo``, ``dro``) with Tinker's sum semantics; ``beta`` is ``dro``'s penalty."""
    return {"Tinker": {"loss": loss, "clip_low_threshold": clip_low_threshold,
                       "clip_high_threshold": clip_high_threshold, "beta": beta}}


def sample_request(request_id, prompt, n=1, **params):
    """One sampling request: ``prompt`` token ids completed ``n`` times. ``params`` are
    floe's sampling parameters (``temperature``, ``top_p``, ``top_k``, ``min_p``,
    ``max_new_tokens``, ``stop_token_ids``, ``stop_strings``, ``seed``, ``logprobs``, ...).
    """
    return {"id": request_id, "prompt": list(prompt), "n": n, "params": params}


def train_response(tokens, advantages, old_logprobs, loss_mask=None, rollout_logprobs=None,
                   ref_logprobs=None):
    """One response to train on; every list has one entry per token (mask defaults to 1)."""
    return {
        "tokens": list(tokens),
        "loss_mask": [1.0] * len(tokens) if loss_mask is None else list(loss_mask),
        "advantages": list(advantages),
        "old_logprobs": list(old_logprobs),
        "rollout_logprobs": rollout_logprobs,
        "ref_logprobs": ref_logprobs,
    }


def to_float(value):
    """A float from the wire: a number, or ``"NaN"``, ``"Infinity"``, ``"-Infinity"``."""
    if isinstance(value, str):
        if value in ("NaN", "Infinity", "-Infinity"):
            return float(value)
        raise FloeError(f"{value!r} is not a float")
    return float(value)


class FloeClient:
    """A floe server at ``url`` (``http://host:port``)."""

    def __init__(self, url="http://127.0.0.1:8000", api_key=None, timeout=None):
        self.url = url.rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self.timeout = timeout

    def info(self):
        """``{"server", "version", "models"}``: the base models this server offers."""
        return self._json("GET", "/info")

    def create_engine(self, base_model=None, embedded_tokenizer_files=None, seed=0,
                      embedded_path="embedded:tiny", max_tokens_per_microbatch=None,
                      recompute=None, sampling_seed=None):
        """A new engine over base model ``base_model`` (a name from :meth:`info`), or over
        an embedded model (``embedded_path``) with the given tokenizer files and weight
        ``seed``."""
        if (base_model is None) == (embedded_tokenizer_files is None):
            raise ValueError("give exactly one of base_model and embedded_tokenizer_files")
        if base_model is not None:
            model = {"base_model": base_model}
        else:
            model = {"embedded": {"path": embedded_path, "seed": seed,
                                  "tokenizer_files": dict(embedded_tokenizer_files)}}
        settings = {key: value for key, value in (
            ("max_tokens_per_microbatch", max_tokens_per_microbatch),
            ("recompute", recompute),
            ("seed", sampling_seed)) if value is not None}
        created = self._json("POST", "/engines", {"model": model, "settings": settings})
        return Engine(self, created["engine_id"], created["info"], created["tokenizer_files"])

    def _request(self, method, path, body=None):
        data = None
        headers = {}
        if body is not None:
            # NaN and infinities are not JSON; fail here rather than on the server.
            data = json.dumps(body, allow_nan=False).encode()
            headers["content-type"] = "application/json"
        if self.api_key:
            headers["x-api-key"] = self.api_key
        request = urllib.request.Request(self.url + PREFIX + path, data=data,
                                         headers=headers, method=method)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as error:
            text = error.read().decode(errors="replace")
            try:
                detail = json.loads(text)["detail"]
            except (ValueError, KeyError, TypeError):
                detail = text
            raise FloeError(f"{method} {path}: HTTP {error.code}: {detail}",
                            status=error.code) from None
        except urllib.error.URLError as error:
            raise FloeError(f"{method} {self.url}{PREFIX}{path}: {error.reason}") from None

    def _json(self, method, path, body=None):
        with self._request(method, path, body) as response:
            return json.loads(response.read())


class Engine:
    """An engine on the server: the verbs of floe's ``Engine`` trait. Gradients of
    :meth:`forward_backward` calls accumulate until :meth:`optim_step`."""

    def __init__(self, client, engine_id, info, tokenizer_files):
        self.client = client
        #: The engine's id on the server.
        self.engine_id = engine_id
        #: ``{"device", "vocab_size", "max_seq_len"}``.
        self.info = info
        #: The model's tokenizer files by name (empty for the client's embedded tokenizer).
        self.tokenizer_files = tokenizer_files

    def _verb(self, verb, body=None):
        return self.client._json("POST", f"/engines/{self.engine_id}/{verb}",
                                 {} if body is None else body)

    def sample(self, requests):
        """Yields each finished generation (``request_id``, ``sample_index``, ``tokens``,
        ``logprobs``, ``stop_reason``, ``text``) as the server streams it."""
        path = f"/engines/{self.engine_id}/sample"
        with self.client._request("POST", path, {"requests": list(requests)}) as response:
            for line in response:
                if not line.strip():
                    continue
                event = json.loads(line)
                if "generation" in event:
                    yield event["generation"]
                elif "done" in event:
                    return
                elif "error" in event:
                    raise FloeError(f"sample: {event['error']}")
                else:
                    raise FloeError(f"sample: unexpected stream line {line!r}")
        raise FloeError("sample: the stream ended before its done line")

    def forward(self, groups, weights="Policy", temperature=1.0):
        """Per group, per response: ``{"logprobs", "entropy"}`` of each response token.
        ``groups`` are ``{"prompt": [...], "responses": [[...], ...]}``; ``weights`` is
        ``"Policy"`` or ``"Reference"``."""
        answer = self._verb("forward", {"groups": list(groups), "weights": weights,
                                        "temperature": temperature})
        return answer["outputs"]

    def forward_backward(self, groups, loss, temperature=1.0):
        """Forward and backward of one mini-batch; ``(loss, metrics)``. ``groups`` are
        ``{"prompt": [...], "responses": [train_response(...), ...]}``."""
        answer = self._verb("forward_backward", {"groups": list(groups), "loss": loss,
                                                 "temperature": temperature})
        metrics = {name: to_float(value) for name, value in answer["metrics"].items()}
        return to_float(answer["loss"]), metrics

    def optim_step(self, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                   max_grad_norm=1.0):
        """One AdamW step on the accumulated gradients: ``{"grad_norm", "skipped", "step"}``."""
        answer = self._verb("optim_step", {"lr": lr, "beta1": beta1, "beta2": beta2,
                                           "eps": eps, "weight_decay": weight_decay,
                                           "max_grad_norm": max_grad_norm})
        answer["grad_norm"] = to_float(answer["grad_norm"])
        return answer

    def sync_sampler_weights(self):
        """Makes sampling use the latest weights; returns the seconds it took."""
        return self._verb("sync_sampler_weights")["seconds"]

    def freeze_reference(self):
        """Freezes the current weights as the reference model (for KL)."""
        self._verb("freeze_reference")

    def reset_optimizer(self):
        """Starts a fresh optimizer (moments and step count cleared), weights kept."""
        self._verb("reset_optimizer")

    def save_state(self):
        """Saves weights and optimizer state on the server; returns the state's id."""
        return self._verb("save_state")["state_id"]

    def load_state(self, state_id):
        """Restores a state :meth:`save_state` returned (from any engine of the server)."""
        self.info = self._verb("load_state", {"state_id": state_id})

    def export_hf(self, directory):
        """Downloads the weights as a Hugging Face folder into ``directory``; returns the
        written paths."""
        export = self._verb("export_hf")
        os.makedirs(directory, exist_ok=True)
        paths = []
        for entry in export["files"]:
            name = entry["name"]
            if "/" in name or "\\" in name or name.startswith("."):
                raise FloeError(f"export_hf: file name {name!r} is not a plain name")
            path = os.path.join(directory, name)
            with self.client._request("GET", f"/exports/{export['export_id']}/{name}") as r:
                with open(path + ".partial", "wb") as out:
                    while True:
                        chunk = r.read(1 << 20)
                        if not chunk:
                            break
                        out.write(chunk)
            if os.path.getsize(path + ".partial") != entry["bytes"]:
                raise FloeError(f"export_hf: {name} arrived incomplete")
            os.replace(path + ".partial", path)
            paths.append(path)
        return paths

    def close(self):
        """Frees the engine on the server."""
        self.client._json("DELETE", f"/engines/{self.engine_id}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
