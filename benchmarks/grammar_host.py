"""Host time of structured outputs per step: filling the token bitmask of N guided rows and advancing their
matchers, one by one and on llguidance's thread pool, for matchers built from the grammar and (`--copies`) for
copies of one started matcher; and the transfer of a bitmask-sized array to the device.

    python benchmarks/bench_model_dir.py --out /tmp/llama8b_tok
    python benchmarks/grammar_host.py --model /tmp/llama8b_tok --rows 256 --steps 24 --copies

Each step fills the rows' masks, then feeds every row a token its mask allows (drawn with a fixed seed), as the
engine does; the first two steps are left out of the medians (tables built at a matcher's first masks). A
matcher that completes its grammar stays stopped (its mask allows EOS only), as a finished request's would.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from common import positive_int, print_table, save_results

from jengine.structured_output import GrammarCompiler, StructuredOutputsParams, allowed_tokens
from jengine.tokenizer import load_tokenizer

CONSTRAINTS = {
    "regex": {"regex": "[a-z ]+"},
    "json": {"json": {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}},
}


def _steps(compiler: GrammarCompiler, matchers: list, steps: int, vocab: int, eos: int, seed: int) -> dict:
    rows = list(enumerate(matchers))
    rng = np.random.default_rng(seed)
    fill, one_by_one, pooled = [], [], []
    for step in range(steps):
        t = time.perf_counter()
        table = compiler.fill_bitmask(rows, len(rows))
        fill.append(time.perf_counter() - t)
        tokens = []
        for r in range(len(rows)):
            allowed = allowed_tokens(table[r], vocab)
            choices = allowed[allowed != eos]
            tokens.append(int(rng.choice(choices)) if len(choices) else eos)
        pairs = list(zip(matchers, tokens))
        t = time.perf_counter()
        if step % 2:
            compiler.consume(pairs)
        else:
            for m, tok in pairs:
                if not m.is_stopped():
                    m.consume_token(tok)
        (pooled if step % 2 else one_by_one).append(time.perf_counter() - t)
    med = lambda xs: 1e3 * float(np.median(xs[2:] if len(xs) > 3 else xs))  # noqa: E731
    return {"fill_ms": med(fill), "advance_one_by_one_ms": med(one_by_one), "advance_pool_ms": med(pooled)}


def _transfer_ms(megabytes: float, reps: int) -> float:
    import jax

    x = np.random.default_rng(0).integers(0, 2**31, int(megabytes * 2**20) // 4, dtype=np.int32)
    device = jax.devices()[0]
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.device_put(x, device).block_until_ready()
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model directory with a tokenizer (bench_model_dir.py)")
    ap.add_argument("--rows", type=positive_int, default=256)
    ap.add_argument("--steps", type=positive_int, default=24)
    ap.add_argument("--constraints", nargs="+", default=list(CONSTRAINTS), choices=list(CONSTRAINTS))
    ap.add_argument("--copies", action="store_true", help="also time copies (deep_copy) of one started matcher")
    ap.add_argument("--transfer-mb", type=float, nargs="*", default=[4.0, 7.0],
                    help="sizes of int32 arrays to time jax.device_put of (pageable host memory)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else vocab - 1
    compiler = GrammarCompiler(tokenizer, vocab, [eos])
    rows = []
    for name in args.constraints:
        grammar = compiler.grammar(StructuredOutputsParams(**CONSTRAINTS[name]))
        kinds = {"built": lambda g=grammar: [compiler.matcher(g) for _ in range(args.rows)]}
        if args.copies:
            def copies(g=grammar):
                started = compiler.matcher(g)
                compiler.fill_bitmask([(0, started)], 1)  # builds the tables its copies share
                return [started.deep_copy() for _ in range(args.rows)]
            kinds["copies"] = copies
        for kind, make in kinds.items():
            t = time.perf_counter()
            matchers = make()
            made_ms = 1e3 * (time.perf_counter() - t)
            rows.append({"constraint": name, "matchers": kind, "make_ms": made_ms,
                         **_steps(compiler, matchers, args.steps, vocab, eos, args.seed)})
    print_table(rows, ["constraint", "matchers", "make_ms", "fill_ms", "advance_one_by_one_ms", "advance_pool_ms"])
    transfers = [{"megabytes": mb, "device_put_ms": _transfer_ms(mb, 20)} for mb in args.transfer_mb]
    if transfers:
        print_table(transfers, ["megabytes", "device_put_ms"], fmt="{:.3f}")
    return save_results(args, rows, transfers=transfers)


if __name__ == "__main__":
    main()
