"""Graders by reference (built-ins, module:function, files) and the math grader on hand-checked answers."""

import pytest

from stages.common.graders import grade, load_grader, math_reward_func
from stages.common.plugins import PluginError, source_file
from stages.rl.rewards import RewardError, load_reward_func

# GSM8K-style rows: the label is the dataset's solution text ending in "#### N"
GSM8K = [
    ("Natalia sold 48 clips in April and half as many in May. How many in all?",
     "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn all: 48+24 = <<48+24=72>>72.\n#### 72"),
    ("Weng earns $12 an hour. She did 50 minutes of babysitting. How much did she earn?",
     "12/60 = $<<12/60=0.2>>0.2 per minute.\n0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"),
]
# (response, row, right?): checked by hand
RESPONSES = [
    ("She sold 24 in May, so 48 + 24 = 72.\n#### 72", 0, True),
    ("The total is \\boxed{72}.", 0, True),
    ("#### 24", 0, False),  # the May figure, not the answer
    ("She earned $10.00 in all. #### 10.00", 1, True),
    ("\\boxed{\\frac{20}{2}}", 1, True),
    ("I am not sure.", 1, False),
]


def test_math_grader_on_hand_checked_gsm8k_answers():
    math = load_grader("math")
    verdicts = [grade(math, r, GSM8K[i][1], f"row {k}") for k, (r, i, _) in enumerate(RESPONSES)]
    assert verdicts == [float(ok) for _, _, ok in RESPONSES]
    # accuracy as the eval stage computes it: 4 of the 6 responses are right
    assert sum(verdicts) / len(verdicts) == pytest.approx(4 / 6)
    assert grade(math, "The farm has 1,234 sheep.\n#### 1,234", "#### 1234", "r") == 1.0  # separators dropped
    # the same check as an OpenRLHF reward_func on prompt + response texts
    prompts = [GSM8K[i][0] for _, i, _ in RESPONSES]
    out = math_reward_func([p + r for p, (r, _, _) in zip(prompts, RESPONSES)], prompts, [GSM8K[i][1] for _, i, _ in RESPONSES])
    assert out["rewards"] == verdicts
    assert grade(math, "so x = 0.5", "\\frac12", "r") == 1.0 and grade(math, "x = 0.6", "1/2", "r") == 0.0


def test_arithmetic_builtin_is_the_default_task_check():
    g = load_grader("arithmetic")
    assert grade(g, "3+4: 7", "7", "r") == 1.0 and grade(g, "7 then 8", "7", "r") == 0.0


def test_references_resolve_to_files_and_modules_and_bad_ones_are_named(tmp_path):
    f = tmp_path / "my_grader.py"
    f.write_text("def grade(response, label):\n    return response.strip() == label\n\ndef half(response, label):\n    return 0.5\n")
    assert grade(load_grader(str(f)), " yes ", "yes", "r") == 1.0
    assert grade(load_grader(f"{f}:half"), "x", "y", "r") == 0.5
    assert load_grader("datasets_prep.synthetic:is_correct")("so 5", "5") is True
    assert source_file(f"{f}:half") == str(f) and source_file("stages.common.graders:math_correct").endswith("graders.py")
    with pytest.raises(PluginError, match=r"grader .*my_grader.py:nope: defines no callable 'nope\(response, label\)'"):
        load_grader(f"{f}:nope")
    with pytest.raises(PluginError, match=r"grader no_such_pkg.mod:f: module 'no_such_pkg.mod' failed to import"):
        load_grader("no_such_pkg.mod:f")
    with pytest.raises(RuntimeError, match=r"grader returned 2 on row 3; expected a bool or a number in \[0, 1\]"):
        grade(lambda r, lab: 2, "a", "b", "row 3")
    # reward funcs use the same loader: a module reference and a file's reward_func
    assert load_reward_func("stages.common.graders:math_reward_func") is math_reward_func
    with pytest.raises(RewardError, match=r"reward func .*missing.py: not found"):
        load_reward_func(str(tmp_path / "missing.py"))
