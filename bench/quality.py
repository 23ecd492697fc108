"""Retrieval quality of Spotlight's trained codes against the baselines, through the decode path.

    python -m bench.quality [--quick] [--json PATH] [--part retrieval,perplexity,needle,weights]

Every method is a selector in the same `SpotlightDecode` path: the same sinks and window, the
same dense layers and the same budget (kernels.selection_layout: sinks + window + retrieved,
retrieved = max(k_min, ratio * n), per KV head, one selection shared by its query group).

Part `retrieval`: held-out essays (never trained on) are prefilled densely, then their last
tokens are decoded one by one; at every step and layer each method's selection is compared
with the exact top-k (OracleSelector: attention probability summed over the query group) at
budgets 1, 2, 5 and 10 %: recall@k and IoU over the retrieved tokens, attention-mass recall
over everything attended, relative error of the attention output; recall@k again over the
top keys at least 2,048 tokens back only (the distant facts a long document's questions need,
which the average over mostly recent top keys hides). Averages exclude the dense
layers; the per-layer table includes them (it is how the dense layers are chosen).
Part `perplexity`: NLL through the decode path (dense prefill of the first part, then one
token at a time) on other held-out essay text, dense vs each method.
Part `weights`: the same NLL, dense, with the GGUF's weights kept quantized (the default engine,
with int8 activations, and with fp32 ones: `--activations fp32`) and with its fp32 dequantised
copy (`--weights fp32`): issue #20 asks for perplexities within 0.1 %.
Part `needle`: "The special magic number for the city of Lisbon is 7481." in essay haystacks
of 2K-8K tokens at depths 0.1, 0.2, ... 0.9; the question is decoded one token at a time through the
method's policy after the dense prefill of the haystack; greedy, 24 new tokens.
"""
from __future__ import annotations

import time
from pathlib import Path
from dataclasses import replace

from bench.common import ROOT, SMALL_MODEL, Target, finish, log, parser

from .quality_methods import build_methods
from .quality_tasks import essay_ids, needle_grid, perplexity, prefill

BUDGETS = (0.01, 0.02, 0.05, 0.10)
FAR = 2048  # top keys at least this far back are also scored apart (RetrievalProbe)
FAR_COLUMN = f"recall@k, keys >= {FAR} back"
FULL = {"retrieval_docs": 3, "retrieval_len": 8192, "decode_steps": 24, "simhash_bits": (32, 64, 128, 256, 640),
        "ppl_docs": 2, "ppl_prefix": 6144, "ppl_tokens": 256, "ppl_budgets": (0.02, 0.05, 0.10),
        "needle_lengths": (2048, 4096, 6144, 8192), "needle_depths": tuple(d / 10 for d in range(1, 10)),
        "new_tokens": 24, "weights_prefix": 1024, "weights_tokens": 512}
QUICK = {"retrieval_docs": 1, "retrieval_len": 2176, "decode_steps": 3, "simhash_bits": (128, 640),
         "ppl_docs": 1, "ppl_prefix": 2048, "ppl_tokens": 12, "ppl_budgets": (),
         "needle_lengths": (2048,), "needle_depths": (0.5,), "new_tokens": 20,
         "weights_prefix": 256, "weights_tokens": 128}
PLOT = ROOT / "docs" / "quality-recall.png"


def spotlight_config(args):
    from spotlight.config import SpotlightConfig

    defaults = SpotlightConfig()
    dense = defaults.dense_layers if args.dense_layers is None else tuple(
        int(x) for x in args.dense_layers.split(",") if x.strip())
    # dense_below=0: measure selection at every length (the default's short-context shortcut would hide it)
    return replace(defaults, ratio=args.ratio or defaults.ratio, dense_layers=dense, dense_below=0,
                   k_min=defaults.k_min if args.k_min is None else args.k_min,
                   sinks=defaults.sinks if args.sinks is None else args.sinks,
                   window=defaults.window if args.window is None else args.window)


