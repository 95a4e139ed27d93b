"""The draft recipe's budget curve: measured MT-bench tau against training tokens, a log-linear fit,
and the tokens and CPU hours the fit says a tau target needs.

    python studies/tau-budget-curve/tau_curve.py --point LABEL TOKENS TRAIN_S T0.json T1.json [--point ...]
                                --train-rate TOK_S --store-rate TOK_S --out studies/tau-budget-curve/tau_curve.md

Each point is one run trained to its own budget (its schedule annealed at TOKENS), measured with
scripts/measure_tau.py at both temperatures on the same workload. The fit is tau = a + b ln(tokens)
per temperature (least squares over the points); it is a crude extrapolation and the report says
how far out it reaches. CPU hours: training tokens at --train-rate (TTT from the feature store)
plus the store for the unique tokens at --store-rate (one target forward per token), given as a
range because the unique-token count depends on how many epochs the data is reused.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path
from typing import NamedTuple


class Point(NamedTuple):
    label: str
    tokens: int
    train_s: float
    tau: dict[float, float]        # temperature -> tau
    workload: str


def read_tau(path: Path) -> tuple[dict[float, float], str]:
    doc = json.loads(path.read_text())
    taus = {float(r["temperature"]): float(r["tau"]) for r in doc["results"]}
    r0 = doc["results"][0]
    return taus, f"{r0['prompts']} x {doc['max_new_tokens']}, {doc['spec']}"


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise SystemExit("the points need at least two different token counts")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def tokens_for(tau: float, a: float, b: float) -> float:
    return math.exp((tau - a) / b) if b > 0 else math.inf


def report(points: list[Point], targets: dict[float, float], train_rate: float, store_rate: float,
           epochs: float, command: str = "") -> str:
    temps = sorted({t for p in points for t in p.tau})
    lines = ["# Budget curve of the best recipe (k) on MT-bench", "",
             *([f"`{command}`", ""] if command else []),
             f"Workload: {points[0].workload} (EAGLE only, no suffix candidates). Each row is a run "
             "trained to its own token budget (its schedule ends there).", "",
             "| run | training tokens | training s | " + " | ".join(f"tau T={t:g}" for t in temps) + " |",
             "|---|---|---|" + "---|" * len(temps)]
    for p in sorted(points, key=lambda p: p.tokens):
        lines.append(f"| {p.label} | {p.tokens:,} | {p.train_s:,.0f} | "
                     + " | ".join(f"{p.tau.get(t, float('nan')):.3f}" for t in temps) + " |")
    lines += ["", "Fit tau = a + b ln(tokens), least squares over the rows above:", "",
              "| T | a | b (tau per e-fold of tokens) | target | tokens the fit says | x the largest run "
              "| training CPU h | + store CPU h (unique tokens = tokens / epochs) |",
              "|---|---|---|---|---|---|---|---|"]
    top = max(p.tokens for p in points)
    for t in temps:
        pts = [p for p in points if t in p.tau]
        a, b = fit([math.log(p.tokens) for p in pts], [p.tau[t] for p in pts])
        goal = targets.get(t)
        if goal is None:
            continue
        need = tokens_for(goal, a, b)
        train_h = need / train_rate / 3600
        store_h = need / epochs / store_rate / 3600
        lines.append(f"| {t:g} | {a:.3f} | {b:.3f} | {goal} | {need:,.3g} | {need / top:,.0f}x | "
                     f"{train_h:,.0f} | {store_h:,.0f} ({epochs:g} epochs) |")
    lines += ["", f"Rates: training {train_rate:g} tokens/s (TTT from the store, 2 cores), store "
              f"{store_rate:g} tokens/s (target forward with capture, 2 cores).",
              "The fit extrapolates far beyond the measured range (the right column): read it as an "
              "order of magnitude, not a forecast."]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", nargs=5, action="append", required=True,
                    metavar=("LABEL", "TOKENS", "TRAIN_S", "T0_JSON", "T1_JSON"))
    ap.add_argument("--target", nargs=2, action="append", type=float, metavar=("T", "TAU"),
                    help="tau targets per temperature (default: the issue's bars 2.3 at T=0, 1.7 at T=1)")
    ap.add_argument("--train-rate", type=float, required=True)
    ap.add_argument("--store-rate", type=float, required=True)
    ap.add_argument("--epochs", type=float, default=4.0, help="reuse of each unique token")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    points, first = [], None
    for label, tokens, train_s, f0, f1 in args.point:
        t0, workload = read_tau(Path(f0))
        t1, workload1 = read_tau(Path(f1))
        first = first or (f0, workload)
        for path, w in ((f0, workload), (f1, workload1)):
            if w != first[1]:      # one curve, one workload: a point measured otherwise would bend the fit
                raise SystemExit(f"{path}: workload {w!r} != {first[1]!r} of {first[0]}; measure every "
                                 "point with the same scripts/measure_tau.py --n/--max-new-tokens/--tree")
        if set(t0) & set(t1):
            raise SystemExit(f"{f0} and {f1} both hold temperature(s) {sorted(set(t0) & set(t1))}; "
                             "give each point its T=0 file, then its T=1 file")
        points.append(Point(label, int(float(tokens)), float(train_s), {**t0, **t1}, workload))
    targets = dict(args.target) if args.target else {0.0: 2.3, 1.0: 1.7}
    command = "python studies/tau-budget-curve/tau_curve.py " + " ".join(shlex.quote(a) for a in argv)
    text = report(points, targets, args.train_rate, args.store_rate, args.epochs, command)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
