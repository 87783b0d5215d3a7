"""PNG plots of the router audit (`vlmod.evaluation.audit`): per model part, the cross-layer Jaccard
matrix and compute by token position, one panel per router."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def plot(routing: Mapping[str, Mapping[str, Any]], directory: str | Path) -> list[Path]:
    """PNG plots per part: the Jaccard matrix and compute by position, one panel per router."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    parts = dict.fromkeys(p for stats in routing.values() for p in stats)
    for part in parts:
        routers = [r for r in routing if part in routing[r]]
        fig, axes = plt.subplots(1, len(routers), figsize=(3.2 * len(routers), 3.2), squeeze=False)
        for ax, router in zip(axes[0], routers, strict=True):
            s = routing[router][part]
            im = ax.imshow(s["jaccard"]["matrix"], vmin=0.0, vmax=1.0, cmap="viridis")
            ticks = range(len(s["layers"]))
            ax.set_xticks(ticks, [str(i) for i in s["layers"]], fontsize=6)
            ax.set_yticks(ticks, [str(i) for i in s["layers"]], fontsize=6)
            ax.set_title(f"{router} (mean {s['jaccard']['mean_off_diagonal'] or 1.0:.2f})", fontsize=8)
            ax.set_xlabel("layer", fontsize=7)
        fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="Jaccard of processed routable tokens")
        fig.suptitle(f"{part}: cross-layer agreement of processed sets", fontsize=9)
        path = directory / f"jaccard_{part}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

        grid = all("by_grid" in routing[r][part] for r in routers)
        if grid:
            fig, axes = plt.subplots(1, len(routers), figsize=(3.2 * len(routers), 3.2), squeeze=False)
            for ax, router in zip(axes[0], routers, strict=True):
                im = ax.imshow(routing[router][part]["by_grid"]["mean"], vmin=0.0, vmax=1.0, cmap="magma")
                ax.set_title(router, fontsize=8)
                ax.set_xticks([])
                ax.set_yticks([])
            fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="processed fraction (mean over MoD layers)")
        else:
            fig, ax = plt.subplots(figsize=(5.5, 3.2))
            for router in routers:
                pos = routing[router][part].get("by_position")
                if pos is not None:
                    centers = [(b + 0.5) / pos["buckets"] for b in range(pos["buckets"])]
                    ax.plot(centers, pos["mean"], marker="o", markersize=3, label=router)
            ax.set_xlabel("relative position among routable tokens")
            ax.set_ylabel("processed fraction")
            ax.set_ylim(0.0, 1.05)
            ax.legend(fontsize=7)
        fig.suptitle(f"{part}: compute by token position", fontsize=9)
        path = directory / f"position_{part}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


__all__ = ["plot"]
