"""Reward sources for RL: a Python ``reward_func`` file, an HTTP endpoint, a reward-model actor, an agent's episodes.

The loop sees one protocol, :class:`RewardSource`: ``score(rows, samples) -> Scores`` (``rows``: the data row
of each group, in order). Behind it, the text sources (a function, an endpoint) follow OpenRLHF's contract: ``(queries, prompts, labels) -> {"rewards", "scores",
"extra_logs"}`` where ``queries`` are the full decoded sequences (prompt + response), ``rewards``
drive the advantages, ``scores`` (default: the rewards) are what the task counts as success, and
``extra_logs`` are extra metrics, per sample or one number for the batch (OpenRLHF's ``math_reward_func`` logs its
batch accuracy as a 0-dim tensor). Each may be a list, a numpy array or a tensor. A result with the wrong shape, NaN
or non-numeric values stops the step with an error naming the source and the shapes accepted.
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
from typing import Any, Protocol

import torch

from stages.rl.config import RLConfig, check_endpoint, endpoint_name
from stages.rl.experience import Samples, Scores


class RewardError(RuntimeError):
    """A reward source failed or returned something unusable; the message names the source."""


def check_reachable(url: str, timeout_s: float) -> None:
    """A reward server accepts TCP connections at ``url``'s host and port (checked before any process starts)."""
    import socket

    u = urllib.parse.urlsplit(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((u.hostname, port), timeout=timeout_s).close()
    except OSError as e:
        raise RewardError(f"reward.url: {endpoint_name(url)}: nothing accepts connections at {u.hostname}:{port} "
                          f"({e.strerror or e}); start the reward server first (checked before Ray and vLLM start)") from None


def load_reward_func(ref: str) -> Callable[..., Any]:
    """``reward_func`` of a file, or the function a ``file.py:name`` / ``module:name`` reference names."""
    from stages.common.plugins import load_callable

    return load_callable(ref, "reward_func", "reward func", "(queries, prompts, labels)", RewardError)


SHAPES = "a list, tuple, numpy array or tensor of one number per sample"


def _as_tensor(values: Any, n: int, what: str, source: str, batch_value: bool = False) -> torch.Tensor:
    """``values`` as a float tensor [n]; with ``batch_value`` a single number (a float, a 0-dim tensor: the batch's
    value, as OpenRLHF logs an ``extra_logs`` entry) is that value for every sample."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
    try:
        t = torch.as_tensor(values, dtype=torch.float32).flatten()
    except (TypeError, ValueError, RuntimeError) as e:
        raise RewardError(f"{source}: '{what}' is not numeric ({type(e).__name__}: {e}; got {str(values)[:80]}); "
                          f"expected {SHAPES}" + (" or one number (the batch's)" if batch_value else "")) from e
    if batch_value and t.numel() == 1:
        t = t.expand(n).clone()
    if t.numel() != n:
        raise RewardError(f"{source}: '{what}' has {t.numel()} values for {n} samples; expected {SHAPES}"
                          + (" or one number (the batch's value, e.g. a 0-dim tensor)" if batch_value else ""))
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
    extra = {k: _as_tensor(v, n, f"extra_logs.{k}", source, batch_value=True) for k, v in (result.get("extra_logs") or {}).items()}
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


class RewardSource(Protocol):
    def score(self, rows: list[dict], samples: Samples) -> Scores:
        """The scores of ``samples`` (consecutive groups, one per row of ``rows``, in order)."""
        ...

    def held_out(self, scores: Scores) -> dict[str, float]:
        """The held-out metrics of greedy samples' scores."""
        ...


def text_reward(cfg: RLConfig) -> FuncReward | HttpReward:
    """The configured function or endpoint (a bad file, URL or token fails here, before any work)."""
    if cfg.reward.func:
        return FuncReward(cfg.reward.func)
    if cfg.reward.url:
        r = cfg.reward
        return HttpReward(r.urls, r.timeout_s, r.retries, protocol=r.protocol, token_env=r.token_env)
    raise RewardError("reward: no source given (set reward.func, reward.url or reward.model)")


class TextReward:
    """A function or an endpoint, on decoded text: each sample's prompt + response (``queries``), its prompt
    and its row's label."""

    def __init__(self, call: Callable[[list[str], list[str], list[Any]], dict[str, Any]], tokenizer, label_key: str,
                 keep_special: bool = False):
        """``keep_special``: responses decoded with their special tokens (as OpenRLHF decodes an episode's query),
        so a multi-turn episode's turns stay apart (tool episodes)."""
        self.call, self.tok, self.label_key, self.skip = call, tokenizer, label_key, not keep_special

    def score(self, rows: list[dict], samples: Samples) -> Scores:
        per = len(samples.prompt_ids) // len(rows)
        queries, prompts, labels = [], [], []
        for k, (p, r) in enumerate(zip(samples.prompt_ids, samples.response_ids, strict=True)):
            if k % per == 0:  # a group's samples share their prompt
                prompt_text = self.tok.decode(p)
            queries.append(prompt_text + self.tok.decode(r, skip_special_tokens=self.skip))
            prompts.append(prompt_text)
            labels.append(rows[k // per][self.label_key])
        return Scores.of(self.call(queries, prompts, labels))

    def held_out(self, scores: Scores) -> dict[str, float]:
        return {"eval_accuracy": scores.scores.mean().item()}


class ModelReward:
    """A reward model served by a Ray actor (:class:`stages.common.scoring.RewardModelScorer`) on token ids."""

    def __init__(self, actor, call: Callable[[Any, str], Any]):
        self.actor, self.call = actor, call  # call: a wait with the stage's deadline (Deadlines.call)

    def score(self, rows: list[dict], samples: Samples) -> Scores:
        seqs = [p + r for p, r in zip(samples.prompt_ids, samples.response_ids, strict=True)]
        return Scores.of(check_result({"rewards": self.call(self.actor.score.remote(seqs), "reward model.score")}, len(seqs),
                                      "reward model"))

    def held_out(self, scores: Scores) -> dict[str, float]:
        return {"eval_reward": scores.scores.mean().item()}


def episode_logs(episodes: list) -> dict[str, torch.Tensor]:
    """The numbers episodes log, one value per episode: each episode's last info (NaN where it has no such key:
    not counted) and its turns."""
    logs = {k: torch.tensor([e.info.get(k, float("nan")) for e in episodes]) for k in sorted({k for e in episodes for k in e.info})}
    logs["turns"] = torch.tensor([float(e.turns) for e in episodes])
    return logs


def held_out_means(logs: dict[str, torch.Tensor], names) -> dict[str, float]:
    """``eval_<name>``: the mean of each of ``names`` in ``logs``, NaNs (not counted) left out."""
    out = {}
    for k in sorted(set(names) & set(logs)):
        counted = [v for v in logs[k].tolist() if not math.isnan(v)]
        if counted:
            out[f"eval_{k}"] = sum(counted) / len(counted)
    return out


class EpisodeReward:
    """An agent's episodes score themselves: their summed step rewards, their score, their last info as metrics."""

    def score(self, rows: list[dict], samples: Samples) -> Scores:
        flat = samples.completions
        return Scores(torch.tensor([e.reward for e in flat]), torch.tensor([e.score for e in flat]), episode_logs(flat))

    def held_out(self, scores: Scores) -> dict[str, float]:
        """The episodes' mean score as ``eval_accuracy``, and the mean of every number they logged (turns, the
        last info), NaNs (not counted) left out."""
        return {"eval_accuracy": scores.scores.mean().item(), **held_out_means(scores.extra_logs, scores.extra_logs)}


class WithEpisodeLogs:
    """A reward source scoring tools-only episodes, with the episodes' own counts (turns, tool calls and
    failures) among its extra logs, and their means held out as ``eval_<name>``."""

    def __init__(self, source: RewardSource):
        self.source, self.names = source, set()

    def score(self, rows: list[dict], samples: Samples) -> Scores:
        scores = self.source.score(rows, samples)
        logs = episode_logs(samples.completions)
        scores.extra_logs.update(logs)
        self.names |= set(logs)
        return scores

    def held_out(self, scores: Scores) -> dict[str, float]:
        return {**held_out_means(scores.extra_logs, self.names), **self.source.held_out(scores)}


class Timed:
    """A reward source that adds the seconds spent in it to ``seconds`` (a step's ``reward_s``)."""

    def __init__(self, source: RewardSource):
        self.source, self.seconds = source, 0.0

    def score(self, rows: list[dict], samples: Samples) -> Scores:
        t = time.perf_counter()
        try:
            return self.source.score(rows, samples)
        finally:
            self.seconds += time.perf_counter() - t
