"""JSON-schema-constrained decoding against the same requests unconstrained, on SmolLM2, in the
engine (no Redis: what the grammar costs per token, nothing else).

For each concurrency C in 1, 8 and 32, C chat requests (each asking for a different city as
JSON; three schemas in turn) run together, constrained and then unconstrained, the two sides
alternating ``--rounds`` times. Unconstrained requests are given exactly the output length the
constrained run produced (``max_tokens`` = that length, ``ignore_eos``), so both sides generate
the same number of tokens and their times compare directly: throughput ratio = unconstrained
time / constrained time (median over rounds). Every constrained output is validated with
``jsonschema``. The grammar compiler's own figures give the cost of a first compile (a grammar
built) and of a cached one (a copy of the compiled matcher), measured on the engine's compile
thread.

Run: ``.venv/bin/python benchmarks/bench_structured.py [--rounds 2] [--threads 2]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch

from tokenfleet.worker.devtools.bench_table import add_record_flag, record_figures

HEADLINE_KEYS = ("structured-32",)  # its row in benchmarks/RESULTS.md

ROOT = Path(__file__).resolve().parents[1]

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
            "population_millions": {"type": "integer", "minimum": 0, "maximum": 40},
        },
        "required": ["city", "country", "population_millions"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "kind": {"enum": ["capital", "port", "other"]},
            "landmarks": {
                "type": "array",
                "items": {"type": "string", "maxLength": 24},
                "minItems": 1,
                "maxItems": 2,
            },
        },
        "required": ["city", "kind", "landmarks"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "location": {
                "type": "object",
                "properties": {
                    "north": {"type": "boolean"},
                    "continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]},
                },
                "required": ["north", "continent"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "location"],
        "additionalProperties": False,
    },
]
CITIES = [
    "Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Rome", "Delhi", "Quito",
    "Perth", "Seoul", "Dakar", "Hanoi", "Lagos", "Milan", "Bern", "Kyiv",
]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    add_record_flag(ap)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--max-tokens", type=int, default=120)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from tokenfleet.shared.schema import Constraint
    from tokenfleet.worker.engine.engine import Engine
    from tokenfleet.worker.engine.request import SamplingParams
    from tokenfleet.worker.models.resolve import resolve_model

    engine = Engine(
        resolve_model("smollm2", cache=ROOT / ".cache" / "models"),
        num_kv_blocks=2048,
        max_num_seqs=32,
        max_num_batched_tokens=2048,
    )
    tok = engine.tokenizer
    grammars = [Constraint("json_schema", s).check() for s in SCHEMAS]

    def prompt(i: int) -> list[int]:
        text = tok.apply_chat_template(
            [{"role": "user", "content": f"Give facts about {CITIES[i % len(CITIES)]} as JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def run(params: list[Any]) -> tuple[float, list[Any]]:
        start = time.perf_counter()
        outs = engine.generate([prompt(i) for i in range(len(params))], params)
        return time.perf_counter() - start, outs

    # first compiles: each grammar built once (the cache is empty), then the cached cost
    compiler = engine.grammar_compiler()
    run([SamplingParams(max_tokens=1, grammar=g, temperature=0) for g in grammars])
    first = compiler.stats.compile_s / max(1, compiler.stats.num_compiled)
    tokenizer_s = compiler.stats.tokenizer_s
    before = (compiler.stats.num_cached, compiler.stats.cached_s)
    run([SamplingParams(max_tokens=1, grammar=grammars[i % 3], temperature=0) for i in range(30)])
    cached = (compiler.stats.cached_s - before[1]) / (compiler.stats.num_cached - before[0])

    print(f"torch threads {args.threads}; SmolLM2-135M-Instruct fp32; rounds {args.rounds}")
    print(f"grammar tokenizer (once per engine): {tokenizer_s * 1000:.0f} ms")
    print(f"compile, first: {first * 1000:.2f} ms per schema; cached: {cached * 1000:.3f} ms")
    print(
        f"{'C':>3} {'tokens':>7} {'constrained s':>14} {'free s':>9} {'ratio':>6} "
        f"{'valid':>7}  ratios per round"
    )
    total_valid = total = 0
    ratio_32 = 0.0
    for c in (1, 8, 32):
        ratios, times_c, times_u = [], [], []
        valid = tokens = 0
        for r in range(args.rounds):
            constrained = [
                SamplingParams(
                    max_tokens=args.max_tokens, temperature=0.7, seed=r * 100 + i,
                    grammar=grammars[i % 3],
                )
                for i in range(c)
            ]  # fmt: skip
            t_c, outs = run(constrained)
            lengths = [max(1, len(o.token_ids)) for o in outs]
            free = [
                SamplingParams(max_tokens=n, temperature=0.7, seed=r * 100 + i, ignore_eos=True)
                for i, n in enumerate(lengths)
            ]
            t_u, _ = run(free)
            for i, o in enumerate(outs):
                total += 1
                try:
                    jsonschema.validate(json.loads(o.text), SCHEMAS[i % 3])
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    print(f"  invalid ({o.finish_reason}): {o.text!r}")
            tokens = sum(lengths)
            times_c.append(t_c)
            times_u.append(t_u)
            ratios.append(t_u / t_c)
        total_valid += valid
        ratio_32 = statistics.median(ratios)
        print(
            f"{c:>3} {tokens:>7} {statistics.median(times_c):>14.2f} "
            f"{statistics.median(times_u):>9.2f} {statistics.median(ratios):>6.3f} "
            f"{valid:>3}/{c * args.rounds:<3}  {' '.join(f'{x:.3f}' for x in ratios)}"
        )
    print(f"schema validity: {total_valid}/{total} = {100 * total_valid / total:.1f} %")
    if args.record:  # its row in benchmarks/RESULTS.md
        figures = {HEADLINE_KEYS[0]: f"{ratio_32:.3f}; {total_valid}/{total}"}
        record_figures(figures, benchmarks=Path(__file__).parent, keys=HEADLINE_KEYS)


if __name__ == "__main__":
    main()
