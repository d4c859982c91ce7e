"""The training-curves artifact's parts: which metrics are drawn, the table a reader sees, the y scale."""

from __future__ import annotations

import base64
import json
import re

from flows.curves import artifact_key, load_rows, markdown, panels, parse_table, table
from stages.common.plots import y_scale


def rl_rows(n: int) -> list[dict]:
    rows = []
    for s in range(1, n + 1):
        r = {"step": s, "policy_loss": 0.1 / s, "reward_mean": 0.2 + 0.01 * s, "reward_std": 0.3, "kl": 0.001 * s,
             "entropy": 1.5, "response_length": 30.0 + s, "generate_s": 1.2, "lr": 1e-4, "clip_ratio": 0.0}
        if s % 5 == 0:
            r["eval_accuracy"] = 0.1 * s / n
        rows.append(r)
    return rows


def test_panels_pair_train_and_held_out_and_leave_timings_and_spreads_to_the_log():
    rows = [{"step": 1, "loss": 2.0, "gen_s": 0.1, "reward_std": 0.2, "lr": 1e-3, "accuracy": 0.5, "eval_loss": 2.5},
            {"step": 2, "loss": 1.5, "kl": 0.1, "eval_accuracy": 0.6, "flag": True, "note": "x"}]
    assert panels(rows) == {"loss": ["loss", "eval_loss"], "accuracy": ["accuracy", "eval_accuracy"], "kl": ["kl"]}
    assert list(panels(rl_rows(10))) == ["policy_loss", "reward_mean", "accuracy", "kl", "entropy", "response_length"]


def test_table_spreads_rows_over_the_log_and_reads_back():
    rows = rl_rows(100)
    text = table(rows, ["policy_loss", "eval_accuracy"], max_rows=30)
    back = parse_table(text)
    steps = [s for s, _ in back["policy_loss"]]
    assert len(steps) == 30 and steps[0] == 1 and steps[-1] == 100 and steps == sorted(set(steps))
    for s, v in back["policy_loss"]:
        assert abs(v - 0.1 / s) <= 5e-4 * (0.1 / s)  # 4 significant digits
    assert all(s % 5 == 0 for s, _ in back["eval_accuracy"])  # held-out values only on their steps


def test_markdown_is_self_contained_with_a_png_and_every_plotted_metric_in_the_table(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rl_rows(12)) + '{"step": 13, "policy')  # torn last line
    rows = load_rows(log)
    assert [r["step"] for r in rows] == list(range(1, 13))
    md = markdown("rl", "rl", rows, str(log), final=True)
    uris = re.findall(r"!\[[^\]]*\]\(([^)]*)\)", md)
    assert len(uris) == 1 and uris[0].startswith("data:image/png;base64,") and "file:" not in md
    assert base64.b64decode(uris[0].split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    back = parse_table(md)
    assert set(back) == {k for ks in panels(rows).values() for k in ks}
    assert len(back["reward_mean"]) == 12 and len(back["eval_accuracy"]) == 2
    assert "12 logged steps, finished" in md
    assert markdown("sft", "sft", [], str(log), final=False).endswith(f"No plottable metrics logged yet (`{log}`).\n")


def test_y_scale_keeps_small_values_visible_beside_a_random_base():
    assert y_scale([521.0, 2.1, 0.4]) == {"value": "log"}
    assert y_scale([521.0, 0.0, 0.4]) == {"value": "symlog", "linthresh": 0.4}
    assert y_scale([0.1, 0.5, 3.0]) == {"value": "linear"}
    assert y_scale([-1.0, 500.0, 0.01]) == {"value": "linear"}
    assert y_scale([0.0, 0.0]) == {"value": "linear"}


def test_artifact_keys_are_what_prefect_accepts():
    assert artifact_key("RL_tiny.v2") == "rl-tiny-v2-curves"
