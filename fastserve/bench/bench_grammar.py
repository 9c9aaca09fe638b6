"""Grammar engines side by side, per token: ``python -m fastserve.bench.bench_grammar``.

llguidance and xgrammar (when installed) compile the same constraints for a model folder's tokenizer
and walk a valid output, computing the next-token bitmask at each token; at SmolLM2's and Gemma 3's
vocabularies, the engines interleaved round by round. The first round is cold, the medians are over
the later ones (from the compiled cache); index builds and cold compiles are timed too. A table, then
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastserve.bench.race import cpu_model
from fastserve.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
MODEL_ROOT = ROOT / ".cache" / "models"
MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                         "email": {"type": "string"}, "languages": {"type": "array", "items": {"type": "string"}},
                         "role": {"enum": ["admin", "user", "guest"]}, "active": {"type": "boolean"}},
          "required": ["name", "age", "languages", "role", "active"]}
#: Each workload: the constraint and a valid output the engines walk token by token.
WORKLOADS: dict[str, tuple[str, Any, str]] = {
    "json_schema": ("json_schema", SCHEMA,
                    '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", '
                    '"languages": ["English", "French", "Italian"], "role": "admin", "active": true}'),
    "json_object": ("json_object", None,
                    '{"city": "Paris", "population": 2148000, "districts": [1, 2, 3], "capital": true}'),
    "regex": ("regex", r"\d{3}-\d{3}-\d{4} \((home|work|mobile)\)", "555-867-5309 (mobile)"),
    "choice": ("choice", ["positive", "negative", "neutral"], "negative"),
}


@dataclass
class Walk:
    """One engine's run over one workload: per-token mask seconds, and the compile seconds
    (0 for a walk from the cache)."""

    compile_s: float
    mask_s: list[float]


def timed(make: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    out = make()
    return out, time.perf_counter() - started


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab: int) -> None:
        import llguidance

        self.llg = llguidance
        started = time.perf_counter()
        eos = tokenizer.eos_token_id
        self.tok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab, eos_token=eos)
        self.index_s = time.perf_counter() - started
        self.mask = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)

    def grammar(self, kind: str, spec: Any) -> str:
        M = self.llg.LLMatcher
        if kind == "json_schema":
            return M.grammar_from_json_schema(json.dumps(spec), defaults={"whitespace_flexible": True})
        if kind == "json_object":
            return M.grammar_from_json_schema('{"type": "object"}', defaults={"whitespace_flexible": True})
        if kind == "regex":
            return M.grammar_from_regex(spec)
        return self.llg.grammar_from("choice", json.dumps(spec))

    def walk(self, kind: str, spec: Any, tokens: list[int], cached: dict[str, Any]) -> Walk:
        compile_s = 0.0
        if kind not in cached:
            cached[kind], compile_s = timed(lambda: self.llg.LLMatcher(self.tok, self.grammar(kind, spec)))
        matcher = cached[kind].deep_copy()
        assert not matcher.is_error(), matcher.get_error()
        out = []
        row = self.mask[0]
        for t in tokens:
            started = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            out.append(time.perf_counter() - started)
            assert (row[t // 32] >> (t % 32)) & 1, f"llguidance masked the valid token {t}"
            assert matcher.consume_token(t), matcher.get_error()
        return Walk(compile_s, out)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, vocab: int) -> None:
        import xgrammar
        from transformers import AutoTokenizer

        self.xgr = xgrammar
        started = time.perf_counter()
        hf = AutoTokenizer.from_pretrained(tokenizer.directory)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.index_s = time.perf_counter() - started
        self.mask = xgrammar.allocate_token_bitmask(1, vocab)

    def compiled(self, kind: str, spec: Any) -> Any:
        c = self.compiler
        if kind == "json_schema":
            return c.compile_json_schema(json.dumps(spec), any_whitespace=True)
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "regex":
            return c.compile_regex(spec)
        return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec))

    def walk(self, kind: str, spec: Any, tokens: list[int], cached: dict[str, Any]) -> Walk:
        compile_s = 0.0
        if kind not in cached:
            cached[kind], compile_s = timed(lambda: self.compiled(kind, spec))
        matcher = self.xgr.GrammarMatcher(cached[kind])
        out = []
        for t in tokens:
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(self.mask, 0)
            out.append(time.perf_counter() - started)
            assert (int(self.mask[0, t // 32]) >> (t % 32)) & 1, f"xgrammar masked the valid token {t}"
            assert matcher.accept_token(t)
        return Walk(compile_s, out)


ENGINES: dict[str, Callable[[Tokenizer, int], Any]] = {"llguidance": LLGuidance, "xgrammar": XGrammar}


def model_vocab(folder: Path) -> int:
    config = json.loads((folder / "config.json").read_text())
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])


def run(models: list[str], engines: list[str], rounds: int, model_root: Path = MODEL_ROOT) -> dict[str, Any]:
    results: dict[str, Any] = {"cpu": cpu_model(), "rounds": rounds, "engines": {}, "rows": []}
    for model in models:
        folder = model_root / MODELS[model]
        if not (folder / "tokenizer.json").exists():
            print(f"{model}: no folder at {folder} (make model); skipped", file=sys.stderr)
            continue
        tokenizer = Tokenizer.from_dir(folder)
        vocab = model_vocab(folder)
        built: dict[str, Any] = {}
        for name in engines:
            try:
                built[name] = ENGINES[name](tokenizer, vocab)
            except ImportError as exc:
                results["engines"][name] = f"not installed ({exc})"
                continue
            results["engines"].setdefault(name, "installed")
            results["rows"].append({"model": model, "vocab": vocab, "engine": name, "workload": "tokenizer index",
                                    "index_s": built[name].index_s})
        walks: dict[tuple[str, str], list[Walk]] = {}
        caches: dict[str, dict[str, Any]] = {name: {} for name in built}
        for r in range(rounds + 1):
            order = list(built) if r % 2 == 0 else list(reversed(built))   # A/B, then B/A
            for workload, (kind, spec, text) in WORKLOADS.items():
                tokens = tokenizer.encode(text, add_special_tokens=False)
                for name in order:
                    walk = built[name].walk(kind, spec, tokens, caches[name])
                    walks.setdefault((name, workload), []).append(walk)
        for (name, workload), (cold, *warm) in walks.items():
            results["rows"].append({
                "model": model, "vocab": vocab, "engine": name, "workload": workload, "tokens": len(cold.mask_s),
                "compile_ms": 1e3 * cold.compile_s, "cold_mask_us_mean": 1e6 * statistics.fmean(cold.mask_s),
                "mask_us_median": 1e6 * statistics.median(statistics.median(w.mask_s) for w in warm),
                "mask_us_mean": 1e6 * statistics.median(statistics.fmean(w.mask_s) for w in warm),
                "mask_us_max": 1e6 * statistics.median(max(w.mask_s) for w in warm)})
    return results


def print_table(results: dict[str, Any]) -> None:
    print(f"grammar engines per token on {results['cpu']} (a cold round, then {results['rounds']} interleaved "
          "rounds from the cache: medians over them)")
    print(f"{'model':8} {'vocab':>7} {'engine':11} {'workload':16} {'tokens':>6} {'compile ms':>10} "
          f"{'cold µs mean':>12} {'mask µs med':>11} {'mean':>8} {'max':>8}")
    for row in results["rows"]:
        if "index_s" in row:
            print(f"{row['model']:8} {row['vocab']:>7} {row['engine']:11} {'tokenizer index':16} "
                  f"{'':>6} {1e3 * row['index_s']:>10.1f}")
            continue
        print(f"{row['model']:8} {row['vocab']:>7} {row['engine']:11} {row['workload']:16} {row['tokens']:>6} "
              f"{row['compile_ms']:>10.2f} {row['cold_mask_us_mean']:>12.1f} {row['mask_us_median']:>11.1f} "
              f"{row['mask_us_mean']:>8.1f} {row['mask_us_max']:>8.1f}")
    for name, state in results["engines"].items():
        if state != "installed":
            print(f"{name}: {state}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model-root", type=Path, default=MODEL_ROOT, help="folder holding the model folders")
    args = parser.parse_args(argv)
    results = run(args.models, args.engines, args.rounds, args.model_root)
    print_table(results)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