def load(args, need_encoders: bool = True):
    """The engine of --model and its trained encoders (None when no part needs them)."""
    from spotlight.config import EngineConfig, default_home
    from spotlight.engine import Engine, find_encoders
    from spotlight.hashing import load_encoders

    engine = Engine.load(EngineConfig(model_path=args.model or SMALL_MODEL), default_home())
    if not need_encoders:
        return engine, None
    if args.encoders:
        trained = load_encoders(args.encoders, model_fingerprint=engine.fingerprint)
    else:
        trained, warnings = find_encoders(engine.args, engine.fingerprint, args.bits, None)
        if warnings:
            raise SystemExit(f"no trained checkpoint for this model: {warnings[0]}")
    return engine, trained


# ----------------------------------------------------------------------------- retrieval


def retrieval_part(engine, methods, sizes, config):
    import torch

    from .quality_methods import RetrievalProbe

    ids = essay_ids(engine)
    length, steps = sizes["retrieval_len"], sizes["decode_steps"]
    probe = RetrievalProbe(methods, BUDGETS, config.sinks, config.window, length + 8, engine.args, far=FAR)
    for d in range(sizes["retrieval_docs"]):
        doc = ids[d * length : (d + 1) * length]
        started = time.perf_counter()
        cache = prefill(engine.model, doc[: length - steps], length + 8, policy=probe)
        with torch.inference_mode():
            for token in doc[length - steps :]:
                engine.model(torch.tensor([token]), cache, probe)
        log(f"retrieval doc {d}: {time.perf_counter() - started:.0f} s")
    summary = probe.summary()
    sparse = [l for l in range(engine.args.n_layers) if l not in config.dense_layers]
    rows = []
    for name, method in methods.items():
        for budget in BUDGETS:
            cells = [summary[(name, budget, l)] for l in sparse]
            mean = {k: sum(c[k] for c in cells) / len(cells) for k in cells[0]}
            rows.append({"part": "retrieval (mean over sparse layers)", "method": name, "bits": method.bits,
                         "budget": f"{budget:.0%}", "recall@k": mean["recall"], FAR_COLUMN: mean["far"],
                         "IoU": mean["iou"], "mass recall": mean["mass"], "output rel. error": mean["error"]})
    shown = [n for n, m in methods.items() if m.family != "simhash" or m.bits == 640]
    per_layer = []
    for l in range(engine.args.n_layers):
        row = {"part": "retrieval per layer at 2 % (recall@k; oracle: attention-mass recall)", "layer": l}
        for name in shown:
            cell = summary[(name, 0.02, l)]
            row[name] = cell["mass"] if methods[name].family == "oracle" else cell["recall"]
        per_layer.append(row)
    return rows, per_layer


