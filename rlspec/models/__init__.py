"""Model and tokenizer factories: tiny presets from a config (random init), local HF directories, VLA policies."""
