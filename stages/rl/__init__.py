"""The RL stage: Ray cluster per task, vLLM rollouts, DeepSpeed ZeRO-3 learners, verified weight sync."""
