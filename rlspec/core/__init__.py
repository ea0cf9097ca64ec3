"""The GRPO core: the math (`grpo`), the batch and the policy's log-probs, the Backend protocol, the step template."""