def plot(rows, methods, path):
    """Recall@k at 2 % vs code bits per family, and recall@k vs budget per method (128 bits and no codes),
    over all top keys and over the distant ones only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right, far) = plt.subplots(1, 3, figsize=(16, 4.2))
    by_family: dict[str, list] = {}
    for r in rows:
        method = methods[r["method"]]
        if r["budget"] == "2%" and method.bits:
            by_family.setdefault(method.family, []).append((method.bits, r["recall@k"]))
        elif r["budget"] == "2%":
            left.axhline(r["recall@k"], ls="--", lw=1, label=r["method"], color=_COLOURS.get(method.family))
    for family, points in by_family.items():
        points.sort()
        left.plot([b for b, _ in points], [v for _, v in points], "o-", label=_FAMILY_LABELS[family],
                  color=_COLOURS.get(family))
    left.set_xscale("log", base=2)
    left.set(xlabel="code bits", ylabel="recall@k at the 2 % budget", title="Recall vs code length", ylim=(0, 1.02))
    left.legend(fontsize=7)
    for name, method in methods.items():
        if method.bits not in (None, 128) and not (method.family == "simhash" and method.bits == 640):
            continue
        for axis, key in ((right, "recall@k"), (far, FAR_COLUMN)):
            values = [(float(r["budget"].rstrip("%")), r[key]) for r in rows if r["method"] == name]
            axis.plot([b for b, _ in values], [v for _, v in values], marker="o", label=name,
                      ls=":" if method.bits == 640 else "-", color=_COLOURS.get(method.family))
    for axis, title in ((right, "Recall vs budget"), (far, f"Recall of top keys >= {FAR} tokens back")):
        axis.set_xscale("log")
        axis.set_xticks([1, 2, 5, 10], ["1", "2", "5", "10"])
        axis.set(xlabel="retrieved budget (% of cached tokens)", ylabel="recall@k", title=title, ylim=(0, 1.02))
    right.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


_FAMILY_LABELS = {"spotlight": "Spotlight (trained MLP)", "untrained": "Spotlight untrained", "simhash": "SimHash (random)",
                  "linear": "linear hash (trained)"}
_COLOURS = {"spotlight": "C0", "untrained": "C1", "simhash": "C2", "linear": "C3", "quest": "C4", "window": "gray",
            "oracle": "black"}


# ----------------------------------------------------------------------------- main


def main(argv=None):
    p = parser("quality", __doc__.splitlines()[0])
    p.add_argument("--part", default="retrieval,perplexity,needle,weights", help="comma-separated parts to run")
    p.add_argument("--model", default=None, metavar="NAME|PATH",
                   help=f"a packaged model's name or a model path (default: {SMALL_MODEL}; another model's run "
                        "has its own RESULTS.md section)")
    p.add_argument("--encoders", help="trained checkpoint (default: the shipped one for the model)")
    p.add_argument("--bits", type=int, default=128, help="bits of the shipped checkpoint to use (default 128)")
    p.add_argument("--ratio", type=float, help="retrieved share for perplexity and needles (default: SpotlightConfig)")
    p.add_argument("--k-min", type=int, help="retrieved tokens at least (default: SpotlightConfig)")
    p.add_argument("--dense-layers", help="comma-separated dense layers (default: SpotlightConfig)")
    p.add_argument("--sinks", type=int, help="first tokens every selection keeps (default: SpotlightConfig)")
    p.add_argument("--window", type=int, help="last tokens every selection keeps (default: SpotlightConfig)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's; 1 is faster on a busy CPU)")
    p.add_argument("--methods", help="comma-separated method names for perplexity and needles (default: dense and "
                                     "the main rivals), e.g. 'dense,Spotlight-128 trained'")
    p.add_argument("--needle-ratios", help="comma-separated extra budgets at which Spotlight also answers the needles "
                                           "(a budget sweep in one grid), e.g. 0.05,0.1")
    p.add_argument("--needle-lengths", help="comma-separated needle prompt lengths in tokens (default: 2048,4096,6144,8192; "
                                            "--quick: 2048)")
    p.add_argument("--needle-depths", help="comma-separated needle depths in (0, 1) (default: 0.1, 0.2, ... 0.9)")
    p.add_argument("--ppl-docs", type=int, metavar="N",
                   help=f"held-out essay windows for perplexity (default {FULL['ppl_docs']}; --quick: "
                        f"{QUICK['ppl_docs']}); each costs a prefill and {FULL['ppl_tokens']} decode steps per budget")
    args = p.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    sizes = dict(QUICK if args.quick else FULL)
    if args.needle_lengths:
        sizes["needle_lengths"] = tuple(int(x) for x in args.needle_lengths.split(","))
    if args.needle_depths:
        sizes["needle_depths"] = tuple(float(x) for x in args.needle_depths.split(","))
    if args.ppl_docs is not None:
        sizes["ppl_docs"] = args.ppl_docs
    parts = {s.strip() for s in args.part.split(",")}
    engine, trained = load(args, need_encoders=bool(parts - {"weights"}))
    config = spotlight_config(args)
    methods = build_methods(engine.args, trained, simhash_bits=sizes["simhash_bits"]) if trained else {}
    spot = next((n for n, m in methods.items() if m.family == "spotlight" and m.bits == trained.spec.bits), None)
    rows, targets, extra = [], [], []
    other = args.model not in (None, SMALL_MODEL)  # another model's run: its own section and plot
    section = f"quality-{Path(args.model).name}" if other else "quality"
    plot_path = PLOT.with_name(f"{section}-recall.png") if other else PLOT
    started = time.perf_counter()
    if "retrieval" in parts:
        summary_rows, layer_rows = retrieval_part(engine, methods, sizes, config)
        rows += summary_rows + layer_rows
        targets += retrieval_targets(summary_rows, spot)
        if not args.no_results:  # the plot belongs to the RESULTS.md section it is shown in
            plot(summary_rows, methods, plot_path)
            extra.append(f"![recall vs bits and vs budget]({plot_path.name})")
    if "perplexity" in parts:
        ppl_rows = perplexity_part(engine, chosen_methods(costly(methods, spot, args.quick, "perplexity"), args.methods),
                                   sizes, config, spot)
        rows += ppl_rows
        targets += perplexity_targets(ppl_rows, spot, config)
    if "needle" in parts:
        chosen = chosen_methods(costly(methods, spot, args.quick, "needle"), args.methods)
        for ratio in (float(x) for x in (args.needle_ratios or "").split(",") if x.strip()):
            chosen[f"{spot} @ {ratio:.0%}"] = (methods[spot], replace(config, ratio=ratio))
        needle_rows = needle_part(engine, chosen, sizes, config)
        rows += needle_rows + needle_summary(needle_rows)
        targets += needle_targets(needle_rows, spot, config)
    if "weights" in parts:
        weight_rows = weights_part(engine, sizes)
        rows += weight_rows
        for row in weight_rows[:-1]:  # the last row is fp32 itself
            targets.append(Target(f"perplexity change, {row['weights']} vs fp32 weights (abs(PPL / fp32 - 1))",
                                  row["PPL change vs fp32"], 0.001, higher_is_better=False))
    notes = notes_for(engine, trained, methods, config, sizes, time.perf_counter() - started)
    title = "Retrieval quality (Spotlight vs baselines)" + (f": {Path(args.model).name}" if other else "")
    finish(section, args, rows, targets, title=title, notes=notes, extra="\n\n".join(extra),
           command="quality" + (f" --model {args.model}" if other else "") + _given(args))


def _given(args) -> str:
    """The options of this run that change what it measures, as typed (for the section's command line)."""
    given = [("--part", args.part if args.part != "retrieval,perplexity,needle,weights" else None),
             ("--methods", args.methods), ("--needle-lengths", args.needle_lengths),
             ("--needle-depths", args.needle_depths), ("--ratio", args.ratio), ("--ppl-docs", args.ppl_docs)]
    return "".join(f" {flag} {value!r}" if " " in str(value) else f" {flag} {value}" for flag, value in given if value)


def chosen_methods(methods: dict, names: str | None) -> dict:
    """`methods` limited to the comma-separated `names` (all of them when None)."""
    if not names:
        return methods
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in methods]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {list(methods)}")
    return {n: methods[n] for n in wanted}


