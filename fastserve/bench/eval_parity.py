"""lm-evaluation-harness on our server against ``transformers`` on the same folder:
``python -m fastserve.bench.eval_parity``.

Two tasks from the Alpaca records in ``fastserve/bench/data`` (no hub): multiple choice by
loglikelihood (an instruction's own answer among ``CHOICES``) and greedy generation up to a newline.
lm-eval runs each on ``local-completions`` against ``config/demo.yaml`` in float32 and on ``hf`` in
float32, one item at a time; ``compare`` pairs the items (accuracy, loglikelihood differences against
``tolerance`` nats per token, generations that differ). A table, then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fastserve.bench.workloads import DATA_DIR

ALPACA_JSON = DATA_DIR / "alpaca_5000.json"
CHOICES = 4
MAX_QUESTION_CHARS = 160
MAX_ANSWER_CHARS = 48
#: Tokens a generation item may produce (lm-eval's ``max_gen_toks``).
GEN_TOKENS = 24
MC_TASK = "fastserve_alpaca_mc"
GEN_TASK = "fastserve_alpaca_gen"
#: Per continuation token: the issue's goal for an fp32 server, 0.05 nats, is one bf16 rounding
#: (relative 2^-8) of a logit of magnitude 12.8; two fp32 runs of one model differ far less.
TOKEN_TOLERANCE_NATS = 0.05

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Items:
    """The two tasks' records: multiple-choice (question, choices, gold) and generation
    (question, answer)."""

    mc: list[dict[str, Any]]
    gen: list[dict[str, Any]]


def question(record: dict[str, str]) -> str:
    return record["instruction"] + (f"\n{record['input']}" if record.get("input") else "")


def build_items(n: int, n_gen: int | None = None, path: Path = ALPACA_JSON) -> Items:
    """``n`` multiple-choice and ``n_gen`` (default ``n``) generation items from the Alpaca
    records (see the module docstring); the same counts give the same items."""
    records = json.loads(path.read_text(encoding="utf-8"))
    fit = [r for r in records if len(question(r)) <= MAX_QUESTION_CHARS
           and 0 < len(r["output"].strip()) <= MAX_ANSWER_CHARS and "\n" not in r["output"]]
    if len(fit) < n + CHOICES:
        raise ValueError(f"{n} items asked, {len(fit)} records fit")
    mc = []
    for i, record in enumerate(fit[:n]):
        others = [fit[(i + k) % len(fit)]["output"].strip() for k in range(1, CHOICES)]
        gold = i % CHOICES
        choices = others[:gold] + [record["output"].strip()] + others[gold:]
        mc.append({"question": question(record), "choices": choices, "gold": gold})
    gen = [{"question": question(r), "answer": r["output"].strip()} for r in fit[:n if n_gen is None else n_gen]]
    return Items(mc, gen)


def task_configs(items: Items, folder: Path) -> list[dict[str, Any]]:
    """lm-eval task configs over ``items``, their data written as JSON lines into ``folder``
    (read by ``datasets``' local ``json`` builder)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, rows in ((MC_TASK, items.mc), (GEN_TASK, items.gen)):
        paths[name] = folder / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    common = {"dataset_path": "json", "test_split": "test", "num_fewshot": 0}
    mc = {**common, "task": MC_TASK, "dataset_kwargs": {"data_files": {"test": str(paths[MC_TASK])}},
          "output_type": "multiple_choice", "doc_to_text": "Question: {{question}}\nAnswer:",
          "doc_to_choice": "choices", "doc_to_target": "gold",
          "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    gen = {**common, "task": GEN_TASK, "dataset_kwargs": {"data_files": {"test": str(paths[GEN_TASK])}},
           "output_type": "generate_until", "doc_to_text": "Instruction: {{question}}\nResponse:",
           "doc_to_target": "{{answer}}",
           "generation_kwargs": {"until": ["\n"], "max_gen_toks": GEN_TOKENS, "do_sample": False,
                                 "temperature": 0.0},
           "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]}
    return [mc, gen]


def server_model_args(base_url: str, model: str, folder: Path, api_key: str | None = None,
                      concurrent: int = 1) -> dict[str, Any]:
    """``local-completions`` on our server, tokenizing with the folder's own tokenizer;
    ``concurrent`` requests in flight (the server batches them; each is still one prompt)."""
    args: dict[str, Any] = {"base_url": f"{base_url}/v1/completions", "model": model, "tokenizer": str(folder),
                            "tokenizer_backend": "huggingface", "num_concurrent": concurrent, "max_retries": 1}
    if api_key is not None:
        args["header"] = {"Authorization": f"Bearer {api_key}"}
    return args


def hf_model_args(folder: Path) -> dict[str, Any]:
    return {"pretrained": str(folder), "dtype": "float32", "device": "cpu"}


def evaluate(model: str, model_args: dict[str, Any], tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``lm_eval.simple_evaluate`` run with every sample logged, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    results: dict[str, Any] = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=tasks, task_manager=TaskManager(), log_samples=True, batch_size=1,
        apply_chat_template=False, bootstrap_iters=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    return results


@dataclass
class Comparison:
    """Ours against the reference, item by item."""

    items: int
    accuracy: float
    reference_accuracy: float
    #: Choices whose loglikelihoods differ by more than their tolerance (token count x per token).
    over_tolerance: list[dict[str, Any]]
    max_abs_loglikelihood_diff: float
    max_per_token_diff: float
    generations: int
    generations_equal: int
    different_generations: list[dict[str, Any]]
    exact_match: float
    reference_exact_match: float


def _samples(results: dict[str, Any], task: str) -> list[dict[str, Any]]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def _metric(results: dict[str, Any], task: str, metric: str) -> float:
    return float(results["results"][task][f"{metric},none"])


def compare(ours: dict[str, Any], ref: dict[str, Any], continuation_tokens: Any,
            per_token: float = TOKEN_TOLERANCE_NATS) -> Comparison:
    """``continuation_tokens(context, continuation)``: how many tokens lm-eval scored for a
    choice (its tolerance is that many times ``per_token``)."""
    over: list[dict[str, Any]] = []
    worst = worst_token = 0.0
    mine, theirs = _samples(ours, MC_TASK), _samples(ref, MC_TASK)
    for a, b in zip(mine, theirs, strict=True):
        for k, (ra, rb, args) in enumerate(zip(a["resps"], b["resps"], a["arguments"], strict=True)):
            diff = abs(float(ra[0][0]) - float(rb[0][0]))
            n = continuation_tokens(*args[:2])
            worst, worst_token = max(worst, diff), max(worst_token, diff / n)
            if diff > per_token * n:
                over.append({"doc_id": a["doc_id"], "choice": k, "ours": ra[0][0], "reference": rb[0][0],
                             "tokens": n})
    gen_a, gen_b = _samples(ours, GEN_TASK), _samples(ref, GEN_TASK)
    different = [{"doc_id": a["doc_id"], "ours": a["resps"][0][0], "reference": b["resps"][0][0]}
                 for a, b in zip(gen_a, gen_b, strict=True) if a["resps"][0][0] != b["resps"][0][0]]
    return Comparison(len(mine), _metric(ours, MC_TASK, "acc"), _metric(ref, MC_TASK, "acc"), over, worst,
                      worst_token, len(gen_a), len(gen_a) - len(different), different,
                      _metric(ours, GEN_TASK, "exact_match"), _metric(ref, GEN_TASK, "exact_match"))


def token_counter(folder: Path) -> Any:
    """How many tokens lm-eval scores for (context, continuation): the whole's tokens less the
    context's, as its ``_encode_pair`` splits them (a trailing space moves to the continuation)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)

    def count(context: str, continuation: str) -> int:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = tok.encode(context + continuation, add_special_tokens=False)
        return max(1, len(whole) - len(tok.encode(context, add_special_tokens=False)))
    return count


def run(base_url: str, model: str, folder: Path, n: int, workdir: Path, api_key: str | None = None,
        n_gen: int | None = None, concurrent: int = 1) -> tuple[Comparison, dict[str, float]]:
    """Both backends over ``n`` multiple-choice and ``n_gen`` (default ``n``) generation items;
    the comparison and each run's seconds."""
    tasks = task_configs(build_items(n, n_gen), workdir)
    seconds = {}
    start = time.perf_counter()
    ours = evaluate("local-completions", server_model_args(base_url, model, folder, api_key, concurrent), tasks)
    seconds["server"] = time.perf_counter() - start
    start = time.perf_counter()
    ref = evaluate("hf", hf_model_args(folder), tasks)
    seconds["hf"] = time.perf_counter() - start
    return compare(ours, ref, token_counter(folder)), seconds


def table(c: Comparison, seconds: dict[str, float]) -> str:
    rows = [("items: multiple-choice / generation", c.items, c.generations),
            ("loglikelihood accuracy (ours / hf)", f"{c.accuracy:.3f}", f"{c.reference_accuracy:.3f}"),
            ("max |loglikelihood diff| (nats)", f"{c.max_abs_loglikelihood_diff:.2e}", ""),
            ("max diff per continuation token (nats)", f"{c.max_per_token_diff:.2e}", ""),
            ("choices over tolerance", len(c.over_tolerance), ""),
            ("greedy generations equal", f"{c.generations_equal}/{c.generations}", ""),
            ("generation exact_match (ours / hf)", f"{c.exact_match:.3f}", f"{c.reference_exact_match:.3f}"),
            ("lm-eval seconds (ours / hf)", f"{seconds['server']:.0f}", f"{seconds['hf']:.0f}")]
    return "\n".join(f"{name:<42} {a!s:>10} {b!s:>10}" for name, a, b in rows)


def main(argv: Sequence[str] | None = None) -> None:
    from fastserve.bench.experiments.server import ROOT, ServeApps
    from fastserve.model_folder import DEFAULT_FOLDER

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=200, help="multiple-choice items (default: the issue's 200)")
    parser.add_argument("--gen-items", type=int, default=None, help="generation items (default: --items)")
    parser.add_argument("--concurrent", type=int, default=1, help="requests in flight to our server")
    parser.add_argument("--folder", type=Path, default=DEFAULT_FOLDER)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--url", default=None, help="a running server instead of starting config/demo.yaml")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "eval_parity" / "eval_parity.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    workdir = args.out.parent
    if args.url is not None:
        comparison, seconds = run(args.url, args.model, args.folder, args.items, workdir, None, args.gen_items,
                                  args.concurrent)
    else:
        with ServeApps([], workdir / "serve.log", base=ROOT / "config" / "demo.yaml",
                       variants={args.dtype: {"model": {"dtype": args.dtype}}}) as apps:
            comparison, seconds = run(apps.url(args.dtype), args.model, args.folder, args.items, workdir, None,
                                      args.gen_items, args.concurrent)
    print(table(comparison, seconds))
    record = {"dtype": args.dtype, "concurrent": args.concurrent, "seconds": seconds, **asdict(comparison)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
