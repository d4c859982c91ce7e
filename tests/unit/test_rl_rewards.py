"""Reward sources: the reward_func contract, bad answers named by source, a real local HTTP endpoint."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from stages.rl.rewards import FuncReward, HttpReward, RewardError

ROOT = Path(__file__).resolve().parents[2]


def _func_file(tmp_path, body: str) -> str:
    p = tmp_path / "reward.py"
    p.write_text(body)
    return str(p)


def test_arithmetic_reward_func_checks_the_answer():
    r = FuncReward(str(ROOT / "recipes/rewards/arithmetic.py"))
    out = r(["<q>12+30<a>42", "<q>12+30<a>41", "<q>1+1<a>The answer is 2"], ["<q>12+30<a>", "<q>12+30<a>", "<q>1+1<a>"], ["42", "42", "2"])
    assert out["rewards"].tolist() == [1.0, 0.0, 1.0] and torch.equal(out["scores"], out["rewards"])


@pytest.mark.parametrize(
    "body, message",
    [
        ("def reward_func(q, p, l):\n    return {'rewards': [1.0]}\n", r"'rewards' has 1 values for 2 samples"),
        ("def reward_func(q, p, l):\n    return {'rewards': [1.0, float('nan')]}\n", r"'rewards' has non-finite values \(NaN or inf\) at samples \[1\]"),
        ("def reward_func(q, p, l):\n    return {'rewards': ['good', 'bad']}\n", r"'rewards' is not numeric"),
        ("def reward_func(q, p, l):\n    return 3\n", r"expected a dict with 'rewards'"),
        ("def reward_func(q, p, l):\n    raise KeyError('label')\n", r"raised KeyError"),
        ("x = 1\n", r"defines no callable 'reward_func"),
    ],
)
def test_bad_reward_func_results_name_the_source(tmp_path, body, message):
    path = _func_file(tmp_path, body)
    with pytest.raises(RewardError, match=f"reward func {path}.*{message}"):
        FuncReward(path)(["a", "b"], ["", ""], [0, 0])


class _Handler(BaseHTTPRequestHandler):
    calls = 0
    mode = "ok"
    auth = None
    bodies: list = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        type(self).calls += 1
        type(self).auth = self.headers.get("Authorization")
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append((self.path, body))
        if self.mode in ("fail", "bad_request"):
            self.send_response(500 if self.mode == "fail" else 400)
            self.end_headers()
            return
        if self.mode == "drip":  # headers at once, then one byte every 0.5 s: each read is quick, the call is not
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.5)
            return
        if self.mode == "garbage":  # not an HTTP status line
            self.wfile.write(b"HELLO\r\n\r\n")
            return
        if self.mode == "latin1":
            self.send_response(200)
            self.send_header("Content-Length", "3")
            self.end_headers()
            self.wfile.write(b"\xff\xfe{")
            return
        if self.mode == "flaky" and type(self).calls == 1:
            self.send_response(503)
            self.end_headers()
            return
        queries = body["query"] if "query" in body else body["queries"]  # OpenRLHF's protocol, or ours
        rewards = [float(q.endswith(str(lab))) for q, lab in zip(queries, body["labels"])]
        data = json.dumps({"rewards": rewards, "scores": [r * 10 for r in rewards],
                           "extra_logs": {"length": [len(q) for q in queries]}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    _Handler.calls = 0
    _Handler.bodies = []
    yield httpd, f"http://127.0.0.1:{httpd.server_address[1]}/reward"
    httpd.shutdown()
    httpd.server_close()


def test_http_reward_against_a_local_server(server):
    httpd, url = server
    _Handler.mode = "ok"
    out = HttpReward(url, timeout_s=5, retries=2)(["1+1=2", "1+1=3"], ["1+1=", "1+1="], ["2", "2"])
    assert out["rewards"].tolist() == [1.0, 0.0] and out["extra_logs"]["length"].tolist() == [5.0, 5.0]
    _Handler.mode = "flaky"  # one 503, then an answer: a bounded retry recovers
    _Handler.calls = 0
    assert HttpReward(url, timeout_s=5, retries=2)(["x2"], ["x"], ["2"])["rewards"].tolist() == [1.0]
    assert _Handler.calls == 2


def test_openrlhf_protocol_several_endpoints_and_a_bearer_token(server, monkeypatch):
    """OpenRLHF's remote-reward shapes: {"query", "prompts", "labels"} -> {"rewards", "scores", "extra_logs"};
    with two endpoints each gets one contiguous half, and the answers are joined in order."""
    httpd, url = server
    _Handler.mode = "ok"
    queries, prompts, labels = ["1+1=2", "1+1=3", "2+2=4", "2+2=5", "3+3=6"], ["1+1="] * 2 + ["2+2="] * 2 + ["3+3="], list("22446")
    out = HttpReward(url, timeout_s=5, retries=0)(queries, prompts, labels)
    assert _Handler.bodies == [("/reward", {"query": queries, "prompts": prompts, "labels": labels})]
    assert out["rewards"].tolist() == [1.0, 0.0, 1.0, 0.0, 1.0] and out["scores"].tolist() == [10.0, 0.0, 10.0, 0.0, 10.0]
    _Handler.bodies = []
    assert HttpReward(url, 5, 0, protocol="queries")(queries[:1], prompts[:1], labels[:1])["rewards"].tolist() == [1.0]
    assert list(_Handler.bodies[0][1]) == ["queries", "prompts", "labels"]
    _Handler.bodies = []
    monkeypatch.setenv("RM_TOKEN", "tok-s3cret")
    two = HttpReward([url, url.replace("/reward", "/other")], 5, 0, token_env="RM_TOKEN")
    out = two(queries, prompts, labels)
    assert out["rewards"].tolist() == [1.0, 0.0, 1.0, 0.0, 1.0] and out["extra_logs"]["length"].tolist() == [5.0] * 5
    assert sorted((path, body["query"]) for path, body in _Handler.bodies) == [("/other", queries[2:]), ("/reward", queries[:2])]
    assert _Handler.auth == "Bearer tok-s3cret"
    _Handler.mode = "fail"
    with pytest.raises(RewardError) as err:
        two(queries, prompts, labels)
    assert "tok-s3cret" not in str(err.value) and "HTTP 500" in str(err.value)
    monkeypatch.delenv("RM_TOKEN")
    with pytest.raises(RewardError, match=r"reward.token_env: the environment variable RM_TOKEN is not set"):
        HttpReward(url, 5, 0, token_env="RM_TOKEN")


def test_http_reward_gives_up_naming_the_url(server):
    httpd, url = server
    _Handler.mode = "fail"
    _Handler.calls = 0
    with pytest.raises(RewardError, match=f"reward endpoint {url}: no answer after 3 attempt.*HTTP 500"):
        HttpReward(url, timeout_s=5, retries=2)(["a"], [""], [0])
    assert _Handler.calls == 3
    dead = "http://127.0.0.1:9/reward"  # nothing listens on the discard port
    with pytest.raises(RewardError, match="reward endpoint http://127.0.0.1:9/reward: no answer after 2 attempt"):
        HttpReward(dead, timeout_s=1, retries=1)(["a"], [""], [0])


def test_http_reward_deadline_bounds_the_whole_call(server):
    """A server dripping one byte every 0.5 s never trips a per-read timeout; the call's deadline still holds."""
    httpd, url = server
    _Handler.mode = "drip"
    t = time.monotonic()
    with pytest.raises(RewardError, match=f"reward endpoint {url}: .*within the 2 s deadline.*cut off at the deadline"):
        HttpReward(url, timeout_s=2, retries=3)(["a"], [""], [0])
    assert time.monotonic() - t < 3.0


