"""Tiny random models of every supported LLaVA family, with processors built offline.

They stand in for hub checkpoints in tests, benchmark presets and the demo: no download, seconds
to build, and `save_pretrained` makes a directory that `AutoProcessor` and
`AutoModelForImageTextToText` load like a hub checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vlmod.errors import InputError

FAMILIES = ("llava", "llava_mistral", "llava_next", "llava_next_video", "llava_onevision")
# Beyond LLaVA: built by `_build_vlm`, with the special tokens of each family.
VLM_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "internvl", "gemma3")

SPECIAL = ["<pad>", "<unk>", "<s>", "</s>", "<image>", "<video>"]
WORDS = (
    "user assistant system : . , ? ! a an the is are of in on at to and or what which where how many "
    "color shape count position object objects image video picture frame frames first last left right "
    "top bottom middle center up down moving moves direction before after there it this that do does "
    "you see describe answer with one word number red green blue yellow purple orange white black gray "
    "circle square triangle star cross ring zero one two three four five six seven eight nine ten yes "
    "no big small large tiny background texture from leftward rightward upward downward "
    "when appear appears start end different shapes"
).split()
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} : "
    "{% if message['content'] is string %}{{ message['content'] }} {% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<image> "
    "{% elif c['type'] == 'video' %}<video> {% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}</s> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def tokenizer(special_tokens: dict[str, str] | None = None, chat_template: str = CHAT_TEMPLATE) -> Any:
    """A word-level tokenizer over a small English vocabulary plus the LLaVA special tokens, or
    the named `special_tokens` of another family ({"image_token": "<|image_pad|>", ...}), which
    are never split."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    named = special_tokens or {"image_token": "<image>", "video_token": "<video>"}
    specials = SPECIAL[:4] + list(dict.fromkeys(named.values())) if special_tokens else SPECIAL
    vocab = {t: i for i, t in enumerate(specials + [w for w in dict.fromkeys(WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    if special_tokens:
        tok.add_special_tokens(specials[4:])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        extra_special_tokens=named,
        padding_side="left",
    )
    fast.chat_template = chat_template
    return fast


def chat_template(image: str, video: str = "<video>") -> str:
    """CHAT_TEMPLATE with a family's own image and video placeholders."""
    return CHAT_TEMPLATE.replace("<image> ", image + " ").replace("<video> ", video + " ")


def _text_config(
    family: str, vocab: int, width: int, layers: int, heads: int, kv_heads: int, mlp_ratio: float
) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llava_mistral": MistralConfig, "llava_onevision": Qwen2Config}.get(family, LlamaConfig)
    return cls(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=int(mlp_ratio * width),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        tie_word_embeddings=False,
    )


def build(
    family: str = "llava",
    *,
    width: int = 64,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    mlp_ratio: float = 2.0,
    vision_width: int = 32,
    vision_layers: int = 2,
    image_size: int = 32,
    patch_size: int = 8,
    attn_implementation: str = "sdpa",
    vision_feature_layer: int | None = None,
    spatial_pool_stride: int = 2,
    spatial_pool_mode: str = "average",
    seed: int = 0,
) -> tuple[torch.nn.Module, Any]:
    """(model, processor) of a tiny random model of `family`, in eval mode, float32.

    vision_feature_layer: the tower layer whose output feeds the projector (None: the family's
        default, -2 for CLIP towers as in LLaVA, -1 for SigLIP); -1 makes every tower layer count.
    spatial_pool_stride, spatial_pool_mode: LLaVA-NeXT-Video's pooling of each frame's patch grid
        ("average", "max", or "conv": a learned stride x stride convolution, initialised to
        average, so it starts as the average pool and can learn to keep what averaging blurs)."""
    import transformers as tf

    if family in VLM_FAMILIES:
        return _build_vlm(
            family, width=width, layers=layers, heads=heads, kv_heads=kv_heads, mlp_ratio=mlp_ratio,
            vision_width=vision_width, vision_layers=vision_layers, image_size=image_size,
            patch_size=patch_size, attn_implementation=attn_implementation, seed=seed,
        )
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; choose one of {FAMILIES + VLM_FAMILIES}")
    tok = tokenizer()
    vocab = len(tok)
    image_id = tok.convert_tokens_to_ids("<image>")
    video_id = tok.convert_tokens_to_ids("<video>")
    text = _text_config(family, vocab, width, layers, heads, kv_heads, mlp_ratio)
    vision_kwargs = dict(
        hidden_size=vision_width,
        intermediate_size=2 * vision_width,
        num_hidden_layers=vision_layers,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=patch_size,
    )
    grid = [[image_size, 2 * image_size], [2 * image_size, image_size], [2 * image_size, 2 * image_size]]
    size = {"shortest_edge": image_size}
    crop = {"height": image_size, "width": image_size}
    common = dict(image_token_index=image_id, projector_hidden_act="gelu")
    if vision_feature_layer is not None and not -(vision_layers + 1) <= vision_feature_layer <= vision_layers:
        raise ValueError(f"vision_feature_layer indexes the tower's {vision_layers + 1} hidden states (0: the patch "
                         f"embeddings), from {-(vision_layers + 1)} to {vision_layers}; got {vision_feature_layer}")
    if vision_feature_layer is not None and vision_feature_layer >= 0:
        # The same hidden state by its negative index: transformers 5 asks the tower for its hidden
        # states only when the index is truthy, so layer 0 would leave them None and fail.
        vision_feature_layer -= vision_layers + 1
    clip_layer = -2 if vision_feature_layer is None else vision_feature_layer
    if family in ("llava", "llava_mistral"):
        config = tf.LlavaConfig(
            vision_config=tf.CLIPVisionConfig(**vision_kwargs), text_config=text,
            vision_feature_layer=clip_layer, vision_feature_select_strategy="default", **common,
        )
        image_proc = tf.CLIPImageProcessor(size=size, crop_size=crop)
        processor_cls, extra = tf.LlavaProcessor, {}
        model_cls = tf.LlavaForConditionalGeneration
    elif family == "llava_next":
        config = tf.LlavaNextConfig(
            vision_config=tf.CLIPVisionConfig(**vision_kwargs), text_config=text,
            vision_feature_layer=clip_layer, vision_feature_select_strategy="default", image_grid_pinpoints=grid,
            **common,
        )
        image_proc = tf.LlavaNextImageProcessor(size=size, crop_size=crop, image_grid_pinpoints=grid)
        processor_cls, extra = tf.LlavaNextProcessor, {}
        model_cls = tf.LlavaNextForConditionalGeneration
    elif family == "llava_next_video":
        config = tf.LlavaNextVideoConfig(
            vision_config=tf.CLIPVisionConfig(**vision_kwargs), text_config=text,
            vision_feature_layer=clip_layer, vision_feature_select_strategy="default", image_grid_pinpoints=grid,
            video_token_index=video_id, spatial_pool_stride=spatial_pool_stride, spatial_pool_mode=spatial_pool_mode,
            **common,
        )
        image_proc = tf.LlavaNextImageProcessor(size=size, crop_size=crop, image_grid_pinpoints=grid)
        video_proc = tf.LlavaNextVideoVideoProcessor(size=size, crop_size=crop)
        processor_cls, extra = tf.LlavaNextVideoProcessor, {"video_processor": video_proc}
        model_cls = tf.LlavaNextVideoForConditionalGeneration
    else:
        config = tf.LlavaOnevisionConfig(
            vision_config=tf.SiglipVisionConfig(**vision_kwargs), text_config=text,
            vision_feature_layer=-1 if vision_feature_layer is None else vision_feature_layer,
            vision_feature_select_strategy="full", image_grid_pinpoints=grid,
            video_token_index=video_id, vision_aspect_ratio="anyres_max_9", **common,
        )
        square = {"height": image_size, "width": image_size}
        image_proc = tf.LlavaOnevisionImageProcessor(size=square, image_grid_pinpoints=grid)
        video_proc = tf.LlavaOnevisionVideoProcessor(size=square)
        processor_cls = tf.LlavaOnevisionProcessor
        extra = {"video_processor": video_proc, "num_image_tokens": (image_size // patch_size) ** 2}
        model_cls = tf.LlavaOnevisionForConditionalGeneration
    config.text_config._attn_implementation = attn_implementation
    config.vision_config._attn_implementation = attn_implementation
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if family == "llava_next_video" and spatial_pool_mode == "conv":
        _average_init(model.model.vision_resampler.pool)
    if family == "llava_onevision":
        kwargs = {"vision_feature_select_strategy": "full"}
    else:
        # The CLIP tower adds a CLS token that the "default" strategy drops again.
        kwargs = {
            "patch_size": patch_size,
            "vision_feature_select_strategy": "default",
            "num_additional_image_tokens": 1,
        }
    processor = processor_cls(
        image_processor=image_proc, tokenizer=tok, chat_template=CHAT_TEMPLATE, **kwargs, **extra
    )
    return model, processor


def _average_init(conv: torch.nn.Conv2d) -> None:
    """A k x k, stride-k convolution that computes the average pool of each channel."""
    k = conv.kernel_size[0] * conv.kernel_size[1]
    with torch.no_grad():
        conv.weight.zero_()
        channels = torch.arange(min(conv.in_channels, conv.out_channels))
        conv.weight[channels, channels] = 1.0 / k
        conv.bias.zero_()


QWEN_TOKENS = {
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>",
}
INTERNVL_TOKENS = {
    "context_image_token": "<IMG_CONTEXT>", "start_image_token": "<img>", "end_image_token": "</img>",
    "video_token": "<video>",
}
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}


def _build_vlm(
    family: str, *, width: int, layers: int, heads: int, kv_heads: int, mlp_ratio: float, vision_width: int,
    vision_layers: int, image_size: int, patch_size: int, attn_implementation: str, seed: int,
) -> tuple[torch.nn.Module, Any]:
    """Qwen2.5-VL / Qwen3-VL (dynamic resolution: `image_size` is the largest side, patches of
    `patch_size` merged 2x2), InternVL (pixel shuffle 0.5) and Gemma 3 (SigLIP tower pooled to 16
    tokens per image; sliding-window and full-attention layers alternate, window 8, shorter than
    a prompt, so routed caches must honour it)."""
    import transformers as tf

    head_dim = width // heads
    text = dict(
        hidden_size=width, intermediate_size=int(mlp_ratio * width), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
        pad_token_id=0, bos_token_id=2, eos_token_id=3, tie_word_embeddings=False,
    )
    vision = dict(hidden_size=vision_width, intermediate_size=2 * vision_width, num_hidden_layers=vision_layers,
                  num_attention_heads=4)
    if family in ("qwen2_5_vl", "qwen3_vl"):
        tok = tokenizer(QWEN_TOKENS, chat_template("<|vision_start|> <|image_pad|> <|vision_end|>",
                                                   "<|vision_start|> <|video_pad|> <|vision_end|>"))
        ids = {k: tok.convert_tokens_to_ids(v) for k, v in QWEN_TOKENS.items()}
        half = head_dim // 2
        section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
        text.update(vocab_size=len(tok), rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "mrope_section": section})
        vision = dict(depth=vision_layers, hidden_size=vision_width, intermediate_size=2 * vision_width,
                      num_heads=4, out_hidden_size=width, patch_size=patch_size, spatial_merge_size=2,
                      temporal_patch_size=2)
        token_ids = dict(image_token_id=ids["image_token"], video_token_id=ids["video_token"],
                         vision_start_token_id=ids["vision_start_token"], vision_end_token_id=ids["vision_end_token"])
        if family == "qwen2_5_vl":
            vision.update(window_size=4 * patch_size, fullatt_block_indexes=[vision_layers - 1])
            config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **token_ids)
            model_cls, processor_cls = tf.Qwen2_5_VLForConditionalGeneration, tf.Qwen2_5_VLProcessor
        else:
            text["head_dim"] = head_dim
            vision.update(num_position_embeddings=(image_size // patch_size) ** 2, deepstack_visual_indexes=list(range(min(2, vision_layers))))
            config = tf.Qwen3VLConfig(text_config=text, vision_config=vision, **token_ids)
            model_cls, processor_cls = tf.Qwen3VLForConditionalGeneration, tf.Qwen3VLProcessor
        pixels = dict(patch_size=patch_size, merge_size=2, temporal_patch_size=2)
        limits = {"shortest_edge": (2 * patch_size) ** 2, "longest_edge": image_size**2}
        image_proc = tf.Qwen2VLImageProcessor(size=limits, **pixels)
        video_cls = tf.Qwen3VLVideoProcessor if family == "qwen3_vl" else tf.Qwen2VLVideoProcessor
        video_proc = video_cls(size=limits, **pixels)
        processor = processor_cls(image_processor=image_proc, tokenizer=tok, video_processor=video_proc,
                                  chat_template=tok.chat_template)
    elif family == "internvl":
        tok = tokenizer(INTERNVL_TOKENS, chat_template("<IMG_CONTEXT>"))
        text.update(vocab_size=len(tok))
        vision.update(image_size=image_size, patch_size=patch_size)
        config = tf.InternVLConfig(
            vision_config=tf.InternVLVisionConfig(**vision), text_config=tf.Qwen2Config(**text),
            image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"),
            image_seq_length=(image_size // patch_size) ** 2 // 4, downsample_ratio=0.5,
        )
        image_proc = tf.GotOcr2ImageProcessor(size={"height": image_size, "width": image_size}, crop_to_patches=True,
                                             max_patches=4, min_patches=1)
        processor = tf.InternVLProcessor(image_processor=image_proc, tokenizer=tok,
                                         video_processor=tf.InternVLVideoProcessor(
                                             size={"height": image_size, "width": image_size}),
                                         image_seq_length=config.image_seq_length, chat_template=tok.chat_template)
        model_cls = tf.InternVLForConditionalGeneration
    elif family == "gemma3":
        tok = tokenizer(GEMMA3_TOKENS, chat_template("<start_of_image>"))
        ids = {k: tok.convert_tokens_to_ids(v) for k, v in GEMMA3_TOKENS.items()}
        text.update(vocab_size=len(tok), head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=8,
                    layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
        vision.update(image_size=image_size, patch_size=patch_size)
        per_image = min(16, (image_size // patch_size) ** 2)
        config = tf.Gemma3Config(
            text_config=tf.Gemma3TextConfig(**text), vision_config=tf.SiglipVisionConfig(**vision),
            mm_tokens_per_image=per_image, boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
            image_token_index=ids["image_token"], tie_word_embeddings=False,
        )
        image_proc = tf.Gemma3ImageProcessor(size={"height": image_size, "width": image_size})
        processor = tf.Gemma3Processor(image_processor=image_proc, tokenizer=tok, image_seq_length=per_image,
                                       chat_template=tok.chat_template)
        model_cls = tf.Gemma3ForConditionalGeneration
    else:
        raise ValueError(f"unknown tiny family {family!r}; choose one of {FAMILIES + VLM_FAMILIES}")
    for c in (config, config.text_config, config.vision_config):
        c._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return model_cls(config).eval(), processor


def save(family: str, directory: str | Path, **kwargs: Any) -> Path:
    """Build a tiny model and save it with its processor, like a hub checkpoint."""
    model, processor = build(family, **kwargs)
    directory = Path(directory)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def copy_weights(source: torch.nn.Module, target: torch.nn.Module) -> list[str]:
    """Load every weight of `source` into `target` (same names and shapes: a LLaVA into a
    LLaVA-NeXT-Video of the same sizes); the names `target` has and `source` lacks."""
    theirs, ours = source.state_dict(), target.state_dict()
    bad = [k for k, v in theirs.items() if k not in ours or ours[k].shape != v.shape]
    if bad:
        raise InputError(f"cannot start from a model of other sizes: {len(bad)} weights differ (first: {bad[0]})")
    return list(target.load_state_dict(theirs, strict=False).missing_keys)
