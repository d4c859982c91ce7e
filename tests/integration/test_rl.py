"""The RL stage for real: a private Ray cluster, 2 DeepSpeed ZeRO-3 learners, a reference, a vLLM engine."""

import json
import os
from pathlib import Path

import psutil
import pytest
import torch

from checkpoints import read_manifest, verify
from stages.common.recipe import apply_overrides, read_recipe, validate
from stages.rl.config import RLConfig
from stages.rl.driver import SyncError, run_rl
from stages.rl.rewards import RewardError
from tests.conftest import metrics, wandb_history

# one Ray cluster at a time: these tests look for Ray processes machine-wide (make test: --dist loadfile keeps
# this file on one pytest-xdist worker; test_cluster.py's multi-node cluster, on another, is told apart by its parent)
pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def ray_processes() -> list[str]:
    """Ray's processes on this machine, less those of test_cluster.py's multi-node cluster and those started under
    another pytest-xdist worker (test_pipeline.py's RL stages run beside this file); orphans count."""
    names = []
    others = _other_workers()
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if any(s in cmd for s in ("raylet", "gcs_server", "ray::", "rlray-")) and not _of_local_cluster(p) \
                and not _under(p, others):
            names.append(cmd[:120])
    return names


def _other_workers() -> set[int]:
    """The other pytest-xdist workers of this run (this worker's siblings), none when not under xdist."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return set()
    try:
        return {c.pid for c in psutil.Process().parent().children()} - {os.getpid()}
    except psutil.Error:
        return set()


def _under(p: psutil.Process, pids: set[int]) -> bool:
    try:
        return any(q.pid in pids for q in p.parents())
    except psutil.Error:
        return False


def _of_local_cluster(p: psutil.Process) -> bool:
    try:
        return any("stages.common.local_cluster" in " ".join(q.cmdline()) for q in p.parents())
    except psutil.Error:
        return False


RECIPE = ROOT / "recipes/rl/tiny.yaml"


def _config(task_files, root, reward_func, *overrides: str, **sections) -> RLConfig:
    """The RL recipe (recipes/rl/tiny.yaml) at these tests' micro scale, then ``overrides`` as the stage's CLI takes
    them (``key.sub=value``) and whole ``sections`` (as ``section={...}``); ``reward_func``: the reward's file."""
    data, _ = read_recipe(RECIPE)
    micro = [f"data.paths=[{task_files['rl_prompts']}]", "eval_data=null", "eval_steps=0", f"output_root={root}",
             "rollout.rollout_batch_size=8", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=6",
             "train.world_size=2", "train.train_batch_size=16", "train.micro_train_batch_size=8", "train.lr=1e-3",
             "train.progress_bar=false", "max_steps=3", f"reward={json.dumps({'func': str(reward_func)})}"]
    more = [f"{k}={json.dumps(v)}" for k, v in sections.items()]
    return validate(RLConfig, apply_overrides(data, [*micro, *overrides, *more]), str(RECIPE))


def _first_digit_one(folder: Path) -> Path:
    """A toy reward the micro model earns often: 1 for answers starting with the digit 1."""
    func = folder / "first_digit.py"
    func.write_text(
        "def reward_func(queries, prompts, labels):\n"
        "    r = [1.0 if q[len(p):].startswith('1') else 0.0 for q, p in zip(queries, prompts)]\n"
        "    return {'rewards': r}\n"
    )
    return func


