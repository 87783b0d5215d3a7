#!/usr/bin/env python
"""Can the language model read the glyphs? For each model, a linear probe from the projected
vision token of each glyph's patch (what the language model sees) to the glyph's digit and colour,
fitted on the first 70% of a fine-detail set's validation pictures and scored on the rest. A
tower that reads the glyphs but a dense model that cannot answer the set points at training that
wiped them (docs/data.md: 99.1% -> 16.9% when the dense stage trained the tower too).

    python scripts/probe_glyphs.py --data runs/synthetic-detail/data runs/synthetic-detail/tower/model \\
        runs/synthetic-detail/dense/model
"""

import argparse
import json
from pathlib import Path

import torch

from vlmod.cli.argtypes import HelpFormatter


def glyph_tokens(model: torch.nn.Module, processor, records: list, folder: Path, batch_size: int = 50):
    """[glyphs, width] projected tokens of every glyph's patch, its digits and colour indices."""
    from PIL import Image

    from vlmod.data.scenes import COLORS

    colors = list(COLORS)
    tokens, digits, shades = [], [], []
    for i in range(0, len(records), batch_size):
        batch = records[i:i + batch_size]
        pictures = [Image.open(folder / r["image"]).convert("RGB") for r in batch]
        pixels = processor.image_processor(pictures, return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            out = model.get_image_features(pixel_values=pixels)
        feats = getattr(out, "pooler_output", out)
        feats = torch.stack(list(feats)) if isinstance(feats, list | tuple) else feats
        feats = feats.reshape(len(batch), -1, feats.shape[-1])
        grid = int(feats.shape[1] ** 0.5)
        for r, f in zip(batch, feats, strict=True):
            patch = r["meta"]["patch_size"]
            for g in r["meta"]["glyphs"]:
                tokens.append(f[(g["box"][1] // patch) * grid + g["box"][0] // patch])
                digits.append(g["digit"])
                shades.append(colors.index(g["color"]))
    return torch.stack(tokens).float(), torch.tensor(digits), torch.tensor(shades)


def probe(x: torch.Tensor, y: torch.Tensor, fit: int, steps: int = 300) -> float:
    """Held-out accuracy of a softmax regression fitted on the first `fit` rows."""
    x = (x - x[:fit].mean(0)) / (x[:fit].std(0) + 1e-6)
    w = torch.zeros(x.shape[1], int(y.max()) + 1, requires_grad=True)
    opt = torch.optim.Adam([w], lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x[:fit] @ w, y[:fit]) + 1e-3 * w.pow(2).sum()
        loss.backward()
        opt.step()
    return ((x[fit:] @ w).argmax(1) == y[fit:]).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("models", nargs="+", help="model folders (a recipe's tower/model, dense/model, ...)")
    parser.add_argument("--data", required=True, help="a fine-detail set's folder (its val.json) (no default)")
    parser.add_argument("--num-samples", type=int, default=300, help="validation pictures probed (default: 300)")
    args = parser.parse_args()

    from transformers import AutoProcessor

    import vlmod

    torch.manual_seed(0)
    folder = Path(args.data)
    records = json.loads((folder / "val.json").read_text())[:args.num_samples]
    fit_records = int(0.7 * len(records))
    print("| model | digit | colour | glyphs (fit / scored) |\n|---|---|---|---|")
    for path in args.models:
        model, processor = vlmod.load_pretrained(path).eval(), AutoProcessor.from_pretrained(path)
        x, digits, shades = glyph_tokens(model, processor, records, folder)
        fit = sum(len(r["meta"]["glyphs"]) for r in records[:fit_records])  # split by picture
        print(f"| {path} | {100 * probe(x, digits, fit):.1f}% | {100 * probe(x, shades, fit):.1f}% | "
              f"{fit} / {len(x) - fit} |")


if __name__ == "__main__":
    main()
