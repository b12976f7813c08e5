"""Grammar libraries for structured output, measured on the zoo tokenizer:
`python -m loadtest.bench_grammar [--repeats 3] [--walks 20] [--out docs/benchmarks.md]`.

For xgrammar and llguidance (both need installing: the one not chosen is not a dependency of dasc-serve), each
built from the zoo's byte-level vocabulary (4096 ids, raw token bytes) with whitespace fixed by the grammar:

- compile time of each schema (`json_object`: any object; `small`: a flat strict object with bounded strings;
  `nested`: objects inside an array inside an object, enums and bounded strings), median over repeats, each
  compile from scratch (no cache);
- per-token cost: filling the next-token bitmask, and accepting the picked token (median and p99 over every
  token of every walk of a repeat, then the median over repeats);
- correctness: `--walks` random walks per schema and repeat, picking uniformly among the allowed tokens (the
  end token only where the grammar allows it), and the same with kda-tiny sampling at temperature 1 from the
  masked logits; per kind: the share of walks that end within `--max-tokens`, and among those the share whose
  text `json.loads` (strict: no raw control characters) and validates against the schema (`jsonschema`).

Results: loadtest/results/bench_grammar_cpu.json, variant `default`; --out DOC replaces its block in DOC.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import random
import time

import jsonschema
import torch

from app.models.batch import BatchLayout, ContiguousKV
from app.models.loader import ZOO_DIR, load_model
from app.models.tokenizer import Tokenizer
from loadtest.common import median, start_run, table
from loadtest.sections import publish

_NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS = {
    "json_object": {"type": "object"},
    "small": {"type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                               "ok": {"type": "boolean"}},
              "required": ["name", "age", "ok"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "id": {"type": "integer"},
        "owner": {"type": "object", "properties": {"name": _NAME, "role": {"enum": ["admin", "user", "guest"]}},
                  "required": ["name", "role"], "additionalProperties": False},
        "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": _NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["id", "owner", "items"], "additionalProperties": False},
}
PROMPT = "Reply with one JSON object.\n"


class XGrammar:
    """xgrammar: the vocabulary as raw bytes (`VocabType.RAW`), compact separators, no free whitespace.
    `controls_masked` (the variant `xgrammar+ctl`): tokens holding a byte below 0x20 are never allowed, as in
    app/engine/grammar.py (xgrammar's length-bounded strings let raw control characters in, which JSON forbids;
    with no free whitespace, valid output never holds one)."""

    def __init__(self, tok: Tokenizer, controls_masked: bool = False) -> None:
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, tok.vocab_size
        self.name = "xgrammar+ctl" if controls_masked else "xgrammar"
        self.keep = None
        if controls_masked:
            self.keep = xgr.allocate_token_bitmask(1, self.vocab)
            for i in range(self.vocab):
                if any(b < 0x20 for b in tok.token_bytes(i)):
                    self.keep[0, i // 32] &= ~(1 << (i % 32))
        # special tokens as empty entries: never allowed inside the JSON (the end tokens by their ids)
        self.info = xgr.TokenizerInfo([tok.token_bytes(i, True) for i in range(self.vocab)], xgr.VocabType.RAW,
                                      vocab_size=self.vocab, stop_token_ids=list(tok.stop_token_ids))

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matcher(self, compiled) -> _XMatcher:
        return _XMatcher(self.xgr, compiled, self.vocab, self.keep)


class _XMatcher:
    def __init__(self, xgr, compiled, vocab: int, keep: torch.Tensor | None) -> None:
        self.m, self.bits, self.keep = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab), keep

    def fill(self) -> torch.Tensor:
        self.m.fill_next_token_bitmask(self.bits)
        if self.keep is not None:
            self.bits &= self.keep
        return self.bits

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    def done(self) -> bool:
        return self.m.is_terminated()


class LLGuidance:
    """llguidance: the tokenizer from its `tokenizers` JSON, compact separators, no free whitespace."""

    name = "llguidance"

    def __init__(self, tok: Tokenizer) -> None:
        import llguidance
        import llguidance.torch

        self.ll, self.vocab = llguidance, tok.vocab_size
        self.tok = llguidance.LLTokenizer(tok._backend.to_str(), n_vocab=self.vocab, eos_token=list(tok.stop_token_ids))

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), overrides={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
        matcher = self.ll.LLMatcher(self.tok, grammar)  # builds the lexer: the compile
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def matcher(self, grammar) -> _LLMatcher:
        return _LLMatcher(self.ll, self.tok, grammar, self.vocab)


class _LLMatcher:
    def __init__(self, ll, tok, grammar: str, vocab: int) -> None:
        self.ll, self.m = ll, ll.LLMatcher(tok, grammar)
        self.bits = ll.torch.allocate_token_bitmask(1, vocab)

    def fill(self) -> torch.Tensor:
        self.ll.torch.fill_next_token_bitmask(self.m, self.bits, 0)
        return self.bits

    def accept(self, token: int) -> bool:
        return self.m.consume_token(token)

    def done(self) -> bool:
        return self.m.is_stopped()


LIBRARIES = {  # variant -> (package, adapter)
    "xgrammar": ("xgrammar", XGrammar), "xgrammar+ctl": ("xgrammar", lambda tok: XGrammar(tok, controls_masked=True)),
    "llguidance": ("llguidance", LLGuidance)}


def allowed_ids(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The ids a [1, ceil(V/32)] int32 bitmask allows (bit i % 32 of word i // 32)."""
    ids = torch.arange(vocab)
    return ids[((bits[0][ids // 32] >> (ids % 32)) & 1).bool()]


class TinyModel:
    """kda-tiny's next-token logits one token at a time (the prompt prefilled once per walk)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.model = load_model(ZOO_DIR / "kda-tiny")
        self.prompt = tok.encode(PROMPT)

    @torch.no_grad()
    def start(self):
        kv, states = ContiguousKV(), self.model.empty_states(1)
        logits, states = self.model(torch.tensor(self.prompt), BatchLayout((len(self.prompt),), (0,)), kv, states)
        return {"kv": kv, "states": states, "pos": len(self.prompt), "logits": logits[0]}

    @torch.no_grad()
    def advance(self, ctx: dict, token: int) -> None:
        logits, ctx["states"] = self.model(torch.tensor([token]), BatchLayout((1,), (ctx["pos"],)), ctx["kv"],
                                           ctx["states"])
        ctx["pos"] += 1
        ctx["logits"] = logits[0]


def walk(lib, compiled, tok: Tokenizer, rng: random.Random, max_tokens: int, model: TinyModel | None,
         gen: torch.Generator | None):
    """One generation under the grammar: -> (ended, text, fill seconds per token, accept seconds per token)."""
    m = lib.matcher(compiled)
    ctx = model.start() if model else None
    ids, fills, accepts = [], [], []
    for _ in range(max_tokens):
        t0 = time.perf_counter()
        bits = m.fill()
        fills.append(time.perf_counter() - t0)
        allowed = allowed_ids(bits, tok.vocab_size)
        if model is None:
            token = int(allowed[rng.randrange(len(allowed))])
        else:
            masked = torch.full_like(ctx["logits"], float("-inf"))
            masked[allowed] = ctx["logits"][allowed].float()
            token = int(torch.multinomial(torch.softmax(masked, -1), 1, generator=gen))
        if token in tok.stop_token_ids:
            return True, tok.decode(ids), fills, accepts
        t0 = time.perf_counter()
        if not m.accept(token):
            raise AssertionError(f"{lib.name} refused a token its own mask allowed")
        accepts.append(time.perf_counter() - t0)
        ids.append(token)
        if m.done():
            return True, tok.decode(ids), fills, accepts
        if model is not None:
            model.advance(ctx, token)
    return False, tok.decode(ids), fills, accepts


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]


def measure(lib, tok: Tokenizer, args, model: TinyModel | None) -> list[dict]:
    rows = []
    for name, schema in SCHEMAS.items():
        compile_s, fill_med, fill_p99, acc_med = [], [], [], []
        counts = {"random": [0, 0, 0], "model": [0, 0, 0]}  # walks, ended, valid among ended
        bad = []
        for rep in range(args.repeats):
            t0 = time.perf_counter()
            compiled = lib.compile(schema)
            compile_s.append(time.perf_counter() - t0)
            fills, accepts = [], []
            for kind in ("random", "model") if model else ("random",):
                for w in range(args.walks if kind == "random" else args.model_walks):
                    seed = 1000 * rep + w
                    ended, text, f, a = walk(lib, compiled, tok, random.Random(seed), args.max_tokens,
                                             model if kind == "model" else None, torch.Generator().manual_seed(seed))
                    fills += f
                    accepts += a
                    c = counts[kind]
                    c[0], c[1] = c[0] + 1, c[1] + ended
                    if ended:
                        ok = valid(text, schema)
                        c[2] += ok
                        if not ok and len(bad) < 3:
                            bad.append(text[:80])
            fill_med.append(median(fills) * 1e6)
            fill_p99.append(p99(fills) * 1e6)
            acc_med.append(median(accepts) * 1e6)
        row = {"library": lib.name, "schema": name, "compile_ms": median(compile_s) * 1e3,
               "fill_us_median": median(fill_med), "fill_us_p99": median(fill_p99), "accept_us_median": median(acc_med),
               **{f"{k}_{what}": v for k, c in counts.items() for what, v in zip(("walks", "ended", "valid"), c)},
               "invalid_examples": bad}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def share(n: int, of: int) -> str:
    return f"{n}/{of}" if of else "-"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--libraries", nargs="+", default=list(LIBRARIES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--walks", type=int, default=20, help="random walks per schema and repeat")
    p.add_argument("--model-walks", type=int, default=5, help="kda-tiny generations per schema and repeat (0: none)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="replace this run's block in this markdown file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    packages = dict.fromkeys(LIBRARIES[n][0] for n in args.libraries)
    versions = {name: importlib.metadata.version(name) for name in packages}
    record = start_run("bench_grammar", {**{k: v for k, v in vars(args).items() if k != "out"},
                                         "versions": versions}, argv)
    tok = Tokenizer.from_dir(ZOO_DIR / "_tokenizer")
    model = TinyModel(tok) if args.model_walks else None
    rows, setup = [], {}
    for package in packages:
        importlib.import_module(package)  # not part of the setup time
    for name in args.libraries:
        t0 = time.perf_counter()
        lib = LIBRARIES[name][1](tok)
        setup[name] = (time.perf_counter() - t0) * 1e3
        rows += measure(lib, tok, args, model)
    md = (f"Libraries: {', '.join(f'{k} {v}' for k, v in versions.items())}; tokenizer setup (once per tokenizer) "
          + ", ".join(f"{k} {v:.0f} ms" for k, v in setup.items())
          + f". {args.repeats} repeats; per repeat and schema {args.walks} uniform random walks over the allowed "
          f"tokens and {args.model_walks} kda-tiny generations at temperature 1 from the masked logits, at most "
          f"{args.max_tokens} tokens each. *compile*: one schema from scratch (median); *fill*: the next-token "
          "bitmask (median and p99 over a repeat's tokens, median over repeats); *accept*: advancing by the picked "
          "token. *ended*: walks that reached the end within the limit; *valid*: of those, the ones that "
          "`json.loads` and validate.\n\n")
    md += table(["library", "schema", "compile ms", "fill µs median", "fill µs p99", "accept µs", "random ended",
                 "random valid", "kda-tiny ended", "kda-tiny valid"],
                [[r["library"], r["schema"], r["compile_ms"], r["fill_us_median"], r["fill_us_p99"],
                  r["accept_us_median"], share(r["random_ended"], r["random_walks"]),
                  share(r["random_valid"], r["random_ended"]), share(r["model_ended"], r["model_walks"]),
                  share(r["model_valid"], r["model_ended"])] for r in rows]) + "\n"
    examples = [(r["library"], r["schema"], e) for r in rows for e in r["invalid_examples"]]
    if examples:
        md += "\nInvalid outputs (first 80 characters):\n\n" + "\n".join(
            f"- {lib} {schema}: `{json.dumps(e)}`" for lib, schema, e in examples) + "\n"
    publish(record, "default", {"rows": rows, "setup_ms": setup}, md, args.out,
            "Structured output (grammar libraries)")


if __name__ == "__main__":
    main()
