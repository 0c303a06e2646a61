"""Online RL: prompts, rewards, generation in the training processes, rollouts and their figures (GRPO)."""
