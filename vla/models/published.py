"""The Hugging Face configs of the real backbones the presets name, built locally (no hub access).

``vla.models.meta.build_on_meta`` needs a backbone's HF *config* (never its weights) to build a model of a
real-backbone preset on the meta device, e.g. to report parameter counts offline. Values are those of the
checkpoints' public ``config.json`` on the Hugging Face hub (cited per function); entries that only matter for text
generation (token ids of special tokens, dtype, cache settings) are left at the classes' defaults except where they
are part of the architecture.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import PaliGemmaConfig, PretrainedConfig, SmolVLMConfig


def smolvlm2_500m_video_instruct() -> SmolVLMConfig:
    """``HuggingFaceTB/SmolVLM2-500M-Video-Instruct`` (https://huggingface.co/HuggingFaceTB/SmolVLM2-500M-Video-Instruct
    /blob/main/config.json): SigLIP vision tower 768 wide, 12 layers, 12 heads, 512 px / patch 16, pixel shuffle
    ``scale_factor`` 4 (64 image tokens per image); SmolLM2-360M-style Llama text model 960 wide, 32 layers,
    15 heads, 5 KV heads, head_dim 64, MLP 2560, vocabulary 49,280, RoPE theta 100,000, untied LM head.
    507,482,304 parameters in all (the model card's "507M")."""
    return SmolVLMConfig(
        vision_config=dict(
            model_type="smolvlm_vision",
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            image_size=512,
            patch_size=16,
        ),
        text_config=dict(
            model_type="llama",
            hidden_size=960,
            intermediate_size=2560,
            num_hidden_layers=32,
            num_attention_heads=15,
            num_key_value_heads=5,
            head_dim=64,
            vocab_size=49280,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
            pad_token_id=2,
            tie_word_embeddings=False,
        ),
        scale_factor=4,
        image_token_id=49190,
        tie_word_embeddings=False,
    )


def paligemma2_3b_pt_224() -> PaliGemmaConfig:
    """``google/paligemma2-3b-pt-224`` (https://huggingface.co/google/paligemma2-3b-pt-224/blob/main/config.json):
    SigLIP So400m/14 vision tower 1152 wide, 27 layers, 16 heads, MLP 4304, 224 px (256 image tokens), no pooling
    head; linear projector to 2304; Gemma2-2B text model 2304 wide, 26 layers, 8 heads, 4 KV heads, head_dim 256,
    MLP 9216, query scale 256, sliding window 4096, logit soft-capping 50 (attention) / 30 (final), vocabulary
    257,216 (Gemma's 256,000 + 1024 location + 128 segmentation tokens + padding); tied LM head.
    3,032,242,416 parameters in all (the model card's "3B", 3.03B on the hub page)."""
    return PaliGemmaConfig(
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=1152,
            intermediate_size=4304,
            num_hidden_layers=27,
            num_attention_heads=16,
            image_size=224,
            patch_size=14,
            vision_use_head=False,
        ),
        text_config=dict(
            model_type="gemma2",
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=256,
            sliding_window=4096,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            vocab_size=257216,
            tie_word_embeddings=True,
        ),
        image_token_index=257152,
        projection_dim=2304,
        hidden_size=2048,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
        tie_word_embeddings=True,
    )


PUBLISHED: dict[str, Callable[[], PretrainedConfig]] = {
    "HuggingFaceTB/SmolVLM2-500M-Video-Instruct": smolvlm2_500m_video_instruct,
    "google/paligemma2-3b-pt-224": paligemma2_3b_pt_224,
}


def published_config(hub_id: str) -> PretrainedConfig:
    """The config of a published backbone by its hub id (``PUBLISHED``)."""
    if hub_id not in PUBLISHED:
        raise KeyError(
            f"no published config for {hub_id!r} in vla.models.published; known: {sorted(PUBLISHED)}"
        )
    return PUBLISHED[hub_id]()