def test_rl_steps_with_two_zero3_learners_reference_and_verified_sync(task_files, micro_sft, tmp_path):
    """Sampled at temperature 0.7: the learners and the reference train on the tempered policy, the probe
    checks the raw weights."""
    from transformers import AutoModelForCausalLM

    # the toy reward, not answer checking: with the micro model a whole step's samples can all be wrong,
    # and then nothing moves (all advantages 0) and the KL stays 0
    cfg = _config(task_files, tmp_path, _first_digit_one(tmp_path), "rollout.temperature=0.7", "algo.entropy_coef=0.01",
                  "algo.init_kl_coef=0.05", "algo.kl_estimator=k3", "eval_grader=arithmetic", "logging.wandb.mode=offline",
                  "logging.wandb.project=rlhf-tests", eval_data={"paths": [str(task_files["eval"])], "prompt_key": "prompt",
                  "label_key": "answer"})
    ref = run_rl(cfg, micro_sft)
    verify(ref)
    m = read_manifest(ref.path)
    assert (m.kind, m.stage, m.parent) == ("full", "rl", micro_sft.digest)
    steps = metrics(ref)
    assert [s["step"] for s in steps] == [1, 2, 3]
    # the held-out eval before the first step and after the last are the curves' ends (step 0, step 3)
    initial, final = m.extra["initial_eval"], m.extra["final_eval"]
    assert metrics(ref, initial=True)[0] == {"step": 0, **initial}
    assert {k: steps[-1][k] for k in final} == final
    # every push verified: vLLM (fp32) and the learners agree on the probe after each update
    assert all(s["sync_logprob_diff"] <= 1e-3 and s["sync_max_logprob_diff"] <= 1e-2 for s in steps)
    # two updates per rollout: the learners compute old log-probs, and vLLM's sampling log-probs of every
    # response token agree with them (same weights, fp32 on both sides, both at temperature 0.7)
    assert all(s["rollout_logprob_diff"] <= 1e-3 for s in steps), [s["rollout_logprob_diff"] for s in steps]
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    assert steps[-1]["kl"] > 0  # and has moved since
    for key in ("reward_mean", "accuracy", "entropy", "clip_ratio", "response_length", "generate_s", "train_s", "sync_s"):
        assert key in steps[-1]
    # logging.wandb (offline): the W&B run is the run folder's, its rows the metrics.jsonl rows, step 0 included
    run_dir = Path(ref.path).parent
    run_id, rows = wandb_history(run_dir)
    assert run_id == run_dir.name
    logged = metrics(ref, initial=True)
    assert [r["_step"] for r in rows] == [s["step"] for s in logged]
    assert [{k.removeprefix("rl/"): v for k, v in r.items() if k.startswith("rl/")} for r in rows] == \
        [{k: v for k, v in s.items() if k != "step"} for s in logged]
    # held-out accuracy from the task's grader (not the toy reward): a count of right answers over the rows
    n_eval = sum(1 for _ in open(task_files["eval"]))
    assert (m.extra["final_eval"]["eval_accuracy"] * n_eval) == pytest.approx(round(m.extra["final_eval"]["eval_accuracy"] * n_eval))
    new = AutoModelForCausalLM.from_pretrained(ref.path, dtype=torch.float32)
    old = AutoModelForCausalLM.from_pretrained(micro_sft.path, dtype=torch.float32)
    assert not torch.equal(new.lm_head.weight, old.lm_head.weight)
    assert ray_processes() == []


class _Listeners:
    """While an RL run goes on in this process: every listening socket of this process and its descendants
    (Ray's GCS, raylet, agents, workers; the learners' rendezvous; vLLM), and one connection attempt
    to the cluster's GCS without the cluster's token."""

    def __init__(self):
        import threading

        self.seen: set[tuple[str, str, int]] = set()
        self.refused: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if self._attempt is not None:
            self._attempt.join()

    def _watch(self):
        import threading

        me = psutil.Process()
        self._attempt = None
        while not self._stop.wait(0.3):
            gcs = None
            for proc in [me, *me.children(recursive=True)]:
                try:
                    name = proc.name()
                    for c in proc.net_connections(kind="inet"):
                        if c.status == psutil.CONN_LISTEN:
                            self.seen.add((name, c.laddr.ip, c.laddr.port))
                            if name == "gcs_server":
                                gcs = c.laddr
                except psutil.Error:
                    continue
            if gcs is not None and self._attempt is None:  # beside the sampling: a refusal takes ~20 s
                self._attempt = threading.Thread(target=self._connect_without_token, args=(gcs.port,), daemon=True)
                self._attempt.start()

    def _connect_without_token(self, port: int):
        import os
        import subprocess
        import sys

        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        addr = f"127.0.0.1:{port}"
        r = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address={addr!r}); print('CONNECTED')"],
                           env={**env, "RAY_AUTH_MODE": "disabled"}, capture_output=True, text=True, timeout=120)
        self.refused = "CONNECTED" if "CONNECTED" in r.stdout else r.stderr


