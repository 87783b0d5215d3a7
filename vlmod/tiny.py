"""Tiny random models of every supported LLaVA family, with processors built offline.

They stand in for hub checkpoints in tests, benchmark presets and the demo: no download, seconds
to build, and `save_pretrained` makes a directory that `AutoProcessor` and
`AutoModelForImageTextToText` load like a hub checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

FAMILIES = ("llava", "llava_mistral", "llava_next", "llava_next_video", "llava_onevision")

SPECIAL = ["<pad>", "<unk>", "<s>", "</s>", "<image>", "<video>"]
WORDS = (
    "user assistant system : . , ? ! a an the is are of in on at to and or what which where how many "
    "color shape count position object objects image video picture frame frames first last left right "
    "top bottom middle center up down moving moves direction before after there it this that do does "
    "you see describe answer with one word number red green blue yellow purple orange white black gray "
    "circle square triangle star cross ring zero one two three four five six seven eight nine ten yes "
    "no big small large tiny background texture from leftward rightward upward downward"
).split()
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} : "
    "{% if message['content'] is string %}{{ message['content'] }} {% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<image> "
    "{% elif c['type'] == 'video' %}<video> {% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}</s> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def tokenizer() -> Any:
    """A word-level tokenizer over a small English vocabulary plus the LLaVA special tokens."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + [w for w in dict.fromkeys(WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        extra_special_tokens={"image_token": "<image>", "video_token": "<video>"},
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


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
    seed: int = 0,
) -> tuple[torch.nn.Module, Any]:
    """(model, processor) of a tiny random model of `family`, in eval mode, float32."""
    import transformers as tf

    if family not in FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; choose one of {FAMILIES}")
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
    if family in ("llava", "llava_mistral"):
        config = tf.LlavaConfig(
            vision_config=tf.CLIPVisionConfig(**vision_kwargs), text_config=text,
            vision_feature_layer=-2, vision_feature_select_strategy="default", **common,
        )
        image_proc = tf.CLIPImageProcessor(size=size, crop_size=crop)
        processor_cls, extra = tf.LlavaProcessor, {}
        model_cls = tf.LlavaForConditionalGeneration
    elif family == "llava_next":
        config = tf.LlavaNextConfig(
            vision_config=tf.CLIPVisionConfig(**vision_kwargs), text_config=text,
            vision_feature_layer=-2, vision_feature_select_strategy="default", image_grid_pinpoints=grid,
            **common,
        )
        image_proc = tf.LlavaNextImageProcessor(size=size, crop_size=crop, image_grid_pinpoints=grid)
        processor_cls, extra = tf.LlavaNextProcessor, {}
        model_cls = tf.LlavaNextForConditionalGeneration
    elif family == "llava_next_video":
        config = tf.LlavaNextVideoConfig(
            vision_config=tf.CLIPVisionConfig(**vision_kwargs), text_config=text,
            vision_feature_layer=-2, vision_feature_select_strategy="default", image_grid_pinpoints=grid,
            video_token_index=video_id, spatial_pool_stride=2, **common,
        )
        image_proc = tf.LlavaNextImageProcessor(size=size, crop_size=crop, image_grid_pinpoints=grid)
        video_proc = tf.LlavaNextVideoVideoProcessor(size=size, crop_size=crop)
        processor_cls, extra = tf.LlavaNextVideoProcessor, {"video_processor": video_proc}
        model_cls = tf.LlavaNextVideoForConditionalGeneration
    else:
        config = tf.LlavaOnevisionConfig(
            vision_config=tf.SiglipVisionConfig(**vision_kwargs), text_config=text,
            vision_feature_layer=-1, vision_feature_select_strategy="full", image_grid_pinpoints=grid,
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


def save(family: str, directory: str | Path, **kwargs: Any) -> Path:
    """Build a tiny model and save it with its processor, like a hub checkpoint."""
    model, processor = build(family, **kwargs)
    directory = Path(directory)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def add_tiny_arguments(parser: Any) -> Any:
    """The flags of `vlmod tiny`: a randomly initialised tiny model saved like a hub checkpoint,
    the starting point of training from scratch (the synthetic recipe) and of offline tests."""
    from vlmod.argtypes import positive_int

    parser.add_argument("--out", required=True, help="directory to write the model and processor to")
    parser.add_argument("--family", default="llava", choices=FAMILIES)
    parser.add_argument("--width", type=positive_int, default=64, help="language model hidden size")
    parser.add_argument("--layers", type=positive_int, default=4, help="language model layers")
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--kv-heads", type=positive_int, default=2)
    parser.add_argument("--mlp-ratio", type=float, default=2.0)
    parser.add_argument("--vision-width", type=positive_int, default=32)
    parser.add_argument("--vision-layers", type=positive_int, default=2)
    parser.add_argument("--image-size", type=positive_int, default=32)
    parser.add_argument("--patch-size", type=positive_int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(run=run_tiny)
    return parser


def run_tiny(args: Any) -> int:
    from vlmod.errors import InputError

    if args.width % args.heads or args.heads % args.kv_heads:
        raise InputError(
            f"--width ({args.width}) must be a multiple of --heads ({args.heads}), and --heads of --kv-heads ({args.kv_heads})"
        )
    if args.image_size % args.patch_size:
        raise InputError(f"--image-size ({args.image_size}) must be a multiple of --patch-size ({args.patch_size})")
    if args.vision_width % 4:
        raise InputError(f"--vision-width ({args.vision_width}) must be a multiple of 4 (the tower's heads)")
    out = Path(args.out).expanduser()
    if out.exists() and any(out.iterdir()):
        raise InputError(f"{out} exists and is not empty; choose a new --out")
    model, processor = build(
        args.family, width=args.width, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
        mlp_ratio=args.mlp_ratio, vision_width=args.vision_width, vision_layers=args.vision_layers,
        image_size=args.image_size, patch_size=args.patch_size, seed=args.seed,
    )
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    if out.exists():
        out.rmdir()
    tmp.replace(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote a tiny {args.family} model ({params / 1e6:.2f} M parameters) to {out}")
    return 0
