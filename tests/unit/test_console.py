"""The quiet console (flows/console.py): a stage's own warnings relayed from its log file, nothing else."""

from flows.console import StageConsole, verbose


def test_only_a_stage_s_own_warnings_reach_the_console_each_once(tmp_path, capsys, monkeypatch):
    log = tmp_path / "stage.log"
    log.write_text("\x1b[36m(Learner pid=4044)\x1b[0m /x/c10d_logger.py:83: FutureWarning: deprecated\n"
                   "(MainProcess pid=1) WARNING 12-07 08:10:28 [cpu_worker.py:1] NUMA binding\n"
                   "rl:  10%|#         | 3/30\r[rl] WARNING: no learning signal at step 3: every reward was 0\n"
                   "[rl] removed runs/x/.checkpoint.partial-1 (a save whose writer is gone)\n[rl] WARNING: half a li")
    console = StageConsole("rl", log)
    console.update(10.0, "step 3/30, reward_mean 0; eval ...")
    assert console.bar.n == 10.0
    with open(log, "a") as f:
        f.write("ne\n[eval] ERROR: grader raised\n")
    console.close()
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["[rl] WARNING: no learning signal at step 3: every reward was 0", "[rl] WARNING: half a line",
                       "[eval] ERROR: grader raised"]
    for env, value, expected in [("RLHF_VERBOSE", "1", True), ("RLHF_VERBOSE", "0", False), ("LOG_LEVEL", "debug", True)]:
        monkeypatch.delenv("RLHF_VERBOSE", raising=False)
        monkeypatch.delenv("LOG_LEVEL", raising=False)
        monkeypatch.setenv(env, value)
        assert verbose() is expected
