"""The model presets' shapes (random-init from a config): plain data, importable without torch or transformers, so
that `rlspec plan` checks `model.preset` without loading either."""

from __future__ import annotations

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
BYTE_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256
"""The byte-level tokenizer of the presets (`rlspec.models.base.byte_tokenizer`): 4 specials, then one id per byte."""

# Shapes only; weights are random. `vocab_size` may exceed the byte vocabulary to keep a real model's
# embedding and LM-head cost (ids past the tokenizer's vocabulary decode to nothing).
PRESETS: dict[str, dict] = {
    "tiny_qwen2": dict(model_type="qwen2", vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, tie_word_embeddings=True),
    "qwen2_0p5b_shape": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                             num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                             max_position_embeddings=4096, tie_word_embeddings=True),
    # The published Qwen2.5-1.5B and -7B shapes (random weights): the scale runs on 4-8 GPUs.
    "qwen2_1p5b_shape": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                             num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                             max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2_7b_shape": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                           num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                           max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # Qwen2-0.5B's tensor count (24 layers, 291 state-dict entries) at tiny_qwen2's width: a weight sync of it
    # moves ~1 MB, so its time is the fixed per-push and per-tensor cost (`python -m rlspec.perf.bench_sync`).
    "qwen2_24l_tiny": dict(model_type="qwen2", vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=24, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512, tie_word_embeddings=True),
}

# Shapes only; weights are random. The vision patch equals one 8-pixel grid cell of a MiniGrid view, so a
# 56x56 image gives 49 image tokens (the CLS feature is dropped: vision_feature_select_strategy=default).
VLA_PRESETS: dict[str, dict] = {
    "tiny_llava": dict(
        image_size=56, patch_size=8,
        vision=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512),
    ),
}
