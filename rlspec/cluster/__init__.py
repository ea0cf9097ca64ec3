"""The Ray rank group that the deepspeed and fsdp backends share, the Ray helpers under it, and how a step's prompts
reach several rollout engines (`dispatch`)."""
