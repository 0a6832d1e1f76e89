"""The report's figures (matplotlib, Agg backend, PNG). Each function takes plain data — lists of numbers per
run group, a colour per group — draws one figure, writes it to `path` and returns the path, or returns None when
there is nothing to draw (the report then says why in words).

Colours are fixed per group across all figures (`palette`), so a run has one colour in the whole report.

Run labels are dir names, drawn as given: every text holding one is drawn with parse_math=False (a `$...$` pair
in a dir name is not TeX: mathtext would render it, or fail the whole figure on a bad expression), and legends
are built from explicit (handle, label) entries (`legend`), because matplotlib leaves out of a legend every
artist whose label starts with `_` (a dir named `_scratch` would vanish).
"""
from __future__ import annotations

import math
from typing import Optional

from nagmoe.base.files import atomic_writer

DPI = 110


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # no display: files only (Slurm jobs, CI)
    import matplotlib.pyplot as plt

    return plt


def palette(groups: list) -> dict:
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
               "#bcbd22", "#17becf"]
    return {g: colours[i % len(colours)] for i, g in enumerate(groups)}


def _save(fig, path: str) -> str:
    """PNG through a fresh temporary, renamed (nagmoe.base.files): savefig(path) would follow a planted link."""
    fig.tight_layout()
    try:
        with atomic_writer(path, binary=True) as f:
            fig.savefig(f, dpi=DPI, format="png")
    finally:
        _plt().close(fig)
    return path


def legend(ax, entries: list, **kwargs):
    """A legend of `entries` [(artist, label)] exactly as given: explicit handles and labels (so a label starting
    with `_` is shown), each label drawn without mathtext. Returns the Legend (None without entries)."""
    if not entries:
        return None
    handles, labels = zip(*entries)
    drawn = ax.legend(list(handles), [str(label) for label in labels], **kwargs)
    for text in drawn.get_texts():
        text.set_parse_math(False)
    return drawn