@pytest.mark.parametrize("mode, message, calls", [
    ("bad_request", "HTTP 400 Bad Request \\(a client error: not retried\\)", 1),
    ("garbage", "BadStatusLine", 3),
    ("latin1", "not UTF-8 JSON .*UnicodeDecodeError", 1),
])
def test_http_reward_protocol_errors_name_the_endpoint(server, mode, message, calls):
    httpd, url = server
    _Handler.mode, _Handler.calls = mode, 0
    with pytest.raises(RewardError, match=f"reward endpoint {url}: .*{message}"):
        HttpReward(url, timeout_s=5, retries=2)(["a"], [""], [0])
    assert _Handler.calls == calls  # a 4xx or an unreadable 2xx body is final; a broken status line is retried


def test_http_reward_credentials_are_sent_not_shown(server):
    httpd, url = server
    _Handler.mode = "fail"
    secret = url.replace("http://", "http://user:s3cret@") + "?token=abc123"
    with pytest.raises(RewardError) as err:
        HttpReward(secret, timeout_s=5, retries=0)(["a"], [""], [0])
    assert "s3cret" not in str(err.value) and "abc123" not in str(err.value) and url in str(err.value)
    assert _Handler.auth == "Basic dXNlcjpzM2NyZXQ="  # base64("user:s3cret")


@pytest.mark.parametrize("field, value, message", [
    ("url", "file:///etc/passwd", "must be an http:// or https:// URL"),
    ("url", "http://", "with a host"),
    ("timeout_s", 0, "timeout_s: 0(.0)? must be a positive"),
    ("timeout_s", -1, "timeout_s: -1(.0)? must be a positive"),
    ("retries", -1, "retries: -1 must be >= 0"),
])
def test_http_reward_settings_are_checked_in_the_config(field, value, message):
    from pydantic import ValidationError

    from stages.rl.config import RewardSourceConfig

    cfg = {"url": "http://127.0.0.1:1/r", field: value}
    with pytest.raises(ValidationError, match=message):
        RewardSourceConfig(**cfg)
    with pytest.raises(ValueError, match=message):
        HttpReward(cfg["url"], cfg.get("timeout_s", 1), cfg.get("retries", 0))


