"""Reward sources for RL: a Python ``reward_func`` file, an HTTP endpoint, or a reward-model actor.

Every source follows OpenRLHF's contract: ``(queries, prompts, labels) -> {"rewards", "scores",
"extra_logs"}`` where ``queries`` are the full decoded sequences (prompt + response), ``rewards``
drive the advantages, ``scores`` (default: the rewards) are what the task counts as success, and
``extra_logs`` are extra per-sample metrics. A result with the wrong shape, NaN or non-numeric
values stops the step with an error naming the source.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import torch

from stages.rl.config import check_endpoint, endpoint_name


class RewardError(RuntimeError):
    """A reward source failed or returned something unusable; the message names the source."""


def load_reward_func(ref: str) -> Callable[..., Any]:
    """``reward_func`` of a file, or the function a ``file.py:name`` / ``module:name`` reference names."""
    from stages.common.plugins import load_callable

    return load_callable(ref, "reward_func", "reward func", "(queries, prompts, labels)", RewardError)


def _as_tensor(values: Any, n: int, what: str, source: str) -> torch.Tensor:
    try:
        t = torch.as_tensor(values, dtype=torch.float32).flatten()
    except (TypeError, ValueError) as e:
        raise RewardError(f"{source}: '{what}' is not numeric ({type(e).__name__}: {e}; got {str(values)[:80]})") from e
    if t.numel() != n:
        raise RewardError(f"{source}: '{what}' has {t.numel()} values for {n} samples")
    if not torch.isfinite(t).all():
        bad = [i for i, v in enumerate(t.tolist()) if not math.isfinite(v)]
        raise RewardError(f"{source}: '{what}' has non-finite values (NaN or inf) at samples {bad[:10]}")
    return t


def check_result(result: Any, n: int, source: str) -> dict[str, Any]:
    """Validate a source's answer; returns rewards [n], scores [n], extra_logs {name: [n]}."""
    if isinstance(result, torch.Tensor | list | tuple):
        result = {"rewards": result}
    if not isinstance(result, dict) or "rewards" not in result:
        raise RewardError(f"{source}: expected a dict with 'rewards' (and optional 'scores', 'extra_logs'), got {type(result).__name__}")
    rewards = _as_tensor(result["rewards"], n, "rewards", source)
    scores = _as_tensor(result["scores"], n, "scores", source) if result.get("scores") is not None else rewards.clone()
    extra = {k: _as_tensor(v, n, f"extra_logs.{k}", source) for k, v in (result.get("extra_logs") or {}).items()}
    return {"rewards": rewards, "scores": scores, "extra_logs": extra}


class FuncReward:
    def __init__(self, path: str):
        self.source = f"reward func {path}"
        self.func = load_reward_func(path)

    def __call__(self, queries: list[str], prompts: list[str], labels: list[Any]) -> dict[str, Any]:
        try:
            result = self.func(queries, prompts, labels)
        except Exception as e:
            raise RewardError(f"{self.source}: raised {type(e).__name__}: {e}") from e
        return check_result(result, len(queries), self.source)


class _Deadline(Exception):
    pass