def smooth(values: list, span: Optional[int] = None) -> list:
    """Exponential moving average with a span of ~5% of the points (at least 1): the noisy per-step training
    loss as a readable line. `span` = 1 returns the values."""
    span = span or max(1, len(values) // 20)
    alpha = 2.0 / (span + 1)
    out, avg = [], None
    for v in values:
        avg = v if avg is None else alpha * v + (1 - alpha) * avg
        out.append(avg)
    return out


def loss_curves(curves: dict, colours: dict, path: str) -> Optional[str]:
    """Training loss vs cumulative training FLOPs and vs tokens. `curves`: {group: [(flops, tokens, loss) lists per
    seed]}; seeds of one group share its colour."""
    if not any(len(seed[2]) for seeds in curves.values() for seed in seeds):
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    entries = []
    for group, seeds in curves.items():
        for i, (flops, tokens, loss) in enumerate(seeds):
            if not loss:
                continue
            y = smooth(loss)
            line, = axes[0].plot(flops, y, color=colours[group], lw=1.4, alpha=0.9)
            axes[1].plot(tokens, y, color=colours[group], lw=1.4, alpha=0.9)
            if not any(label == group for _, label in entries):  # one entry per group (its seeds share a colour)
                entries.append((line, group))
    for ax, xlabel in zip(axes, ("training FLOPs", "tokens")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("training loss (nats/token, smoothed)")
        ax.grid(alpha=0.3)
        _clip_start(ax, curves)
    axes[0].set_title("loss vs FLOPs (the matched quantity)")
    axes[1].set_title("loss vs tokens seen")
    legend(axes[0], entries, fontsize=8)
    return _save(fig, path)


def _clip_start(ax, curves: dict) -> None:
    """Start the y axis below the early, very high losses so the endgame is readable."""
    finals = [seed[2][-1] for seeds in curves.values() for seed in seeds if seed[2]]
    starts = [max(seed[2][: max(1, len(seed[2]) // 10)]) for seeds in curves.values() for seed in seeds if seed[2]]
    if finals and starts:
        low, high = min(finals), max(starts)
        ax.set_ylim(low - 0.1 * (high - low) - 0.05, high + 0.05)


def val_bpb_points(points: dict, colours: dict, path: str, unigram: Optional[float] = None) -> Optional[str]:
    """Validation bpb at the eval steps vs training FLOPs; `points`: {group: [(flops, bpb) lists per seed]}."""
    if not any(seed for seeds in points.values() for seed in seeds):
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    entries = []
    for group, seeds in points.items():
        for seed in seeds:
            if seed:
                xs, ys = zip(*seed)
                line, = ax.plot(xs, ys, "o-", color=colours[group], ms=4, lw=1)
                if not any(label == group for _, label in entries):
                    entries.append((line, group))
    if unigram is not None:
        entries.append((ax.axhline(unigram, color="k", ls="--", lw=1), f"unigram {unigram:.3f}"))
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("validation bits per byte")
    ax.set_title("validation bpb (lower is better)")
    ax.grid(alpha=0.3)
    legend(ax, entries, fontsize=8)
    return _save(fig, path)


def depth_panels(depth: dict, colours: dict, path: str) -> Optional[str]:
    """Baseline and NAG side by side through depth, one line per run group (its first analysed seed):
    residual norm, cumulative rotation, attention on BOS per layer, NAG gate gain per sublayer.
    `depth`: {group: {"norm": [...], "rotation": [...], "bos": [...], "gain": [...] or None, "kind": str}}."""
    if not depth:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    entries = []
    for group, d in depth.items():
        c = colours[group]
        if d.get("norm"):
            line, = axes[0].plot(range(len(d["norm"])), d["norm"], "o-", ms=3, color=c)
            entries.append((line, f"{group} ({d['kind']})"))
        if d.get("rotation"):
            axes[1].plot(range(len(d["rotation"])), d["rotation"], "o-", ms=3, color=c)
        bos = [v if v is not None else math.nan for v in (d.get("bos") or [])]
        if bos:
            axes[2].plot(range(len(bos)), bos, "o-", ms=3, color=c)
        if d.get("gain"):
            axes[3].plot(range(len(d["gain"])), d["gain"], "o-", ms=3, color=c)
    axes[0].set_yscale("log")
    titles = ("residual norm through depth", "cumulative rotation (rad)", "attention mass on BOS (key 0)",
              "NAG realised gain |alpha m| per sublayer")
    xlabels = ("sublayer (0 = embedding)", "sublayer (0 = embedding)", "layer", "sublayer")
    for ax, title, xlabel in zip(axes, titles, xlabels):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[2].axhline(0.5, color="k", ls=":", lw=1)
    axes[2].set_ylim(0, 1)
    if not any(d.get("gain") for d in depth.values()):
        axes[3].text(0.5, 0.5, "no NAG run", ha="center", va="center", transform=axes[3].transAxes)
    legend(axes[0], entries, fontsize=7)
    return _save(fig, path)


def router_load_heatmaps(loads: dict, path: str) -> Optional[str]:
    """One heatmap per run group: the fraction of routing slots each expert (x) of each MoE layer (y) received
    on the analysed validation tokens (1/E everywhere = balanced). `loads`: {group: L x E list}."""
    if not loads:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(loads), figsize=(4.2 * len(loads), 3.8), squeeze=False)
    for ax, (group, load) in zip(axes[0], loads.items()):
        image = ax.imshow(load, aspect="auto", cmap="viridis", vmin=0.0)
        ax.set_title(f"{group}: router load (1/E = {1 / max(1, len(load[0])):.3f})", fontsize=9, parse_math=False)
        ax.set_xlabel("expert")
        ax.set_ylabel("MoE layer")
        fig.colorbar(image, ax=ax, fraction=0.046)
    return _save(fig, path)


def skip_through_depth(skips: dict, path: str) -> Optional[str]:
    """MoD's realised skip per sublayer through depth, attention and FFN side by side, one panel per run group
    (training, skipping steps only). `skips`: {group: [skip of sublayer 0, 1, ...]} (2 per block)."""
    skips = {g: s for g, s in skips.items() if s}
    if not skips:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(skips), figsize=(5.2 * len(skips), 3.6), squeeze=False)
    for ax, (group, skip) in zip(axes[0], skips.items()):
        blocks = list(range(len(skip) // 2))
        bars = (ax.bar([b - 0.2 for b in blocks], skip[0::2], width=0.4),
                ax.bar([b + 0.2 for b in blocks], skip[1::2], width=0.4))
        ax.set_title(f"{group}: skipped token share per sublayer", fontsize=9, parse_math=False)
        ax.set_xlabel("block")
        ax.set_ylabel("skipped share (training)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3, axis="y")
        legend(ax, list(zip(bars, ("attention", "FFN / MoE"))), fontsize=8)
    return _save(fig, path)


def confidence_panels(bins: dict, colours: dict, path: str) -> Optional[str]:
    """NAG's final log-norm as a confidence signal: mean loss and top-1 accuracy per equal-count bin.
    `bins`: {group: [{"mean", "loss", "top1_acc"}, ...]}."""
    bins = {g: b for g, b in bins.items() if b}
    if not bins:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    entries = []
    for group, rows in bins.items():
        x = [r["mean"] for r in rows]
        entries.append((axes[0].plot(x, [r["loss"] for r in rows], "o-", ms=3, color=colours[group])[0], group))
        axes[1].plot(x, [r["top1_acc"] for r in rows], "o-", ms=3, color=colours[group])
    for ax, ylabel in zip(axes, ("mean loss (nats)", "top-1 accuracy")):
        ax.set_xlabel("final log-norm s (bin mean)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].set_title("loss by final norm (NAG)", fontsize=10)
    axes[1].set_title("top-1 accuracy by final norm (NAG)", fontsize=10)
    legend(axes[0], entries, fontsize=8)
    return _save(fig, path)


def compute_dial(dials: dict, colours: dict, path: str, full_depth: Optional[dict] = None) -> Optional[str]:
    """Post-training compute dial of MoD runs: validation bpb vs forward FLOPs per token relative to full depth,
    one point per inference skip rate. `dials`: {group: [{"skip_rate", "flops_vs_full_depth", "val_bpb"}]};
    `full_depth`: {group: bpb} of full-depth runs, drawn at x = 1 for reference."""
    dials = {g: [r for r in rows if r.get("val_bpb") is not None] for g, rows in dials.items()}
    dials = {g: rows for g, rows in dials.items() if rows}
    if not dials:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    entries = []
    for group, rows in dials.items():
        xs = [r["flops_vs_full_depth"] for r in rows]
        ys = [r["val_bpb"] for r in rows]
        entries.append((ax.plot(xs, ys, "o-", color=colours[group])[0], f"{group} (MoD, dial)"))
        for r, x, y in zip(rows, xs, ys):
            ax.annotate(f"{r['skip_rate']:.0%}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for group, bpb in (full_depth or {}).items():
        if bpb is not None:
            entries.append((ax.plot([1.0], [bpb], "s", color=colours[group])[0], f"{group} (full depth)"))
    ax.set_xlabel("forward FLOPs per token / full depth")
    ax.set_ylabel("validation bits per byte")
    ax.set_title("compute dial: skip rate chosen after training", fontsize=10)
    ax.grid(alpha=0.3)
    legend(ax, entries, fontsize=8)
    return _save(fig, path)


def paired_differences(rows: list, path: str) -> Optional[str]:
    """Each pair's bpb difference (variant - reference) with its two intervals: the eval windows' 95% interval
    (thick) and the seeds' two standard errors (thin, when measured). `rows`: [(label, diff, [lo, hi] or None,
    seed half-width or None)]."""
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 1.3 + 0.55 * len(rows)))
    entries = []
    for i, (label, diff, ci, seed_half) in enumerate(rows):
        y = len(rows) - 1 - i
        if seed_half is not None:
            line = ax.errorbar([diff], [y + 0.12], xerr=[[seed_half], [seed_half]], fmt="none", ecolor="#888",
                               elinewidth=1.2, capsize=4)
            if not any(lab == "seeds: 2 standard errors" for _, lab in entries):
                entries.append((line, "seeds: 2 standard errors"))
        if ci is not None:
            line = ax.errorbar([diff], [y], xerr=[[diff - ci[0]], [ci[1] - diff]], fmt="o", color="#1f77b4",
                               elinewidth=3, capsize=0)
            if not any(lab == "eval windows: 95% interval" for _, lab in entries):
                entries.append((line, "eval windows: 95% interval"))
        else:
            ax.plot([diff], [y], "o", color="#1f77b4")
    ax.axvline(0.0, color="#444", linewidth=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for label, *_ in reversed(rows)])
    for text in ax.get_yticklabels():
        text.set_parse_math(False)
    ax.set_xlabel("val bpb difference (variant - reference; < 0: variant ahead)")
    ax.set_ylim(-0.6, len(rows) - 0.4)
    legend(ax, entries, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=2)  # below: no bar hidden
    return _save(fig, path)
