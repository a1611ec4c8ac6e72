"""``python train/<method>.py report ...``: the shared report with a recipe's own config class."""

from __future__ import annotations

import datasets

from eval.report import report_main
from train.data.dataset import build_dataset


def report_mode(argv: list[str], recipe_cls: type) -> None:
    """``python train/<method>.py report ...``: the shared report (`eval.report.report_main`, as ``drafters report``)
    with ``--config`` read as a recipe of ``recipe_cls``, and that recipe's eval_data samples built here for
    ``report.prompt_source=eval_data`` (data building is train/'s; eval/ is handed the samples)."""

    def eval_set(cfg, tokenizer) -> datasets.Dataset | None:
        return build_dataset(cfg.eval_data, tokenizer)[0] if cfg.eval_data is not None else None

    report_main(argv, recipe_cls, eval_set)
