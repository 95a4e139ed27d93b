"""Summary rows, the printed table, the JSON file and the PNG plots of a bench run."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from .stats import (Identity, Record, Spread, acceptance_per_position, greedy_identity, ratios,
                    tau_pooled)

VS = ("hf-generate", "hf-generate-bf16", "ours-plain", "llama.cpp", "llama.cpp-native",
      "llama.cpp-eagle3", "vllm-plain")                               # ratio columns, if present
CHILD_PROCESS = ("llama.cpp-native", "llama.cpp-eagle3", "vllm-plain", "vllm-eagle3")   # own process


@dataclass(frozen=True)
class Row:
    system: str
    temperature: float
    device: str
    prompts: int
    tokens_per_s: Spread                       # per-prompt tokens/s
    aggregate_tokens_per_s: float              # all tokens / all seconds
    speedup: dict[str, Optional[Spread]]       # baseline -> per-prompt ratio spread
    tau: Optional[float]
    acceptance: Optional[list[float]]          # per draft position (ours)
    split: Optional[dict[str, float]]          # fractions of wall time: draft / verify / other
    peak_rss_mb: Optional[float]               # process (or child process) peak during its runs
    own_mb: Optional[float]                    # what the system added: its group's load delta,
    peak_gpu_mb: Optional[float]               # or the whole child process for the EAGLE-3 binary


def time_split(recs: list[Record]) -> Optional[dict[str, float]]:
    if any(r.draft_s is None for r in recs):
        return None
    total = sum(r.seconds for r in recs) or 1.0
    return {"draft": sum(r.draft_s for r in recs) / total,
            "verify": sum(r.verify_s for r in recs) / total,
            "other": sum(r.other_s for r in recs) / total}


def tau_of(recs: list[Record]) -> Optional[float]:
    pooled = tau_pooled(recs)
    if pooled is not None:
        return pooled
    taus = [r.tau for r in recs if r.tau is not None]
    return sum(taus) / len(taus) if taus else None


def make_row(records: list[Record], system: str, temp: float, depth: Optional[int],
             peaks: dict) -> Row:
    recs = [r for r in records if r.system == system and r.temperature == temp]
    present = {r.system for r in records}
    speedup = {b: Spread.of(ratios(records, system, b, temp)) for b in VS
               if b in present and b != system}
    secs = sum(r.seconds for r in recs)
    child = peaks.get("child_rss", {}).get(system)
    rss = child or peaks.get("rss", {}).get(system)
    load_mb = peaks.get("load_mb", {}).get(recs[0].family)
    own = child if system in CHILD_PROCESS else load_mb * 2**20 if load_mb else None
    gpu = peaks.get("gpu", {}).get(system)
    return Row(system, temp, recs[0].device, len(recs), Spread.of([r.tokens_per_s for r in recs]),
               sum(r.new_tokens for r in recs) / secs if secs else 0.0, speedup, tau_of(recs),
               acceptance_per_position(recs, depth) if depth and recs[0].accept_lens is not None
               else None, time_split(recs), rss / 2**20 if rss else None,
               own / 2**20 if own else None, gpu / 2**20 if gpu else None)


def summarize(records: list[Record], depths: dict[str, int], peaks: dict) -> list[Row]:
    systems = list(dict.fromkeys(r.system for r in records))
    temps = sorted({r.temperature for r in records})
    return [make_row(records, s, t, depths.get(s), peaks) for t in temps for s in systems
            if any(r.system == s and r.temperature == t for r in records)]


def identities(records: list[Record]) -> list[Identity]:
    """Greedy token identity: each of our speculative systems vs ours-plain (must hold), and
    ours-plain vs HF generate / llama.cpp / vLLM, vLLM's EAGLE-3 vs its plain decoding
    (informational: other kernels, other numerics)."""
    spec = [s for s in dict.fromkeys(r.system for r in records)
            if s.startswith("ours-") and s != "ours-plain"]
    pairs = [(s, "ours-plain") for s in spec] + [("hf-generate", "ours-plain"),
                                                 ("llama.cpp", "ours-plain"), ("vllm-plain", "ours-plain"),
                                                 ("vllm-eagle3", "vllm-plain")]
    return [i for i in (greedy_identity(records, a, b) for a, b in pairs) if i is not None]


# ---------------------------------------------------------------------------- text
def fmt(x: Optional[float], spec: str = "{:.2f}") -> str:
    return "-" if x is None else spec.format(x)


def table(rows: list[Row]) -> str:
    cols = [b for b in VS if any(b in r.speedup for r in rows)]
    head = (f"{'system':<24} {'T':>3} {'n':>3} {'tok/s med [IQR]':>22} {'agg':>6} "
            + " ".join(f"{'x ' + b:>20}" for b in cols)
            + f" {'tau':>5} {'draft/verify/other':>18} {'peak MB':>7} {'own MB':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        sp = " ".join(f"{r.speedup[b].text() if r.speedup.get(b) else '-':>20}" for b in cols)
        split = "/".join(f"{100 * r.split[k]:.0f}" for k in ("draft", "verify", "other")) \
            if r.split else "-"
        lines.append(f"{r.system:<24} {r.temperature:>3g} {r.prompts:>3} "
                     f"{r.tokens_per_s.text('{:.1f}'):>22} {r.aggregate_tokens_per_s:>6.1f} {sp} "
                     f"{fmt(r.tau):>5} {split + ' %' if r.split else '-':>18} "
                     f"{fmt(r.peak_rss_mb, '{:.0f}'):>7} {fmt(r.own_mb, '{:.0f}'):>6}")
    return "\n".join(lines)


def acceptance_text(rows: list[Row]) -> str:
    lines = []
    for r in rows:
        if r.acceptance:
            pos = " ".join(f"{a:.2f}" for a in r.acceptance)
            lines.append(f"  {r.system:<20} T={r.temperature:g}: {pos}")
    return "acceptance per draft position (share of steps accepting >= k tokens):\n" + "\n".join(lines) \
        if lines else ""


def identity_text(ids: list[Identity]) -> str:
    lines = ["greedy outputs, token for token:"]
    for i in ids:
        div = ", ".join(f"q{q}@{at}" for q, at in i.divergences[:8])
        note = "" if i.system.startswith("ours-") else "  [informational: other kernels]"
        lines.append(f"  {i.system:<20} vs {i.reference:<11} identical on {i.identical}/{i.compared}"
                     + (f"  (first divergence: {div})" if div else "") + note)
    return "\n".join(lines)


SPENT_KINDS = ("plain", "suffix", "tree", "chain", "probe", "catch-up")


def policy_time_text(records: list[Record]) -> str:
    """The adaptive step's own accounting per system and temperature: the share of its decode time
    in plain, suffix-only, tree and chain steps, probes (first tries included) and the draft's
    catch-ups, so a loss against plain decoding shows where it was spent."""
    lines = []
    for key in sorted({(r.system, r.temperature) for r in records if "spent_ms" in r.extra}):
        spent = {k: sum(r.extra.get("spent_ms", {}).get(k, 0.0) for r in records
                        if (r.system, r.temperature) == key) for k in SPENT_KINDS}
        total = sum(spent.values()) or 1.0
        parts = " ".join(f"{k} {100 * v / total:.1f}%" for k, v in spent.items())
        lines.append(f"  {key[0]:<20} T={key[1]:g}: {parts} of {total / 1e3:.1f} s")
    return "policy time (decode steps):\n" + "\n".join(lines) if lines else ""


def tree_vs_chain_text(rows: list[Row], records: list[Record]) -> str:
    """What the tree buys over the chain with the same draft: tau and per-prompt tokens/s ratio."""
    lines = []
    for t in sorted({r.temperature for r in rows}):
        chain = next((r for r in rows if r.temperature == t and r.system.startswith("ours-chain")), None)
        tree = next((r for r in rows if r.temperature == t and r.system.startswith("ours-tree")), None)
        if chain and tree:
            ratio = Spread.of(ratios(records, tree.system, chain.system, t))
            lines.append(f"  T={t:g}: tau {fmt(chain.tau)} -> {fmt(tree.tau)}, tokens/s x"
                         f"{ratio.text() if ratio else '-'} ({tree.system} / {chain.system})")
    return "tree vs chain (same draft):\n" + "\n".join(lines) if lines else ""


# ---------------------------------------------------------------------------- files
def to_jsonable(x):
    if hasattr(x, "__dataclass_fields__"):
        return to_jsonable(asdict(x))
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    return x


def save_json(path: Path, meta: dict, rows: list[Row], records: list[Record],
              ids: list[Identity], extra: dict) -> None:
    doc = {"meta": meta, "summary": to_jsonable(rows), "identity": to_jsonable(ids),
           **to_jsonable(extra), "records": [r.to_json() for r in records]}
    path.write_text(json.dumps(doc, indent=1) + "\n")


def save_plots(out_dir: Path, rows: list[Row], records: list[Record]) -> list[Path]:
    """speedup per system (box plot over prompts), acceptance per position, tau histogram."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    temps = sorted({r.temperature for r in rows})
    base = "hf-generate" if any(r.system == "hf-generate" for r in rows) else "ours-plain"
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        names = [r.system for r in rows if r.temperature == t and r.system != base]
        data = [ratios(records, s, base, t) for s in names]
        keep = [(n, d) for n, d in zip(names, data) if d]
        if keep:
            _hbox(ax, [d for _, d in keep], [n for n, _ in keep])
        ax.axvline(1.0, color="grey", lw=0.8)
        ax.set_title(f"tokens/s vs {base}, per prompt (T={t:g})")
        ax.set_xlabel("speedup")
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "speedup.png"))
    if any(r.acceptance for r in rows):
        paths.append(_acceptance_plot(plt, rows, out_dir / "acceptance.png"))
    if any(r.tau is not None for r in records):
        paths.append(_tau_plot(plt, records, temps, out_dir / "tau_hist.png"))
    return paths


