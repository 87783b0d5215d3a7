"""The stack's keep that reads the question (`vlmod recipe --stack-scoring query`): a
`vlmod.tools.query_keep.QueryScorer` fitted, between the MoD and stacked stages, to what the MoD
stage's routed layers run on training pictures, saved in the run's `keep/` folder for the stacked
stage to train behind and the evaluations to run behind (crowded fine-detail page, three seeds: 8x
within a point of dense where the stack on merging lost 4.6 on one; docs/results-history.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmod.data import LlavaDataset, load_records
from vlmod.io.hf import load_pretrained
from vlmod.tools.query_keep import fit_query_scorer, save_query_scorer

KEEP_RUN = "keep"  # the run folder the scorer is saved into
KEEP_SAMPLES = 2000  # training pictures its targets come from (25 s at one thread on the crowded page)


def fit_keep(mod_model: Path, train_json: Path, processor: Any, out: Path, progress: bool = True) -> Path:
    """`out` (the run's keep folder) holding the scorer fitted to `mod_model`'s routing on the
    first `KEEP_SAMPLES` records of `train_json`."""
    records = load_records(train_json)[:KEEP_SAMPLES]
    data = LlavaDataset(records, processor, train_json.parent)
    scorer = fit_query_scorer(load_pretrained(mod_model).eval(), data, samples=len(records), progress=progress)
    return save_query_scorer(scorer, out)


__all__ = ["KEEP_RUN", "KEEP_SAMPLES", "fit_keep"]