class _OpenRLHFRewardServer:
    """A remote reward server speaking OpenRLHF's protocol ({"query", "prompts", "labels"} -> {"rewards",
    "scores"}) with a bearer token: reward 1 for responses starting with the digit 1."""

    def __init__(self, token: str):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        calls = self.calls = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.headers.get("Authorization") != f"Bearer {token}":
                    self.send_response(401)
                    self.end_headers()
                    return
                calls.append(sorted(body))
                r = [1.0 if q[len(p):].startswith("1") else 0.0 for q, p in zip(body["query"], body["prompts"])]
                data = json.dumps({"rewards": r, "scores": r, "extra_logs": {}}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_push_that_changes_nothing_is_caught_and_ray_is_cleaned_up(task_files, micro_sft, tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_FAULT_SKIP_PUSH", "1")
    # the toy reward: the micro model is rarely right on the task, and with all rewards 0 nothing would change
    cfg = _config(task_files, tmp_path, _first_digit_one(tmp_path), "train.world_size=1", "train.zero_stage=2")
    with pytest.raises(SyncError, match=r"weight sync check failed: vLLM engine log-probs differ from the learner's by"):
        run_rl(cfg, micro_sft)
    assert ray_processes() == []
    assert not list(tmp_path.glob("rl-*/checkpoint"))


def test_a_run_that_learns_nothing_fails_and_says_why(task_files, micro_sft, tmp_path):
    """Every reward 0: each GRPO group's rewards are equal, every advantage is 0 and the policy cannot move. Each such
    step is logged (zero_std_share 1) and warned about; algo.max_steps_without_signal in a row fail the stage with
    what happened and where to look, before anything is committed."""
    func = tmp_path / "never.py"
    func.write_text("def reward_func(queries, prompts, labels):\n    return {'rewards': [0.0] * len(queries)}\n")
    cfg = _config(task_files, tmp_path, func, "train.world_size=1", "train.zero_stage=2", "algo.max_steps_without_signal=2")
    with pytest.raises(RuntimeError, match=r"RL: no learning signal in 2 steps in a row \(steps 1-2; algo.max_steps_without_signal=2\): "
                                           r"every reward was 0, so group_norm's advantages are all 0 and the policy has not "
                                           r"changed\. Look at the samples .*log_rollouts_every=1.* and at the reward source "
                                           r"\(reward\.func=.*never\.py\)"):
        run_rl(cfg, micro_sft)
    (run_dir,) = tmp_path.glob("rl-*")
    steps = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(s["step"], s["zero_std_share"], s["zero_advantage_share"], s["no_signal"]) for s in steps] == [(1, 1.0, 1.0, 1.0), (2, 1.0, 1.0, 1.0)]
    assert all(s["reward_mean"] == 0.0 and s["reward_std"] == 0.0 for s in steps)
    assert not (run_dir / "checkpoint").exists() and ray_processes() == []


def test_dynamic_filtering_keeps_the_batch_and_the_stop_penalty_and_is_correction_apply(task_files, micro_sft, tmp_path):
    """DAPO's filter on the toy reward: every trained group has a mean score strictly inside (0, 1), the batch
    keeps rollout_batch_size groups, the filtered share is logged; truncated responses get the stop-properly
    reward; TIS against an fp32 engine holding the learner's weights sees no gap (vllm_kl ~ 0)."""
    cfg = _config(task_files, tmp_path, _first_digit_one(tmp_path), "max_steps=2", "train.world_size=1", "train.zero_stage=2",
                  "log_rollouts_every=1", "algo.dynamic_filtering=[0.0, 1.0]", "algo.dynamic_filtering_max_batches=8",
                  "algo.stop_properly_penalty=-0.5", "algo.is_correction=tis")
    steps = metrics(run_rl(cfg, micro_sft))
    assert len(steps) == 2
    for k, m in enumerate(steps, start=1):
        rows = [json.loads(ln) for ln in (next(tmp_path.glob("rl-*")) / "rollouts" / f"step_{k}.jsonl").read_text().splitlines()]
        assert len(rows) == 8 * 4
        means = [sum(r["reward"] for r in rows[g * 4 : (g + 1) * 4]) / 4 for g in range(8)]
        assert all(0 < x < 1 for x in means), means
        drawn, share = m["prompts_drawn"], m["filtered_share"]
        assert drawn >= 8 and drawn % 8 == 0 and 0 <= share < 1
        assert drawn * (1 - share) >= 8 - 1e-9  # enough groups passed; the first 8 were trained on
        shaped = [-0.5 if r["truncated"] else r["reward"] for r in rows]
        assert m["truncated_share"] == pytest.approx(sum(r["truncated"] for r in rows) / 32)
        assert m["shaped_reward_mean"] == pytest.approx(sum(shaped) / 32, abs=1e-6)
        assert abs(m["vllm_kl"]) < 1e-3, m["vllm_kl"]
        # no group trained on has equal rewards: every one carries a learning signal
        assert (m["zero_std_share"], m["no_signal"]) == (0.0, 0.0) and m["zero_advantage_share"] < 1
    assert any(m["filtered_share"] > 0 for m in steps), [m["filtered_share"] for m in steps]
    assert 0 < sum(m["truncated_share"] for m in steps) < 2  # both kinds of ending occur


def test_async_training_learns_from_a_remote_reward_server_on_a_loopback_cluster_with_auth(task_files, micro_sft, tmp_path, monkeypatch):
    """Reward 1 for answers starting with the digit 1, from a remote reward server in OpenRLHF's protocol, one
    call per step. The engine samples step k+1 while the learners train step k: from step 2 on, the batch comes
    from the weights one update old, which the engine/learner gap shows (vllm_kl) and TIS corrects; the tiny
    model still learns the reward in a handful of steps and the probe check passes after every push.
    Meanwhile every listener of the run is on loopback, and a client without the cluster's token is refused."""
    import ipaddress

    monkeypatch.setenv("TOY_RM_TOKEN", "toy-token")
    server = _OpenRLHFRewardServer("toy-token")
    reward = {"url": server.url, "protocol": "openrlhf", "token_env": "TOY_RM_TOKEN"}
    cfg = _config(task_files, tmp_path, None, "max_steps=8", "train.world_size=1", "train.zero_stage=2",
                  "rollout.n_samples_per_prompt=8", "train.train_batch_size=32", "train.micro_train_batch_size=32",
                  "train.lr=3e-3", "algo.advantage_estimator=reinforce_baseline", "rollout.async=true",
                  "algo.is_correction=tis", reward=reward)
    try:
        with _Listeners() as listeners:
            steps = metrics(run_rl(cfg, micro_sft))
    finally:
        server.close()
    assert len(steps) == 8
    assert len(server.calls) == 8 and server.calls[0] == ["labels", "prompts", "query"]  # one call per step
    first, last = sum(s["reward_mean"] for s in steps[:2]) / 2, sum(s["reward_mean"] for s in steps[-2:]) / 2
    assert last > first + 0.25, [round(s["reward_mean"], 3) for s in steps]
    assert all(s["sync_logprob_diff"] <= 1e-3 for s in steps), [s["sync_logprob_diff"] for s in steps]
    assert abs(steps[0]["vllm_kl"]) < 1e-4  # step 1: sampled by the weights being trained
    assert max(abs(s["vllm_kl"]) for s in steps[1:]) > 1e-3, [s["vllm_kl"] for s in steps]  # later: one update old
    names = {n for n, _, _ in listeners.seen}
    assert {"gcs_server", "raylet"} <= names, names
    open_to_network = [(n, ip, port) for n, ip, port in listeners.seen
                       if not ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback]
    assert open_to_network == [], open_to_network
    assert listeners.refused is not None and "InvalidAuthToken" in listeners.refused, listeners.refused
    assert "RAY_AUTH_TOKEN" not in os.environ  # the token went with the cluster


def _retry_until_one(folder: Path) -> Path:
    """A two-turn toy agent the micro model can learn: every first answer gets "wrong, try again" (a chat turn);
    a second answer starting with the digit 1 earns 1."""
    agent = folder / "retry_agent.py"
    agent.write_text(
        "RETRY = {'role': 'user', 'content': 'wrong, try again'}\n"
        "def reset(prompt, label):\n"
        "    return {'turn': 0}, None\n"
        "def step(state, action_text):\n"
        "    state['turn'] += 1\n"
        "    if state['turn'] == 1:\n"
        "        return RETRY, 0.0, False, {'second_attempt_success': float('nan')}\n"
        "    hit = float(action_text.startswith('1'))\n"
        "    return None, hit, True, {'second_attempt_success': hit}\n"
    )
    return agent


def test_a_two_turn_agent_learns_its_second_attempt_on_exactly_the_tokens_it_sampled(task_files, micro_sft, tokenizer, tmp_path):
    """Token in, token out over two turns: the environment's tokens sit between the actions, out of the loss; the
    learner's log-probs of every action token equal vLLM's sampling log-probs in the same context (vllm_kl ~ 0 with
    fp32 on both sides), and the second attempt's success rises."""
    cfg = _config(task_files, tmp_path, None, "max_steps=8", "train.world_size=1", "train.zero_stage=2",
                  "rollout.n_samples_per_prompt=8", "train.train_batch_size=32", "train.micro_train_batch_size=32",
                  "train.lr=3e-3", "algo.advantage_estimator=reinforce_baseline", f"rollout.agent={_retry_until_one(tmp_path)}",
                  "rollout.max_turns=2", "algo.is_correction=tis", "log_rollouts_every=1", reward={},
                  eval_data={"paths": [str(task_files["eval"])], "prompt_key": "prompt", "label_key": "answer", "max_samples": 16})
    ref = run_rl(cfg, micro_sft)
    steps = metrics(ref)
    assert len(steps) == 8
    first = sum(s["second_attempt_success"] for s in steps[:2]) / 2
    last = sum(s["second_attempt_success"] for s in steps[-2:]) / 2
    assert last > first + 0.25, [round(s["second_attempt_success"], 3) for s in steps]
    assert all(s["turns"] == 2.0 for s in steps)
    assert max(abs(s["vllm_kl"]) for s in steps) < 1e-3, [s["vllm_kl"] for s in steps]
    retry = tokenizer("<|user|>wrong, try again<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
    rows = [json.loads(ln) for ln in (Path(ref.path).parent / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    for row in rows:
        ids, mask = row["response_ids"], row["action_mask"]
        env = [t for t, m in zip(ids, mask, strict=True) if m == 0]
        assert env == retry  # exactly one observation, tokenized as it was appended
        start = mask.index(0)
        assert start > 0 and ids[start : start + len(retry)] == retry  # right after the first action
        assert all(mask[start + len(retry) :])  # the second action, in the loss
        assert row["reward"] == float(tokenizer.decode(ids[start + len(retry) :], skip_special_tokens=True).startswith("1"))
    summary = read_manifest(ref.path).extra
    assert summary["final_eval"]["eval_turns"] == 2.0 and "eval_second_attempt_success" in summary["final_eval"]


def test_a_hung_learner_fails_the_step_at_its_deadline_naming_it(task_files, micro_sft, tmp_path, monkeypatch):
    from stages.rl.driver import CallTimeout

    monkeypatch.setenv("RLHF_FAULT_HANG", "learner.train:0")
    cfg = _config(task_files, tmp_path, _first_digit_one(tmp_path), "train.world_size=1", "train.zero_stage=2",
                  "ray.call_timeout_s=60")  # the start-up has its own deadline (ray.startup_timeout_s); a rollout
    # before the hang runs under this one too, and on a loaded 2-core CI machine it took over 15 s
    with pytest.raises(CallTimeout, match=r"learner rank\(s\) \[0\] of 1 gave no answer to train within 60 s \(ray.call_timeout_s\)"):
        run_rl(cfg, micro_sft)
    assert ray_processes() == []
    assert not list(tmp_path.glob("rl-*/checkpoint"))


def test_bad_reward_source_and_config_fail_before_ray_starts(task_files, micro_sft, tmp_path):
    """(A reward that turns non-finite inside a step stops it naming the source: tests/unit/test_rl_rewards.py;
    the loop's failures unwinding through the cluster's shutdown: the sync and deadline tests here.)"""
    bad = tmp_path / "bad.py"
    bad.write_text("def reward_func(q, p, l):\n    return {'rewards': [float('nan')] * len(q)}\n")
    cfg = _config(task_files, tmp_path, tmp_path / "missing.py", "train.world_size=1")
    with pytest.raises(RewardError, match="missing.py: not found"):
        run_rl(cfg, micro_sft)
    with pytest.raises(ValueError, match=r"train.train_batch_size: 12 does not divide the 32 samples"):
        _config(task_files, tmp_path, bad, "train.train_batch_size=12", "train.micro_train_batch_size=4", "train.world_size=1")
    with pytest.raises(ValueError, match=r"advantage_estimator: 'vtrace' is unknown; valid: dr_grpo, gae, group_norm"):
        _config(task_files, tmp_path, bad, "algo.advantage_estimator=vtrace")
    assert ray_processes() == [] and not list(Path("/tmp").glob(f"rlray-{os.getpid()}-*"))


def _constant_reward(folder: Path) -> Path:
    func = folder / "constant.py"
    func.write_text("def reward_func(queries, prompts, labels):\n    return {'rewards': [1.0] * len(queries)}\n")
    return func


def test_ppo_with_a_critic_the_value_loss_falls_and_the_policy_waits_while_the_critic_warms_up(task_files, micro_sft, tmp_path):
    """PPO-GAE with two ZeRO-3 critic ranks beside two ZeRO-3 policy ranks: with a reward of 1 for every
    sample the returns are 1 at every response token, so the critic's value loss must fall; for the first
    `critic.freezing_steps` steps the policy is not updated (and the engines keep their weights)."""
    from transformers import AutoModelForCausalLM

    cfg = _config(task_files, tmp_path, _constant_reward(tmp_path), "max_steps=6", "algo.advantage_estimator=gae",
                  "algo.gamma=1.0", "algo.lambd=0.95", critic={"lr": 3e-3, "freezing_steps": 2, "value_clip": None})
    ref = run_rl(cfg, micro_sft)
    steps = metrics(ref)
    assert [s.get("policy_frozen", 0.0) for s in steps] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert all("policy_loss" not in s for s in steps[:2]) and all("policy_loss" in s for s in steps[2:])
    losses = [s["critic_loss"] for s in steps]
    assert losses[-1] < 0.5 * losses[0], losses
    assert abs(steps[-1]["value_mean"] - 1.0) < abs(steps[0]["value_mean"] - 1.0)  # toward the return
    assert all(abs(s["return_mean"] - 1.0) < 0.5 for s in steps)  # A + V with lambda < 1: near the Monte-Carlo 1
    assert all(s["sync_logprob_diff"] <= 1e-3 for s in steps[2:])
    new = AutoModelForCausalLM.from_pretrained(ref.path, dtype=torch.float32)
    old = AutoModelForCausalLM.from_pretrained(micro_sft.path, dtype=torch.float32)
    assert not torch.equal(new.lm_head.weight, old.lm_head.weight)
    assert ray_processes() == []


def test_interrupted_ppo_run_resumes_policy_and_critic_to_the_same_trajectory(task_files, micro_sft, tmp_path, monkeypatch):
    arith = ROOT / "recipes/rewards/arithmetic.py"
    common = ("max_steps=4", "train.world_size=1", "train.zero_stage=2", "train.save_steps=2", "algo.advantage_estimator=gae")
    critic = {"lr": 1e-3, "freezing_steps": 1}
    full = metrics(run_rl(_config(task_files, tmp_path / "a", arith, *common, critic=critic), micro_sft))
    cfg = _config(task_files, tmp_path / "b", arith, *common, critic=critic)
    monkeypatch.setenv("RLHF_FAULT_STEP", "3")
    with pytest.raises(RuntimeError, match="injected fault after RL step 3"):
        run_rl(cfg, micro_sft)
    monkeypatch.delenv("RLHF_FAULT_STEP")
    assert ray_processes() == []
    resumed = metrics(run_rl(_config(task_files, tmp_path / "b", arith, *common, "train.resume=true", critic=critic), micro_sft))
    assert [s["step"] for s in resumed] == [1, 2, 3, 4]
    for a, b in zip(full, resumed):
        assert a["reward_mean"] == b["reward_mean"] and a["response_length"] == b["response_length"]
        assert abs(a["critic_loss"] - b["critic_loss"]) < 1e-6 and abs(a["value_mean"] - b["value_mean"]) < 1e-6
        assert abs(a.get("policy_loss", 0.0) - b.get("policy_loss", 0.0)) < 1e-6
    assert resumed[2]["sync_logprob_diff"] <= 1e-3  # the resumed weights were pushed and verified


def test_lora_rl_pushes_merged_weights_and_outputs_an_adapter_that_merges(task_files, micro_sft, tmp_path):
    """The policy trains a LoRA adapter under ZeRO-3; vLLM gets the merged weights (every push verified by the
    probe); the stage outputs an adapter on the SFT policy, which the LoRA merge stage folds in."""
    from transformers import AutoModelForCausalLM

    from stages.lora_merge import LoraMergeConfig, run_lora_merge

    cfg = _config(task_files, tmp_path, _first_digit_one(tmp_path), "train.world_size=1", "train.lr=1e-2",
                  lora={"rank": 8, "alpha": 16})
    ref = run_rl(cfg, micro_sft)
    m = read_manifest(ref.path)
    assert (m.kind, m.parent, m.base) == ("adapter", micro_sft.digest, micro_sft.digest)
    assert (Path(ref.path) / "adapter_model.safetensors").is_file() and not (Path(ref.path) / "model.safetensors").exists()
    steps = metrics(ref)
    assert all(s["sync_logprob_diff"] <= 1e-3 for s in steps)  # vLLM runs base + adapter, merged
    merged = run_lora_merge(LoraMergeConfig(output_root=str(tmp_path)), ref, micro_sft)
    assert read_manifest(merged.path).kind == "full"
    new = AutoModelForCausalLM.from_pretrained(merged.path, dtype=torch.float32)
    old = AutoModelForCausalLM.from_pretrained(micro_sft.path, dtype=torch.float32)
    q_new, q_old = new.model.layers[0].self_attn.q_proj.weight, old.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q_new, q_old) and torch.equal(new.lm_head.weight, old.lm_head.weight)  # adapters on linear layers
    assert ray_processes() == []


def test_save_best_outputs_the_best_rl_step_and_keeps_the_last_beside_it(task_files, micro_sft, tmp_path):
    """train.save_best in RL: each improved step's policy is exported (collectively, by two ZeRO-3 learners); the stage's output is the best step by the logged metric (checked
    against metrics.jsonl), the last step's committed beside it. kl/min: the policy equals the reference at step 1
    (kl 0) and moves after, so the best step is 1 and its weights differ from the last step's."""
    from safetensors.torch import load_file

    cfg = _config(task_files, tmp_path, _first_digit_one(tmp_path), "algo.init_kl_coef=0.05", "algo.kl_estimator=k3",
                  "train.lr=1e-2", 'train.save_best={"metric": "kl", "mode": "min"}')
    ref = run_rl(cfg, micro_sft)
    run_dir = Path(ref.path).parent
    rows = metrics(ref)
    values = [r["kl"] for r in rows]
    step = rows[values.index(min(values))]["step"]
    assert step == 1 and len(rows) == 3, values
    m = read_manifest(ref.path)
    assert m.extra["best"] == {"metric": "kl", "mode": "min", "step": 1, "value": pytest.approx(values[0])}
    last = run_dir / "checkpoint-last"
    assert m.extra["last"] == verify(last).digest and read_manifest(last).extra["last_step"] is True
    verify(ref)
    best_w, last_w = load_file(str(Path(ref.path) / "model.safetensors")), load_file(str(last / "model.safetensors"))
    assert best_w.keys() == last_w.keys() and not all(torch.equal(best_w[k], last_w[k]) for k in best_w)
    start = load_file(str(Path(micro_sft.path) / "model.safetensors"))
    assert not all(torch.equal(best_w[k], start[k]) for k in best_w)  # step 1's update, not the starting policy
    assert not (run_dir / "best").exists() and ray_processes() == []


TIMINGS = ("_s", "_per_s")


def _trajectory(ref) -> list[dict]:
    """A run's step metrics less its timings (the numbers a transport must not change)."""
    return [{k: v for k, v in s.items() if not k.endswith(TIMINGS)} for s in metrics(ref)]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_broadcast_and_object_store_pushes_give_the_same_trajectory(task_files, micro_sft, tmp_path, lora):
    """sync.transport broadcast (learner rank 0 and both engines' workers in one gloo group, the weights sent module
    by module) and object_store (one safetensors blob through Ray's object store): fp32 on both sides, so the
    same seeds give the same samples and every step's metrics agree within 1e-6; every push passes the probe.
    With LoRA the merged weights travel the same way. Two engines, two ZeRO-3 learners."""
    extra = {"lora": {"rank": 8, "alpha": 16}} if lora else {}
    runs = {}
    for transport in ("broadcast", "object_store"):
        root = tmp_path / transport
        cfg = _config(task_files, root, _first_digit_one(tmp_path), "rollout.num_engines=2", f"sync.transport={transport}",
                      "train.lr=1e-2", **extra)
        runs[transport] = _trajectory(run_rl(cfg, micro_sft))
    ours, theirs = runs["broadcast"], runs["object_store"]
    assert [s["step"] for s in ours] == [1, 2, 3]
    assert all(s["sync_logprob_diff"] <= 1e-3 for s in ours), [s["sync_logprob_diff"] for s in ours]
    assert any(s["grad_norm"] > 0 for s in ours)  # the policy trained: there were new weights to push
    for a, b in zip(ours, theirs, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], abs=1e-6, nan_ok=True), (a["step"], k, a[k], b[k])
    assert ray_processes() == []


def test_a_tensor_parallel_engine_receives_every_push(task_files, micro_sft, tmp_path):
    """rollout.tensor_parallel_size=2: one engine of two workers (vLLM's multiprocess executor on the CPU build),
    each joining the weight-sync group and loading its shard of every push; the probe (fp32) agrees after each."""
    cfg = _config(task_files, tmp_path, _first_digit_one(tmp_path), "rollout.tensor_parallel_size=2", "train.world_size=1",
                  "train.lr=1e-2")
    ref = run_rl(cfg, micro_sft)
    steps = metrics(ref)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["sync_logprob_diff"] <= 1e-3 for s in steps), [s["sync_logprob_diff"] for s in steps]
    assert ray_processes() == []


def test_an_engine_that_dies_mid_push_fails_the_step_at_once_naming_it(task_files, micro_sft, tmp_path, monkeypatch):
    """Engine 1 of 2 dies after receiving 3 tensors of the first broadcast: the step fails with the engine named,
    long before the call deadline (the learner and engine 0 are still blocked in the broadcast), and the cluster
    goes with it."""
    import time

    from stages.common.cluster import ActorFailed

    monkeypatch.setenv("RLHF_FAULT_ENGINE_DIES", "1:3")
    cfg = _config(task_files, tmp_path, _first_digit_one(tmp_path), "rollout.num_engines=2", "train.world_size=1",
                  "ray.call_timeout_s=300")
    started = time.monotonic()
    with pytest.raises(ActorFailed, match=r"RL stage: engine rank 1 of 2 failed during receive_weights: "):
        run_rl(cfg, micro_sft)
    assert time.monotonic() - started < 150  # the whole run, start-up included, well inside the 300 s deadline
    assert ray_processes() == []
    assert not list(tmp_path.glob("rl-*/checkpoint"))


def test_reward_model_as_the_reward_source(task_files, micro_sft, tokenizer, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from stages.reward_model import RewardModelConfig, run_reward_model, score_padded

    rm = run_reward_model(RewardModelConfig.model_validate({
        "data": {"paths": [str(task_files["preference"])], "max_len": 64},
        "eval_data": {"paths": [str(task_files["preference_eval"])], "max_len": 64},
        "train": {"dtype": "fp32", "train_batch_size": 8, "micro_train_batch_size": 8, "max_steps": 2, "progress_bar": False},
        "output_root": str(tmp_path),
    }), micro_sft)
    # PPO with a critic: it starts from the reward model (its body and score head), as in OpenRLHF
    cfg = _config(task_files, tmp_path, ROOT / "recipes/rewards/arithmetic.py", "max_steps=1", "log_rollouts_every=1",
                  "train.world_size=1", "train.zero_stage=2", "algo.normalize_reward=true", "algo.advantage_estimator=gae",
                  reward={"model": rm.path})
    out = run_rl(cfg, micro_sft, reward_model=rm)  # the stage's CLI and the flows resolve reward.model into it
    rows = [json.loads(ln) for ln in (Path(out.path).parent / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert len(rows) == 32
    model = AutoModelForSequenceClassification.from_pretrained(rm.path, num_labels=1, dtype=torch.float32).eval()
    mean, std = model.config.reward_mean, model.config.reward_std
    with torch.no_grad():
        for r in rows[:6]:
            ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
            score = score_padded(model, ids, torch.ones_like(ids)).item()
            assert r["reward"] == pytest.approx((score - mean) / std, abs=1e-4)
    with pytest.raises(Exception, match=r"a 'full' checkpoint \(from stage 'sft'\) was given as the RL reward model"):
        run_rl(_config(task_files, tmp_path, ROOT / "recipes/rewards/arithmetic.py", "train.world_size=1",
                       reward={"model": micro_sft.path}), micro_sft, reward_model=micro_sft)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_killed_rl_stage_leaves_no_ray_process_and_no_temp_folder(task_files, micro_sft, tmp_path, sig):
    """SIGTERM unwinds through the cluster's shutdown; after SIGKILL the reaper ends the cluster's processes
    and removes its temp folder."""
    import signal
    import subprocess
    import sys
    import time

    cfg = _config(task_files, tmp_path, ROOT / "recipes/rewards/arithmetic.py", "max_steps=500",
                  "train.world_size=1", "train.zero_stage=2")
    (tmp_path / "cfg.json").write_text(cfg.model_dump_json())
    script = (
        "import sys; sys.path.insert(0, {!r})\n"
        "from checkpoints import load_ref\nfrom stages.rl.config import RLConfig\nfrom stages.rl.driver import run_rl\n"
        "run_rl(RLConfig.model_validate_json(open({!r}).read()), load_ref({!r}))\n"
    ).format(str(ROOT), str(tmp_path / "cfg.json"), micro_sft.path)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    metrics = None
    while time.time() < deadline and proc.poll() is None:
        found = list(tmp_path.glob("rl-*/metrics.jsonl"))
        if found and found[0].read_text().count("\n") >= 1:
            metrics = found[0]
            break
        time.sleep(1)
    assert metrics is not None, "the RL run did not finish step 1"
    assert ray_processes() != []
    folders = list(Path("/tmp").glob(f"rlray-{proc.pid}-*"))
    assert len(folders) == 1
    proc.send_signal(getattr(signal, sig))
    assert proc.wait(timeout=120) != 0
    deadline = time.time() + 30
    while time.time() < deadline and (ray_processes() or folders[0].exists()):
        time.sleep(0.5)
    assert ray_processes() == []
    assert not folders[0].exists()
    assert not list(tmp_path.glob("rl-*/checkpoint"))


@pytest.mark.gpu
def test_on_cuda_one_learner_and_one_engine_train_and_sync(task_files, micro_sft, tmp_path):
    """The GPU path (NCCL, the actor's own visible GPU as device 0, vLLM on CUDA): two steps, every push verified."""
    cfg = _config(task_files, tmp_path, _first_digit_one(tmp_path), "max_steps=2", "train.world_size=1",
                  "train.zero_stage=3", "train.dtype=bf16", "rollout.dtype=bfloat16", "sync_tolerance=0.05")
    steps = metrics(run_rl(cfg, micro_sft))
    assert [s["step"] for s in steps] == [1, 2] and all(s["sync_logprob_diff"] <= 0.05 for s in steps)
    assert ray_processes() == []