def _hbox(ax, data: list[list[float]], labels: list[str]) -> None:
    try:
        ax.boxplot(data, tick_labels=labels, orientation="horizontal")   # matplotlib >= 3.10
    except TypeError:
        ax.boxplot(data, labels=labels, vert=False)


def _acceptance_plot(plt, rows: list[Row], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if r.acceptance:
            ax.plot(range(1, len(r.acceptance) + 1), r.acceptance, marker="o",
                    label=f"{r.system} T={r.temperature:g}")
    ax.set(xlabel="draft position k", ylabel="share of steps accepting >= k", ylim=(0, 1),
           title="acceptance per draft position")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _tau_plot(plt, records: list[Record], temps: list[float], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    every = [r.tau for r in records if r.tau is not None]
    lo, hi = min(every), max(every)
    bins = [lo + (hi - lo + 1e-9) * i / 20 for i in range(21)]          # shared by every series
    for name in dict.fromkeys(r.system for r in records if r.tau is not None):
        for t in temps:
            taus = [r.tau for r in records if r.system == name and r.temperature == t and r.tau]
            if taus:
                ax.hist(taus, bins=bins, histtype="step", lw=1.5, label=f"{name} T={t:g}")
    ax.set(xlabel="tau (tokens per target forward, per prompt)", ylabel="prompts",
           title="tau per prompt")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