def costly(methods, spot, quick: bool, part: str) -> dict:
    """The methods of the slow parts (every token through the model): dense first, then the main rivals."""
    chosen = {"dense": None}
    for name, m in methods.items():
        if quick:
            keep = name == spot or m.family == "quest"
        else:
            keep = (m.bits in (None, 128) or (m.family == "simhash" and m.bits == 640)) and m.family != "oracle"
            keep = keep or (part == "perplexity" and m.family == "oracle")
            keep = keep and not (part == "needle" and m.family == "untrained")
        if keep:
            chosen[name] = m
    return chosen


def perplexity_windows(ids: list[int], sizes: dict) -> list[list[int]]:
    """`sizes["ppl_docs"]` windows of prefix + scored tokens + 1 from `ids`, after the text the
    retrieval part used; SystemExit saying how many fit when they do not."""
    need = sizes["ppl_prefix"] + sizes["ppl_tokens"] + 1
    skip = sizes["retrieval_docs"] * sizes["retrieval_len"]  # text the retrieval part did not use
    most = max((len(ids) - skip) // need, 0)
    if not 1 <= sizes["ppl_docs"] <= most:
        raise SystemExit(f"the essays hold {len(ids):,} tokens: room for {most} perplexity windows of {need:,} "
                         f"after the retrieval part's; ask for 1 to {most} (--ppl-docs)")
    return [ids[skip + i * need : skip + (i + 1) * need] for i in range(sizes["ppl_docs"])]


def perplexity_part(engine, methods, sizes, config, spot):
    """Every method at the configured budget; Spotlight and the oracle also at the other budgets."""
    import math

    ids = essay_ids(engine)
    docs = perplexity_windows(ids, sizes)
    runs = {(name, config.ratio): (method, config) for name, method in methods.items()}
    for budget in sizes["ppl_budgets"]:
        for name, method in methods.items():
            if (name == spot or (method and method.family == "oracle")) and budget != config.ratio:
                runs[(name, budget)] = (method, replace(config, ratio=budget))
    per_doc: list[dict] = []
    nll = perplexity(engine.model, docs, sizes["ppl_prefix"], runs, per_doc)
    dense = ("dense", config.ratio)

    def spread(run) -> str:  # PPL / dense of the lowest and the highest window: how much one window moves it
        ratios = sorted(math.exp(doc[run] - doc[dense]) for doc in per_doc)
        return f"{ratios[0]:.4f}-{ratios[-1]:.4f}"

    return [{"part": "perplexity through the decode path", "method": name,
             "budget": "—" if name == "dense" else f"{budget:.0%}", "NLL": value, "PPL": math.exp(value),
             "PPL / dense": f"{math.exp(value - nll[dense]):.4f}", "per window": spread((name, budget))}
            for (name, budget), value in nll.items()]


def weights_part(engine, sizes) -> list[dict]:
    """Dense NLL through the decode path with `engine`'s weights and activations, with the
    quantized weights' other activations (kernels.quant.ACTIVATIONS) and with the same model's
    fp32 copy (EngineConfig(weights="fp32")), each a second engine, on the same held-out essay text."""
    import math

    from spotlight.config import ACTIVATIONS, SpotlightConfig, default_home
    from spotlight.engine import Engine

    label = {a: f"quantized, {a} activations" for a in ACTIVATIONS}
    engines = {label[engine.config.activations]: engine}
    for other in ACTIVATIONS:
        if other != engine.config.activations:
            engines[label[other]] = Engine.load(replace(engine.config, activations=other), default_home())
    engines["fp32"] = Engine.load(replace(engine.config, weights="fp32"), default_home())
    ids = essay_ids(engine)
    doc = ids[-(sizes["weights_prefix"] + sizes["weights_tokens"] + 1):]  # the end: unused by the other parts
    runs = {"dense": (None, SpotlightConfig())}
    nll = {name: perplexity(e.model, [doc], sizes["weights_prefix"], runs)["dense"] for name, e in engines.items()}
    return [{"part": "perplexity: quantized vs fp32 weights", "weights": name, "tokens": sizes["weights_tokens"],
             "NLL": value, "PPL": math.exp(value), "PPL / fp32": math.exp(value - nll["fp32"]),
             "PPL change vs fp32": abs(math.expm1(value - nll["fp32"]))}
            for name, value in nll.items()]


def needle_part(engine, methods, sizes, config):
    grid = needle_grid(engine, sizes["needle_lengths"], sizes["needle_depths"], methods, config, sizes["new_tokens"], log)
    return [{"part": "needle in a haystack (found: the answer holds 7481)", **r} for r in grid]


def needle_summary(rows) -> list[dict]:
    out = []
    for name in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == name]
        dense = {(r["length"], r["depth"]): r["found"] for r in rows if r["method"] == "dense"}
        out.append({"part": "needles found", "method": name, "found": sum(r["found"] for r in mine),
                    "of": len(mine), "missed where dense found": sum(
                        1 for r in mine if dense[(r["length"], r["depth"])] and not r["found"])})
    return out