class HttpReward:
    """POST the samples as JSON to one endpoint or several; the answer is the same dict as a reward_func's.

    ``protocol`` ``openrlhf`` sends ``{"query", "prompts", "labels"}`` (OpenRLHF's remote reward servers,
    ``stages.serve_rm``); ``queries`` sends ``{"queries", "prompts", "labels"}``. With several endpoints the
    samples are split into one contiguous batch per endpoint, posted at once, and the answers joined in order.
    ``timeout_s`` is the deadline of the whole call: connecting, sending, reading (however slowly the
    server drips its answer) and every retry. 5xx answers, 408/429 and transport errors are retried (with
    a short backoff, within the deadline); other 4xx answers are final. A user and password in the URL are
    sent as HTTP Basic auth, the token in the environment variable ``token_env`` as a Bearer token; errors
    name the endpoint without them or the query string, and never show the token.
    """

    def __init__(self, url: str | list[str], timeout_s: float, retries: int, protocol: str = "openrlhf",
                 token_env: str | None = None):
        import os

        self.urls = [url] if isinstance(url, str) else list(url)
        for u in self.urls:
            check_endpoint(u, timeout_s, retries)
        self.url = self.urls[0]
        self.timeout_s, self.retries, self.protocol = timeout_s, retries, protocol
        self.source = f"reward endpoint {endpoint_name(self.url)}"
        self.token = None
        if token_env is not None:
            self.token = os.environ.get(token_env)
            if not self.token:
                raise RewardError(f"reward.token_env: the environment variable {token_env} is not set (or empty); "
                                  f"it should hold the reward server's token")

    def _post(self, url: str, body: bytes, deadline: float) -> tuple[int, str, bytes]:
        import http.client

        u = urllib.parse.urlsplit(url)
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Deadline
        conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(u.hostname, u.port, timeout=left)
        headers = {"Content-Type": "application/json"}
        if u.username is not None:
            cred = f"{urllib.parse.unquote(u.username)}:{urllib.parse.unquote(u.password or '')}"
            headers["Authorization"] = "Basic " + base64.b64encode(cred.encode()).decode()
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        watchdog = None
        try:
            conn.connect()  # bounded by the socket timeout (what is left of the deadline)
            # the socket timeout bounds each read; the watchdog bounds the call (a slow drip resets no clock).
            # It holds the socket itself: http.client drops conn.sock once a closing response has begun
            sock = conn.sock
            watchdog = threading.Timer(max(deadline - time.monotonic(), 0.0), _shutdown, args=(sock,))
            watchdog.daemon = True
            watchdog.start()
            conn.request("POST", (u.path or "/") + (f"?{u.query}" if u.query else ""), body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, resp.reason, data
        except (OSError, http.client.HTTPException) as e:
            if time.monotonic() >= deadline:
                raise _Deadline from e
            raise
        finally:
            if watchdog is not None:
                watchdog.cancel()
            conn.close()

    def __call__(self, queries: list[str], prompts: list[str], labels: list[Any]) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        if len(self.urls) == 1:
            return self._call(self.url, queries, prompts, labels, deadline)
        from concurrent.futures import ThreadPoolExecutor

        n, k = len(queries), min(len(self.urls), len(queries))
        bounds = [(i * n // k, (i + 1) * n // k) for i in range(k)]
        with ThreadPoolExecutor(k) as pool:
            parts = list(pool.map(lambda ib: self._call(self.urls[ib[0]], *(x[ib[1][0]:ib[1][1]] for x in (queries, prompts, labels)),
                                                         deadline), enumerate(bounds)))
        return {"rewards": torch.cat([p["rewards"] for p in parts]), "scores": torch.cat([p["scores"] for p in parts]),
                "extra_logs": {key: torch.cat([p["extra_logs"][key] for p in parts]) for key in parts[0]["extra_logs"]
                               if all(key in p["extra_logs"] for p in parts)}}

    def _call(self, url: str, queries: list[str], prompts: list[str], labels: list[Any], deadline: float) -> dict[str, Any]:
        import http.client

        source = f"reward endpoint {endpoint_name(url)}"
        key = "query" if self.protocol == "openrlhf" else "queries"
        body = json.dumps({key: queries, "prompts": prompts, "labels": labels}).encode()
        errors = []
        for attempt in range(self.retries + 1):
            try:
                status, reason, data = self._post(url, body, deadline)
            except _Deadline:
                errors.append(f"attempt {attempt + 1}: cut off at the deadline")
                break
            except (OSError, http.client.HTTPException) as e:
                errors.append(f"attempt {attempt + 1}: {type(e).__name__}: {e}")
            else:
                if 200 <= status < 300:
                    try:
                        result = json.loads(data.decode("utf-8"))
                    except (UnicodeDecodeError, json.JSONDecodeError) as e:
                        raise RewardError(f"{source}: HTTP {status} but the body is not UTF-8 JSON "
                                          f"({type(e).__name__}: {e}; first bytes {data[:60]!r})") from e
                    return check_result(result, len(queries), source)
                if 400 <= status < 500 and status not in (408, 429):
                    raise RewardError(f"{source}: HTTP {status} {reason} (a client error: not retried)")
                errors.append(f"attempt {attempt + 1}: HTTP {status} {reason}")
            if attempt == self.retries:
                break
            pause = min(0.2 * 2**attempt, 2.0)
            if time.monotonic() + pause >= deadline:
                errors.append("no time left for another attempt")
                break
            time.sleep(pause)
        tried = sum(e.startswith("attempt") for e in errors)
        raise RewardError(f"{source}: no answer after {tried} attempt(s) within the {self.timeout_s:g} s deadline "
                          f"(reward.timeout_s; retries {self.retries}): {'; '.join(errors)}")


def _shutdown(sock) -> None:
    import socket

    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class RewardModelScorer:
    """A reward-model checkpoint scoring token-id sequences (run as a Ray actor by the RL driver).

    Scores are read at each sequence's last token (``stages.reward_model.score_padded``); with
    ``normalize`` they become (score - reward_mean) / reward_std from the checkpoint's config
    (``normalize=None``: when the config has them).
    """

    def __init__(self, path: str, normalize: bool | None, batch_size: int = 64):
        from transformers import AutoModelForSequenceClassification

        self.model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32).eval()
        cfg = self.model.config
        self.pad = cfg.pad_token_id
        self.batch_size = batch_size
        self.source = f"reward model {path}"
        mean, std = getattr(cfg, "reward_mean", None), getattr(cfg, "reward_std", None)
        has_stats = mean is not None and bool(std)
        if normalize and not has_stats:
            raise RewardError(f"{self.source}: normalize_reward needs reward_mean/reward_std in its config.json (train it with eval_data)")
        self.norm = (float(mean), float(std)) if has_stats and normalize is not False else None

    def score(self, sequences: list[list[int]]) -> list[float]:
        from stages.reward_model import score_padded

        out = []
        with torch.no_grad():
            for i in range(0, len(sequences), self.batch_size):
                chunk = sequences[i : i + self.batch_size]
                width = max(map(len, chunk))
                ids = torch.full((len(chunk), width), self.pad, dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for j, s in enumerate(chunk):
                    ids[j, : len(s)] = torch.tensor(s)
                    mask[j, : len(s)] = 1
                out += score_padded(self.model, ids, mask).tolist()
        if self.norm is not None:
            out = [(s - self.norm[0]) / self.norm[1] for s in out]
        return out
