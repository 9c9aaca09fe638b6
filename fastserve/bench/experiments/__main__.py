"""``python -m fastserve.bench.experiments NAME [--sim] [--quick]``: reproduce one of the paper's figures.

NAME is one of fig1 fig8 fig11 fig11_chunked fig14 fig15 fig15_grid (fig11_chunked: skip-join with and
without chunked prefill in the simulator; ``--chunk-tokens`` sets the chunk; fig15_grid: Figure 15a's
reactive ÷ proactive over device pools and link speeds). Results (Markdown +
JSON tables, PNG plots) go to ``results/`` (``results/quick/`` with
``--quick``); a readable table is printed, and the last line is one JSON object with the
figure's headline numbers.
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Sequence
from pathlib import Path

from fastserve.bench.experiments.common import (
    DEFAULT_NUM_SEEDS,
    DEFAULT_SEED,
    RESULTS_DIR,
    RunOptions,
    jsonable,
)

FIGURES = ("fig1", "fig8", "fig11", "fig11_chunked", "fig14", "fig15", "fig15_grid")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fastserve.bench.experiments",
                                     description=(__doc__ or "").splitlines()[0])
    parser.add_argument("name", choices=FIGURES)
    parser.add_argument("--sim", action="store_true", help="simulator only (fig11: skip the real HTTP runs)")
    parser.add_argument("--real-only", action="store_true", help="fig11: only the real HTTP runs (no simulator)")
    parser.add_argument("--quick", action="store_true", help="a reduced run (under two minutes)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--seeds", type=int, default=DEFAULT_NUM_SEEDS,
                        help="fig14, fig15(_grid): arrival seeds, from --seed on (mean, least and most)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="fig14, fig15(_grid): simulations run at once, in processes")
    parser.add_argument("--requests", type=int, default=None,
                        help="fig14, fig15(_grid): requests per point (default: the figure's)")
    parser.add_argument("--points", type=lambda v: tuple(float(x) for x in v.split(",")), default=None,
                        help="fig14: length ratios; fig15(_grid): loads (default: the figure's)")
    parser.add_argument("--skip", type=lambda v: tuple(v.split(",")), default=(),
                        help="fig14, fig15: rows (setups) not to run, comma-separated")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--base-url", default=None,
                        help="fig11 real runs: use this already running server instead of starting one")
    parser.add_argument("--chunk-tokens", type=int, default=None,
                        help="fig11_chunked: tokens per prefill chunk (default 512)")
    args = parser.parse_args(argv)
    if args.sim and args.real_only:
        parser.error("--sim and --real-only exclude each other")
    options = RunOptions(quick=args.quick, sim_only=args.sim, real_only=args.real_only, seed=args.seed,
                         out_dir=args.out_dir, base_url=args.base_url, num_seeds=args.seeds, jobs=args.jobs,
                         extra={k: v for k, v in (("chunk_tokens", args.chunk_tokens), ("requests", args.requests),
                                                   ("points", args.points), ("skip", args.skip)) if v})
    module = importlib.import_module(f"fastserve.bench.experiments.{args.name}")
    headline = module.run(options)
    print(json.dumps(jsonable(headline)))


if __name__ == "__main__":
    main()