# ----------------------------------------------------------------------------- targets


def retrieval_targets(rows, spot):
    def cell(method, key, budget="2%"):
        return next(r[key] for r in rows if r["method"] == method and r["budget"] == budget)

    targets = [Target(f"{spot}: recall@k at the 2 % budget", cell(spot, "recall@k"), 0.75),
               Target(f"{spot}: attention-mass recall at the 2 % budget", cell(spot, "mass recall"), 0.90)]
    simhash = "SimHash-640"
    if any(r["method"] == simhash for r in rows):
        targets.append(Target(f"{spot} recall@k / {simhash} recall@k at 2 %",
                              cell(spot, "recall@k") / max(cell(simhash, "recall@k"), 1e-9), 1.0))
    return targets


def perplexity_targets(rows, spot, config):
    ratio = float(next(r["PPL / dense"] for r in rows if r["method"] == spot and r["budget"] == f"{config.ratio:.0%}"))
    return [Target(f"{spot}: perplexity through the decode path / dense at the {config.ratio:.0%} budget", ratio, 1.01,
                   higher_is_better=False)]


def needle_targets(rows, spot, config):
    found = {(r["length"], r["depth"], r["method"]): r["found"] for r in rows}
    probes = {(r["length"], r["depth"]) for r in rows}
    missed = sum(1 for probe in probes if found[(*probe, "dense")] and not found[(*probe, spot)])
    return [Target(f"needles dense attention finds that {spot} misses at the {config.ratio:.0%} budget", missed, 0,
                   higher_is_better=False)]


