"""PPO's critic: one rank of its own DeepSpeed group (a Ray actor beside the policy learners).

The model is ``AutoModelForTokenClassification`` with one label: the transformer body under ``.model``
and a linear ``score`` head giving a value at every position, so it loads from a reward-model checkpoint
(``...ForSequenceClassification``: the same body and ``score`` weight; OpenRLHF initialises its critic
from the reward model too) or from the policy (a new head), and saves as a folder transformers loads.
The value of the state before response token ``t`` is the head's output at position ``t - 1``, aligned
with the policy's log-probs (``stages.common.logprobs.token_logps``). Loss: the clipped value loss of
``stages.rl.algorithms.value_loss`` aggregated like the policy loss, with its own ``critic.lr``.
"""

from __future__ import annotations

import torch

from stages.rl.algorithms import aggregate, value_loss
from stages.rl.experience import TrainBatch, used_width
from stages.rl.learner import Rank


def load_critic_model(path: str):
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0  # no dropout before the head (transformers' token classifiers default to 0.1)
    return AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32, use_safetensors=True)


def state_values(logits: torch.Tensor) -> torch.Tensor:
    """[B, T, 1] head outputs -> [B, T] values, entry t the value of the state before token t (entry 0: 0)."""
    v = logits.squeeze(-1).float()
    return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)


class Critic(Rank):
    def setup(self, config: dict, init_path: str, total_updates: int, master: tuple[str, int]) -> bool:
        from stages.common import trainer
        from stages.common.config import LoraConfig

        self._join(config, master)
        train = self.cfg.train.model_copy(update={"lr": self.cfg.critic.lr})
        self.eng = trainer.build_engine(init_path, train, LoraConfig(), total_updates, load_critic_model)
        return True

    def _values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from stages.common.trainer import device

        out = self.eng.engine(input_ids=input_ids.to(device()), attention_mask=attention_mask.to(device()), use_cache=False)
        return state_values(out.logits)

    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Values of this rank's shard at rollout time (no grad), micro-batch by micro-batch."""
        from torch.nn.functional import pad

        micro = self.cfg.train.micro_train_batch_size
        width = batch["input_ids"].shape[1]
        out = []
        self.eng.engine.eval()
        with torch.no_grad():
            for i in range(0, batch["input_ids"].shape[0], micro):
                attn = batch["attention_mask"][i : i + micro]
                w = used_width(attn)  # without the padding columns the micro-batch's rows share
                out.append(pad(self._values(batch["input_ids"][i : i + micro, :w], attn[:, :w]).cpu(), (0, width - w)))
        self.eng.engine.train()
        return torch.cat(out)

    def train(self, updates: list[TrainBatch]) -> dict[str, float]:
        """One pass over this rank's shares of the step's optimizer steps: regress the values on the returns."""
        cfg = self.cfg
        clip = cfg.critic.value_clip

        def micro_loss(part: TrainBatch):
            mask = part.response_mask.float()
            keep = mask.bool()
            values = self._values(part.input_ids, part.attention_mask)
            per_token = value_loss(values, part.old_values, part.returns, mask, clip)
            moved = (values.detach() - part.old_values).abs() > clip if clip is not None else torch.zeros_like(keep)
            return aggregate(per_token, mask, cfg.algo.loss_agg, part.normaliser), {
                "critic_loss": float(per_token.detach().sum()), "values": float(torch.where(keep, values.detach(), 0.0).sum()),
                "critic_clip_ratio": float((moved & keep).float().sum()), "tokens": float(mask.sum())}

        return self._passes(updates, micro_loss, prefix="critic_")
