"""The two grammar libraries side by side on SmolLM2's tokenizer: llguidance and xgrammar.

What it measures, for each library, in one run (same tokenizer, same schemas, same token paths):

* the one-off cost of wrapping the tokenizer (per engine);
* the compile of a JSON schema: the first one, and the same schema again (the library's own
  cache, if any, or a new matcher from a kept compiled grammar: what the engine pays per request);
* the per-step mask of 1 and 32 constrained rows, filled in one batched call, while each row
  advances along a valid JSON answer (so the matcher states are realistic, not the start state).

Run: ``.venv/bin/python benchmarks/bench_grammar_libs.py`` (xgrammar is not a project dependency:
``pip install xgrammar`` first to measure it; it is skipped when missing). Prints a table; the
thread count used by each library's batched fill is stated.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 5,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string"},
                        "qty": {"type": "integer", "minimum": 1},
                        "price": {"type": "number"},
                    },
                    "required": ["sku", "qty", "price"],
                    "additionalProperties": False,
                },
            },
            "customer": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
                "required": ["name", "vip"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "status", "items", "customer"],
        "additionalProperties": False,
    },
}

ANSWERS = {
    "person": {"name": "Ada Lovelace", "age": 36, "email": "ada@math.com"},
    "order": {
        "id": 17,
        "status": "paid",
        "items": [{"sku": "A-1", "qty": 2, "price": 9.5}, {"sku": "B-22", "qty": 1, "price": 100}],
        "customer": {"name": "Grace", "vip": True},
    },
}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:8.3f} ms"


class LLGuidanceLib:
    name = "llguidance"

    def __init__(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        start = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tokenizer)
        self.setup_s = time.perf_counter() - start
        self.executor = llguidance.LLExecutor()
        self.vocab = self.tok.vocab_size
        self.threads = (
            f"LLExecutor default ({min(32, max(1, int(0.8 * (os.cpu_count() or 1))))} threads)"
        )

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        err = self.llg.LLMatcher.validate_grammar(grammar, self.tok)
        if err:
            raise ValueError(err)
        return grammar

    def matcher(self, compiled: Any) -> Any:
        m = self.llg.LLMatcher(self.tok, compiled, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def bitmask(self, rows: int) -> torch.Tensor:
        return torch.full((rows, (self.vocab + 31) // 32), -1, dtype=torch.int32)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)],
            bitmask.data_ptr(),
            bitmask.shape[1] * 4,
            bitmask.shape[0],
        )

    def accept(self, matchers: list[Any], tokens: list[int]) -> None:
        for m, t in zip(matchers, tokens, strict=True):
            if not m.consume_token(t):
                raise RuntimeError(m.get_error())


class XGrammarLib:
    name = "xgrammar"

    def __init__(self, tokenizer: Any) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        start = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=True)
        self.setup_s = time.perf_counter() - start
        self.vocab = self.info.vocab_size
        self.batch = xgr.BatchGrammarMatcher()
        self.threads = "BatchGrammarMatcher default threads"

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matchers: list[Any], tokens: list[int]) -> None:
        for m, t in zip(matchers, tokens, strict=True):
            if not m.accept_token(t):
                raise RuntimeError("token refused")


def measure(lib: Any, tokenizer: Any) -> dict[str, float]:
    out: dict[str, float] = {"setup_s": lib.setup_s}
    firsts, cached = [], []
    compiled: dict[str, Any] = {}
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        compiled[name] = lib.compile(schema)
        lib.matcher(compiled[name])
        firsts.append(time.perf_counter() - start)
        start = time.perf_counter()
        lib.matcher(lib.compile(schema) if lib.name == "xgrammar" else compiled[name])
        cached.append(time.perf_counter() - start)
    out["compile_first_s"] = statistics.mean(firsts)
    out["compile_cached_s"] = statistics.mean(cached)
    for rows in (1, 32):
        names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(rows)]
        paths = [tokenizer.encode(json.dumps(ANSWERS[n]), add_special_tokens=False) for n in names]
        matchers = [lib.matcher(compiled[n]) for n in names]
        bitmask = lib.bitmask(rows)
        steps = min(len(p) for p in paths)
        times = []
        for step in range(steps):
            start = time.perf_counter()
            lib.fill(matchers, bitmask)
            times.append(time.perf_counter() - start)
            lib.accept(matchers, [p[step] for p in paths])
        out[f"mask_{rows}_s"] = statistics.median(times)
    return out


def main() -> None:
    from transformers import AutoTokenizer

    from tokenfleet.worker.models.resolve import resolve_model

    folder = resolve_model("smollm2", cache=ROOT / ".cache" / "models")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    print(
        f"SmolLM2 tokenizer, vocabulary {len(tokenizer)}; torch threads {torch.get_num_threads()}"
    )
    libs: list[Any] = [LLGuidanceLib(tokenizer)]
    try:
        libs.append(XGrammarLib(tokenizer))
    except ImportError:
        print("xgrammar is not installed: skipped")
    rows = [(lib, measure(lib, tokenizer)) for lib in libs]
    print(
        f"{'library':<11} {'tokenizer':>11} {'compile 1st':>11} {'again':>11} "
        f"{'mask 1 row':>11} {'mask 32':>11}  threads"
    )
    for lib, r in rows:
        print(
            f"{lib.name:<11} {_ms(r['setup_s'])} {_ms(r['compile_first_s'])} "
            f"{_ms(r['compile_cached_s'])} {_ms(r['mask_1_s'])} {_ms(r['mask_32_s'])}  "
            f"{lib.threads}"
        )


if __name__ == "__main__":
    main()