def training_of(encoders) -> str:
    """What trained a checkpoint, from its provenance: steps, tokens, windows and the ranked keys."""
    p = encoders.provenance
    c = p.get("config", {})
    return (f"{p.get('steps', '?')} steps on {p.get('tokens', '?')} tokens of {p.get('corpus', '?')}: "
            f"{c.get('sequences', '?')} windows of {c.get('seq_len', '?')} tokens, keys before a "
            f"{c.get('window', '?')}-token window ranked, top keys drawn ~ distance^"
            f"{c.get('top_distance_power', 0)}")


def notes_for(engine, trained, methods, config, sizes, seconds) -> str:
    linear = [f"{name}: {training_of(m.selector.encoders)}" for name, m in methods.items() if m.family == "linear"]
    encoders = "no encoders (only the weights part ran)" if trained is None else (
        f"trained encoders {trained.spec.bits} bits, depth {trained.spec.depth}, width {trained.spec.width}, "
        f"checkpoint {trained.fingerprint} ({training_of(trained)}){''.join(f'; {x}' for x in linear)}")
    return (
        f"Model {engine.source.origin} (fingerprint {engine.fingerprint}); {encoders}. "
        f"Budget accounting for every method: {config.sinks} sinks + {config.window}-token window + retrieved; dense "
        f"layers {list(config.dense_layers)}. Retrieval: {sizes['retrieval_docs']} held-out essay windows of "
        f"{sizes['retrieval_len']} tokens, the last {sizes['decode_steps']} decoded one at a time; retrieved = "
        f"int(budget * n). Perplexity: {sizes['ppl_docs']} held-out essay windows after those, each "
        f"{sizes['ppl_tokens']} tokens predicted by decode steps after a {sizes['ppl_prefix']}-token prefill (per "
        f"window: PPL / dense of the lowest and highest window). Perplexity and needles at ratio {config.ratio:.0%} "
        f"(k_min {config.k_min}), "
        f"dense_below 0 (sparse at every length). Untrained and SimHash encoders use hyperplanes shared by a query "
        f"head and its KV head (spotlight.train.tie_hyperplanes). Run time {seconds / 60:.1f} min."
    )


if __name__ == "__main__":
    main()
