"""The model presets' shapes (random-init from a config) and the model types the fast engine runs: plain data,
importable without torch or transformers, so that `rlspec plan` checks `model.preset` and says which path generation
takes without loading either."""

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
    # Qwen3 dense: RMS norms on each head's q and k; head_dim set apart from hidden / heads (as Qwen3's own configs).
    "tiny_qwen3": dict(model_type="qwen3", vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       max_position_embeddings=512, tie_word_embeddings=True),
    # The published Qwen3-0.6B and Qwen3-1.7B shapes (random weights).
    "qwen3_0p6b_shape": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                             num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                             max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen3_1p7b_shape": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                             num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                             max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True),
    # Gemma 3 (text): sliding-window layers (a window of 4 here, so CPU tests reach it) between full ones, each kind
    # with its own RoPE base, (1 + w) RMS norms before and after attention and the MLP and on q and k, GeGLU,
    # embeddings scaled by sqrt(hidden), and a query scale other than head_dim's.
    "tiny_gemma3": dict(model_type="gemma3_text", vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        query_pre_attn_scalar=24, sliding_window=4,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        max_position_embeddings=512, rope_theta=1e6, rope_local_base_freq=1e4,
                        tie_word_embeddings=True),
    # The published Gemma-3-1B shape (random weights): 26 layers, five sliding (512) to one full, 262k vocabulary.
    "gemma3_1b_shape": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                            num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                            query_pre_attn_scalar=256, sliding_window=512, max_position_embeddings=32768,
                            rope_theta=1e6, rope_local_base_freq=1e4, rms_norm_eps=1e-6, tie_word_embeddings=True),
    # Gemma 2: as Gemma 3 without the q/k norms, with soft-capped attention scores and final logits.
    "tiny_gemma2": dict(model_type="gemma2", vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        query_pre_attn_scalar=24, sliding_window=4, attn_logit_softcapping=50.0,
                        final_logit_softcapping=30.0, max_position_embeddings=512, tie_word_embeddings=True),
    # Llama 3.x: its RoPE scaling ("llama3": low frequencies stretched by `factor`), untied head.
    "tiny_llama3": dict(model_type="llama", vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                        rope_theta=5e5, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                        tie_word_embeddings=False),
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

FAST_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral", "gemma2", "gemma3_text")
"""Model types the `hf` engine's CUDA-graph sampler runs (`rlspec.rollout.architecture`); others take the plain
transformers loop."""


def generation_path(model_type: str | None, device: str, cuda_graph: bool, engine: str, lora_engine: bool) -> str:
    """Which path an engine's generation takes, from what a plan knows (no model is built): `cuda_graph`, or
    `plain (<why>)` (transformers' forward in rlspec's own sampling loop), or the engine's name for vllm. A model's
    own settings (a RoPE kind the sampler lacks) may still send it to the plain loop at start, which says so."""
    if engine != "hf":
        return engine
    if device != "cuda":
        return "plain (not on CUDA)"
    if not cuda_graph:
        return "plain (rollout.cuda_graph is false)"
    if lora_engine:
        return "plain (the engine carries LoRA adapters)"
    if model_type not in FAST_MODEL_TYPES:
        return f"plain (model_type {model_type!r} is not one of {', '.join(FAST_MODEL_TYPES)})"
    return "cuda_graph"


def parameter_count(config: dict) -> int | None:
    """The parameter count of a decoder-only transformer from its config (a preset or a config.json's dict), without
    building it: embeddings, each layer's attention (q, k, v, o and their biases where the model type has them; q/k
    norms for Qwen3 and Gemma 3) and gated MLP and norms, the final norm, and an untied LM head. None for a config
    this does not describe (a vision-language model's nested configs, a mixture of experts), where a plan then takes
    the memory-safe choice."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if any(not isinstance(config.get(k), int) for k in keys) or config.get("num_local_experts") or \
            config.get("num_experts"):
        return None
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    kind = config.get("model_type")
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    if kind == "qwen2" or config.get("attention_bias"):
        attention += head_dim * (heads + 2 * kv_heads)
    if kind in ("qwen3", "gemma3_text"):
        attention += 2 * head_dim  # the q and k norms
    norms = (4 if kind in ("gemma2", "gemma3_text") else 2) * hidden
    layer = attention + 3 * hidden * config["intermediate_size"] + norms
    embeddings = config["vocab_size"] * hidden
    head = 0 if config.get("tie_word_embeddings", True) else embeddings
    return embeddings + config["num_hidden_layers"] * layer + hidden + head