def test_sampling_settings_that_cannot_be_trained_on_are_refused_by_name():
    from stages.common.recipe import load_config
    from stages.rl.config import RLConfig

    recipe = str(ROOT / "recipes/rl/tiny.yaml")
    assert load_config(RLConfig, [recipe]).rollout.temperature == 1.0
    assert load_config(RLConfig, [recipe, "rollout.temperature=0.7"]).rollout.temperature == 0.7  # tempered training
    with pytest.raises(Exception, match=r"(?s)recipes/rl/tiny.yaml.*rollout.temperature: got 0.0, expected > 0"):
        load_config(RLConfig, [recipe, "rollout.temperature=0.0"])
    with pytest.raises(Exception, match=r"(?s)recipes/rl/tiny.yaml.*rollout.top_p: got 0.9, expected 1.0"):
        load_config(RLConfig, [recipe, "rollout.top_p=0.9"])
    with pytest.raises(Exception, match=r"(?s)algo: .*entropy_coef: -0.1 must be >= 0"):
        load_config(RLConfig, [recipe, "algo.entropy_coef=-0.1"])


# a reward file in the shape of OpenRLHF's examples/python/math_reward_func.py: per-sample tensors for rewards and
# scores, the batch's accuracy as a 0-dim tensor in extra_logs, and the two helpers it imports from openrlhf.utils
OPENRLHF_MATH = """
import torch
from stages.common.graders import extract_boxed_answer, grade_answer


def reward_func(queries, prompts, labels, **kwargs):
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):] if prompt in query else query
        rewards.append(1.0 if grade_answer(extract_boxed_answer(response), label) else 0.0)
    rewards_tensor = torch.tensor(rewards, dtype=torch.float)
    return {"rewards": rewards_tensor, "scores": rewards_tensor, "extra_logs": {"math_accuracy": rewards_tensor.mean()}}
"""


def test_openrlhf_shaped_results_are_accepted_and_a_batch_value_is_logged_for_the_batch(tmp_path):
    from stages.rl.experience import Scores

    out = FuncReward(_func_file(tmp_path, OPENRLHF_MATH))(
        ["Q1 so \\boxed{\\frac{1}{2}}", "Q2 \\boxed{3}", "Q3 none", "Q4 \\boxed{2^{3}}"], ["Q1", "Q2", "Q3", "Q4"], ["0.5", "4", "1", "8"])
    assert out["rewards"].tolist() == [1.0, 0.0, 0.0, 1.0]
    # the 0-dim batch accuracy (0.5) is that value for every sample: its mean, the logged number, is 0.5
    assert out["extra_logs"]["math_accuracy"].tolist() == [0.5] * 4
    assert Scores.of(out).extra_logs["math_accuracy"].mean().item() == 0.5
    # a step logs an extra_logs entry as its mean over the samples (stages.rl.metrics.step_metrics)
    numpy_shaped = _func_file(tmp_path, "import numpy as np\ndef reward_func(q, p, l):\n    return {'rewards': np.array([1, 0]), "
                                        "'scores': [1.0, 0.0], 'extra_logs': {'n': 2.0, 'per': np.array([3.0, 4.0])}}\n")
    out = FuncReward(numpy_shaped)(["a", "b"], ["", ""], [0, 0])
    assert out["rewards"].tolist() == [1.0, 0.0] and out["extra_logs"]["n"].tolist() == [2.0, 2.0]
    assert out["extra_logs"]["per"].tolist() == [3.0, 4.0]


def test_a_wrong_shape_says_which_shapes_are_accepted(tmp_path):
    bad = _func_file(tmp_path, "def reward_func(q, p, l):\n    return {'rewards': [1.0, 0.0], 'extra_logs': {'acc': [1.0, 0.0, 1.0]}}\n")
    with pytest.raises(RewardError, match=r"'extra_logs.acc' has 3 values for 2 samples; expected a list, tuple, numpy array "
                                          r"or tensor of one number per sample or one number \(the batch's value"):
        FuncReward(bad)(["a", "b"], ["", ""], [0, 0])
    with pytest.raises(RewardError, match=r"'rewards' has 1 values for 2 samples; expected a list, tuple, numpy array or tensor"):
        FuncReward(_func_file(tmp_path, "def reward_func(q, p, l):\n    return {'rewards': 1.0}\n"))(["a", "b"], ["", ""], [0, 0])
