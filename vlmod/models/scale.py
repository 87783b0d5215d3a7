"""Checkpoints of the sizes users run (LLaVA-1.5-7B, LLaVA-NeXT-Video-7B), built offline.

The real configs (width 4096, 32 Llama layers, the CLIP-L/14-336 tower, a 32064-token vocabulary
with the image and video tokens at their published ids) and processors of the real shapes (the
CLIP 336 image processor, LLaVA-NeXT's anyres grid and video processor), with random weights:
what `vlmod scale-check` runs every stage on. The weights are made on the meta device and then
materialised in the target dtype, never in float32 first (a 7B model is 13.5 GB in bfloat16).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vlmod.errors import InputError

SHAPES = ("llava-1.5-7b", "llava-next-video-7b")
VOCAB = 32064
# llava-hf's ids: llava-1.5 puts <image> at 32000; LLaVA-NeXT-Video puts <video> at 32000, <image> at 32001.
TOKEN_IDS = {"llava-1.5-7b": {"<image>": 32000}, "llava-next-video-7b": {"<video>": 32000, "<image>": 32001}}
PAD_ID = {"llava-1.5-7b": 32001, "llava-next-video-7b": 32002}
GRID = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]


def _tokenizer(shape: str) -> Any:
    """A word-level tokenizer of the real vocabulary size whose image (and video) token sit at
    the ids the real checkpoint's config names; the other ids are filler words."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from vlmod.models.tiny import CHAT_TEMPLATE, WORDS

    fixed = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": PAD_ID[shape], **TOKEN_IDS[shape]}
    words = iter(dict.fromkeys(WORDS))
    by_id = {i: t for t, i in fixed.items()}
    vocab = {}
    for i in range(VOCAB):
        token = by_id.get(i) or next(words, None) or f"<filler_{i}>"
        vocab[token] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.add_special_tokens(list(TOKEN_IDS[shape]))
    named = {"image_token": "<image>"} | ({"video_token": "<video>"} if "<video>" in TOKEN_IDS[shape] else {})
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        extra_special_tokens=named, padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def config_and_processor(shape: str, layers: int = 32) -> tuple[Any, Any]:
    """(config, processor) of `shape` with `layers` language layers (32 is the real model)."""
    import transformers as tf

    if shape not in SHAPES:
        raise InputError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    config = _config(shape, layers)
    tok = _tokenizer(shape)
    size, crop = {"shortest_edge": 336}, {"height": 336, "width": 336}
    clip_norm = dict(image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
    tokens = dict(patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1)
    if shape == "llava-1.5-7b":
        image_proc = tf.CLIPImageProcessor(size=size, crop_size=crop, **clip_norm)
        processor = tf.LlavaProcessor(image_processor=image_proc, tokenizer=tok, chat_template=tok.chat_template, **tokens)
    else:
        image_proc = tf.LlavaNextImageProcessor(size=size, crop_size=crop, image_grid_pinpoints=GRID, **clip_norm)
        video_proc = tf.LlavaNextVideoVideoProcessor(size=size, crop_size=crop, **clip_norm)
        processor = tf.LlavaNextVideoProcessor(
            image_processor=image_proc, video_processor=video_proc, tokenizer=tok, chat_template=tok.chat_template,
            **tokens,
        )
    return config, processor


def checkpoint_bytes(shape: str, layers: int = 32, dtype: torch.dtype = torch.bfloat16) -> int:
    """The weights' bytes of a `shape` checkpoint with `layers` language layers, from models of
    one and two layers built on the meta device (seconds, no memory: a 1000-layer model is not
    built to be measured); the safetensors files are this plus their small headers."""
    from transformers import AutoModelForImageTextToText

    sizes = []
    for n in (1, 2):
        config = _config(shape, n)
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
        sizes.append(sum(p.numel() * p.element_size() for p in model.parameters()))
    return sizes[0] + (layers - 1) * (sizes[1] - sizes[0])


def _config(shape: str, layers: int) -> Any:
    """The model config of `shape` with `layers` language layers (no tokenizer or processor)."""
    import transformers as tf

    if shape not in SHAPES:
        raise InputError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    text = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
        pad_token_id=PAD_ID[shape], bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    vision = tf.CLIPVisionConfig(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
        image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu",
    )
    common = dict(
        vision_config=vision, text_config=text, vision_feature_layer=-2, vision_feature_select_strategy="default",
        image_token_index=TOKEN_IDS[shape]["<image>"], projector_hidden_act="gelu",
    )
    if shape == "llava-1.5-7b":
        config = tf.LlavaConfig(**common)
        config.architectures = ["LlavaForConditionalGeneration"]
    else:
        config = tf.LlavaNextVideoConfig(
            **common, image_grid_pinpoints=GRID, video_token_index=TOKEN_IDS[shape]["<video>"],
            spatial_pool_stride=2, spatial_pool_mode="average",
        )
        config.architectures = ["LlavaNextVideoForConditionalGeneration"]
    config.dtype = torch.bfloat16
    return config


def build_model(
    shape: str, *, layers: int = 32, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"
) -> tuple[Any, Any]:
    """(model, processor) of `shape` with transformers' random initialisation, made straight on
    `device` in `dtype` (a GPU benchmark builds a 7B in seconds, with no checkpoint on disk and no
    float32 copy); torch's global seed decides the weights."""
    from transformers import AutoModelForImageTextToText

    config, processor = config_and_processor(shape, layers)
    config.dtype = dtype
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    return model.eval(), processor


def build_checkpoint(
    shape: str, out: str | Path, *, layers: int = 32, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> Path:
    """Save a `shape` checkpoint with random weights (normal, std 0.02; norms at 1) in `dtype` to
    `out`, with its processor. Peak memory: the model's bytes once (built on the meta device)."""
    from transformers import AutoModelForImageTextToText

    from vlmod.io.files import save_pretrained_atomic

    config, processor = config_and_processor(shape, layers)
    config.dtype = dtype
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layer_norm" in name or "layernorm" in name:
                p.fill_(1.0) if name.endswith("weight") else p.zero_()
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=generator)
    # Buffers (rotary frequencies, position ids) are not persistent: loading recomputes them.
    save_pretrained_atomic(model.eval(), processor, Path(out))
    return Path(out)


__all__ = ["SHAPES", "build_checkpoint", "build_model", "checkpoint_bytes", "config_and_processor"]
