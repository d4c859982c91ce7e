"""Reward-model scoring shared by the stages that read a reward checkpoint: the reward-model stage (training,
eval), RL (a reward source), eval (its ``reward`` metric) and ``stages.serve_rm``.

A reward model is a 1-label ``...ForSequenceClassification``: the transformer body and a linear ``score``
head, read at each sequence's last real token.
"""

from __future__ import annotations

import torch


def backbone_and_head(module):
    """The transformer body and the ``score`` head of a (possibly peft-wrapped) sequence classifier."""
    model = module.get_base_model() if hasattr(module, "get_base_model") else module
    return getattr(model, model.base_model_prefix), model.score


def sequence_scores(module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The head's output at each sequence's last token: [number of sequences]."""
    body, head = backbone_and_head(module)
    inputs = {k: batch[k] for k in ("input_ids", "position_ids", "attention_mask") if k in batch}
    hidden = body(**inputs, use_cache=False).last_hidden_state
    values = head(hidden).squeeze(-1).float()
    return values.flatten()[batch["last_index"]]


def score_padded(module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Scores [B] of a left- or right-padded batch: positions follow the mask, read at the last real token."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    width = attention_mask.shape[1]
    last = width - 1 - attention_mask.flip(-1).argmax(-1)
    batch = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "attention_mask": attention_mask,
        "last_index": torch.arange(input_ids.shape[0], device=input_ids.device) * width + last,
    }
    return sequence_scores(module, batch)



class RewardModelScorer:
    """A reward-model checkpoint scoring token-id sequences (a Ray actor in the RL stage, a rank of the eval stage, the model behind ``stages.serve_rm``).

    Scores are read at each sequence's last token (:func:`score_padded`); with
    ``normalize`` they become (score - reward_mean) / reward_std from the checkpoint's config
    (``normalize=None``: when the config has them).
    """

    def __init__(self, path: str, normalize: bool | None, batch_size: int = 64, dtype: str = "fp32"):
        """On the process's GPU when it sees one (a Ray actor given a GPU share), else the CPU; ``dtype``: bf16 or
        fp32 (the RL stage passes its learners' on GPUs, fp32 on CPU, where bf16 scores differ between CPUs)."""
        from transformers import AutoModelForSequenceClassification

        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32).to(self.device).eval()
        cfg = self.model.config
        self.pad = cfg.pad_token_id
        self.batch_size = batch_size
        self.source = f"reward model {path}"
        mean, std = getattr(cfg, "reward_mean", None), getattr(cfg, "reward_std", None)
        has_stats = mean is not None and bool(std)
        if normalize and not has_stats:
            raise ValueError(f"{self.source}: normalize_reward needs reward_mean/reward_std in its config.json (train it with eval_data)")
        self.norm = (float(mean), float(std)) if has_stats and normalize is not False else None

    def score(self, sequences: list[list[int]]) -> list[float]:
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
                out += score_padded(self.model, ids.to(self.device), mask.to(self.device)).float().cpu().tolist()
        if self.norm is not None:
            out = [(s - self.norm[0]) / self.norm[1] for s in out]
        return out
