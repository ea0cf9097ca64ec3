"""The Ray rank group that the deepspeed and fsdp backends share, and the Ray helpers under it."""
