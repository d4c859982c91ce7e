"""Held-out pairwise accuracy of a reward model, loaded the way other tools load it, by kind of pair.

Loads the RM checkpoint with ``AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)``
(fp32, transformers alone), scores every held-out pair of the default task and reports the accuracy
overall and per kind of rejected answer (a bare wrong sum, or a worked answer with a slip), side by side
with a baseline measured on the same pairs: "prefer the longer answer", the heuristic a reward model
that only learned the format would match. Prints a table and writes bench/results/rm_accuracy.json.

Run: ``python -m bench.rm_accuracy RM_PATH [pairs=data/arithmetic/preference_eval.jsonl]``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).parent / "results" / "rm_accuracy.json"
ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from datasets_prep.synthetic import WORKED_PREFIX

    args = list(sys.argv[1:] if argv is None else argv)
    path = args[0]
    opts = dict(a.split("=", 1) for a in args[1:])
    pairs_file = Path(opts.get("pairs", ROOT / "data/arithmetic/preference_eval.jsonl"))
    rows = [json.loads(ln) for ln in pairs_file.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32).eval()

    def score(prompt: str, response: str) -> float:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=False)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            return model(input_ids=ids).logits[0, 0].item()

    kinds: dict[str, dict[str, int]] = {}
    for r in rows:
        kind = "worked with a slip" if r["rejected"].startswith(WORKED_PREFIX) else "bare wrong sum"
        k = kinds.setdefault(kind, {"pairs": 0, "rm": 0, "longer": 0})
        k["pairs"] += 1
        k["rm"] += score(r["prompt"], r["chosen"]) > score(r["prompt"], r["rejected"])
        k["longer"] += len(r["chosen"]) > len(r["rejected"])
    kinds["all"] = {c: sum(k[c] for k in kinds.values()) for c in ("pairs", "rm", "longer")}
    table = [{"rejected": name, "pairs": k["pairs"], "reward_model": round(k["rm"] / k["pairs"], 4),
              "baseline_prefer_longer": round(k["longer"] / k["pairs"], 4)} for name, k in kinds.items()]
    cols = ["rejected", "pairs", "reward_model", "baseline_prefer_longer"]
    print(f"\nPairwise accuracy on {pairs_file} ({path}, AutoModelForSequenceClassification, fp32)\n")
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for t in table:
        print("| " + " | ".join(str(t[c]) for c in cols) + " |")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"reward_model": path, "pairs": str(pairs_file), "rows": table}, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
