"""`write_report(run_dirs, out_dir)`: the comparison report of a set of runs, as one self-contained HTML page.

OUT/report.html embeds its PNG figures (base64; each also links its file under OUT/figures/), OUT/report.json
holds the numbers, OUT/data/ caches each run's analysis and eval (reused while its latest checkpoint is the
same). Sections (HTML ids): overview, problems, results (final val bpb, eval score, seed spread, unigram),
curves (loss vs FLOPs and vs tokens, val bpb), comparisons (pairs with the noise verdict), depth (baseline vs
NAG through depth: norm, rotation, BOS sink, gates; confidence), mod (MoD vs full depth), dial (compute dial),
references (the paper's and the reimplementation's numbers, labelled as theirs, beside ours), runs
(provenance). Every section renders — with a sentence saying why it is empty — from any set of runs, one
included; a run dir that cannot be used is named under "problems" and the others still render.
"""
from __future__ import annotations

import base64
import html
import json
import os
import re
import time
from typing import Callable, Optional

from nagmoe.analysis import figures as fig
from nagmoe.analysis.references import THEIRS
from nagmoe.analysis.report_balance import HEADERS, NOTE as BALANCE_NOTE, balance_rows
from nagmoe.analysis.report_data import (FINAL_LOSS_WINDOW, find_pairs, group_records, mean_sd, measure_checkpoint,
                                         problem_text, read_run, unique_labels)
from nagmoe.analysis.report_paired import TITLES, claim_line, comparisons_html, figure_rows, pair_statistics
from nagmoe.base.errors import one_line
from nagmoe.base.files import atomic_writer, write_atomic

REPORT_HTML, REPORT_JSON, FIGURE_DIR = "report.html", "report.json", "figures"
FIGURES = ("loss_curves", "val_bpb", "paired_differences", "depth", "confidence", "router_load", "compute_dial",
           "mod_skip_depth")
SECTIONS = ("overview", "problems", "results", "curves", "comparisons", "depth", "mod", "dial", "references", "runs")
PAIR_TITLES = TITLES
CSS = """body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1200px;margin:2em auto;
padding:0 1em;color:#222;line-height:1.45}h1{margin-bottom:.2em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;
margin-top:2em}table{border-collapse:collapse;margin:.6em 0;font-size:.92em}th,td{border:1px solid #ccc;padding:.3em
.6em;text-align:left;vertical-align:top}th{background:#f3f3f3}td.n{text-align:right;white-space:nowrap}
img{max-width:100%;border:1px solid #eee}.note{color:#555;font-size:.92em}.theirs{background:#fff8e6}
.bad{color:#a00}.scroll{overflow-x:auto}"""


# ----------------------------------------------------------------------------------------------------------
# Formatting
# ----------------------------------------------------------------------------------------------------------
def esc(x) -> str:
    return html.escape(str(x))


def num(x, spec: str = ".4f", none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def spread(values, spec: str = ".4f") -> str:
    """'mean ± sd (n)' with several seeds, the value with one, 'n/a' with none."""
    mean, sd, n = mean_sd(values)
    if mean is None:
        return "n/a"
    return f"{mean:{spec}} ± {sd:{spec}} (n={n})" if sd is not None else format(mean, spec)


def seconds(x) -> str:
    return "n/a" if x is None else f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def big(x) -> str:
    return "n/a" if x is None else f"{x:.3g}" if x >= 1e6 else f"{x:,.0f}"


_NUMBER = re.compile(r"^[+-]?[\d.,]+(e[+-]?\d+)?%?( ± [\d.,]+(e[+-]?\d+)?%? \(n=\d+\))?$|^\d+/\d+$|^n/a$|^-$")


def table(headers: list, rows: list, row_class: Optional[list] = None) -> str:
    """An HTML table; cells that read as numbers are right-aligned."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{row_class[i]}"' if row_class and row_class[i] else ""
        cells = "".join(f'<td{" class=n" if _NUMBER.match(str(c)) else ""}>{esc(c)}</td>' for c in row)
        body.append(f"<tr{cls}>{cells}</tr>")
    return f'<div class="scroll"><table><tr>{head}</tr>{"".join(body)}</table></div>'


def para(text: str, cls: str = "") -> str:
    return f'<p{f" class={chr(34)}{cls}{chr(34)}" if cls else ""}>{esc(text)}</p>'


def image(path: Optional[str], alt: str, missing: str) -> str:
    if path is None:
        return para(f"(no figure: {missing})", "note")
    with open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode("ascii")
    rel = f"{FIGURE_DIR}/{os.path.basename(path)}"
    return f'<p><a href="{esc(rel)}"><img src="data:image/png;base64,{data}" alt="{esc(alt)}"></a></p>'


# ----------------------------------------------------------------------------------------------------------
# Per-group numbers
# ----------------------------------------------------------------------------------------------------------
def group_numbers(rs: list) -> dict:
    cfg = rs[0].config
    evals = [r.eval_accuracy for r in rs if r.eval_accuracy]
    analysed = next((r for r in rs if r.analysis), None)
    return {
        "seeds": [r.seed for r in rs], "residual": cfg.model.residual, "ffn": cfg.model.ffn,
        "target_skip_rate": cfg.model.mod.skip_rate, "flop_budget": cfg.train.flop_budget,
        "val_bpb": [r.val_bpb for r in rs], "final_loss": [r.final_loss for r in rs],
        "val_loss": [r.val_loss for r in rs], "tokens": [r.final("tokens") for r in rs],
        "flops": [r.final("flops") for r in rs], "steps": [r.final("steps") for r in rs],
        "wall_time_s": [r.final("wall_time_s") for r in rs], "skip_rate": [r.skip_rate for r in rs],
        "run_skip_rate": [(r.summary or {}).get("run_skip_rate") for r in rs],
        "flops_executed": [(r.summary or {}).get("flops_executed") for r in rs],
        "flops_full_depth": [(r.summary or {}).get("flops_full_depth") for r in rs],
        "mod_impl": sorted({mod_impl(r) for r in rs} - {None}),
        "tokens_per_s": [r.tokens_per_s for r in rs],
        "eval_accuracy": [e[0] for e in evals], "eval_centred": [e[1] for e in evals],
        "eval_items": sum(e[2] for e in evals), "analysed": analysed.label if analysed else None,
    }


def mod_impl(r):
    """The MoD implementation a run used: its summary's (every implementation its steps ran), else run_info.json's
    resolved backend (`MoD.impl`), else None (no MoD, or a run from before either was written)."""
    return (r.summary or {}).get("mod_impl") or ((r.run_info or {}).get("backends") or {}).get("MoD.impl")


def _m(values):
    return mean_sd(values)[0]


# ----------------------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------------------
def overview(title, description, records, groups, nums, unigram, opts) -> str:
    out = [f"<h1>{esc(title)}</h1>", para(f"generated {time.strftime('%Y-%m-%d %H:%M:%S %z')} from "
                                          f"{len(records)} run dir(s) in {len(groups)} group(s)", "note")]
    if description:
        out.append(para(description))
    budgets = {n["flop_budget"] for n in nums.values()}
    if len(budgets) == 1 and None not in budgets:
        used = [f / n["flop_budget"] for n in nums.values() for f in n["flops"] if f is not None]
        out.append(para(f"FLOP-matched: every run trains to the same budget of {budgets.pop():.4g} training FLOPs "
                        "(forward + backward, executed work only under MoD); used "
                        + (f"{min(used):.1%}-{max(used):.1%}" if used else "n/a") + " of it."))
    elif records:
        pairs = [p for p in find_pairs(groups) if p.kind != "vs_first"]
        listing = ", ".join(f"{g} {num(n['flop_budget'], '.4g')}" for g, n in nums.items())
        if pairs and None not in budgets and all(
                nums[p.reference]["flop_budget"] == nums[p.variant]["flop_budget"] for p in pairs):
            out.append(para("FLOP-matched within each comparison (a sweep: every pair below shares its budget, "
                            "ratios differ): " + listing))
        else:
            out.append(para("Not FLOP-matched: the runs have different (or no) train.flop_budget: " + listing, "bad"))
    for data_dir, value in unigram.items():
        out.append(para(f"Unigram baseline of {data_dir} (token frequencies of the train split, on the validation "
                        f"split): {num(value)} bpb — a model that ignores context; every run must beat it."))
    out.append(para(f"Measured on each run's latest checkpoint: depth analysis on {opts['analysis_tokens']} validation "
                    f"tokens, eval on {opts['eval_items']} items of the offline Shakespeare next-line task (0 = "
                    f"skipped). Final training loss = mean of the last {FINAL_LOSS_WINDOW} logged steps.", "note"))
    return "\n".join(out)


def results(groups, nums, unigram) -> str:
    rows = []
    uni = next(iter(unigram.values()), None) if len(unigram) == 1 else None
    for g, n in nums.items():
        bpb = _m(n["val_bpb"])
        budget = n["flop_budget"]
        used = _m([f / budget for f in n["flops"] if f is not None]) if budget else None
        rows.append([g, len(n["seeds"]), spread(n["val_bpb"]), num(bpb - uni if bpb is not None and uni else None,
                                                                     "+.4f"),
                     spread(n["eval_accuracy"], ".3f"), spread(n["final_loss"]),
                     big(_m(n["tokens"])), big(_m(n["flops"])), num(used, ".1%"), num(_m(n["steps"]), ".0f"),
                     seconds(_m(n["wall_time_s"])), num(_m(n["tokens_per_s"]), ".0f")])
    headers = ["run", "seeds", "final val bpb", "vs unigram", "eval accuracy", "final train loss",
               "tokens", "training FLOPs", "budget used", "steps", "wall-clock (s)", "tokens/s (median)"]
    if uni is not None:
        rows.append(["unigram (token frequencies)", "", num(uni)] + [""] * (len(headers) - 3))
    out = [table(headers, rows)]
    if any(len(n["seeds"]) > 1 for n in nums.values()):
        out.append(para("With several seeds: mean ± sample standard deviation over seeds (n = seeds).", "note"))
    else:
        out.append(para("One seed per run: no seed spread is measured (add seeds to the experiment to get mean ± sd).",
                        "note"))
    out.append(para("Final val bpb: the final eval's sample, train.eval_tokens of windows strided over the whole "
                    "validation split (runs from before issue 66: the split's first windows); the comparisons below "
                    "pair the runs window by window on it.", "note"))
    out.append(para("Eval: offline Shakespeare next-line task (pick the true next line among 4; chance 0.25; "
                    "report.json also has the centred accuracy (acc - 0.25) / 0.75), not CORE.", "note"))
    return "\n".join(out)


def depth_section(groups, colours, fig_dir) -> tuple:
    depth, conf, rows, loads = {}, {}, [], {}
    for g, rs in groups.items():
        r = next((r for r in rs if r.analysis), None)
        if r is None:
            continue
        a = r.analysis
        d, sink = a["depth"], a["attention_sink"]
        gains = [s.get("gain_mean") for s in d["sublayers"]] if a["residual"] == "nag" else None
        depth[g] = {"norm": d["norm_curve"], "rotation": d["cumulative_rotation"],
                    "bos": sink["first_key_mass_per_layer"], "gain": gains, "kind": a["residual"]}
        signal = a["confidence"].get("final_log_norm")
        if signal:
            conf[g] = signal["bins"]
        if isinstance(a.get("router"), dict):  # analyses cached before the router section have none
            loads[g] = a["router"]["load"]
        rows.append([f"{g} ({r.label})", a["residual"], num(d["norm_growth"], ".2f"),
                     num(d["cumulative_rotation"][-1], ".3f"), num(sink["mean_first_key_mass"], ".1%"),
                     f"{sink['layers_above_half']}/{sink['n_layers']}",
                     f"{d['dead_sublayers']}/{len(d['sublayers'])}" if "dead_sublayers" in d else "-",
                     num(signal["spearman_loss"], "+.3f") if signal else "-", a.get("windows", "")])
    paths = (fig.depth_panels(depth, colours, os.path.join(fig_dir, "depth.png")),
             fig.confidence_panels(conf, colours, os.path.join(fig_dir, "confidence.png")),
             fig.router_load_heatmaps(loads, os.path.join(fig_dir, "router_load.png")))
    if not rows:
        return "\n".join([para("No analysed checkpoint (none found, or --analysis-tokens 0): no depth figures.",
                                "note"), *balance_tables(groups)]), paths
    html_ = [table(["run (analysed seed)", "residual", "norm growth (last/first)", "cumulative rotation (rad)",
                    "mean attention on BOS", "layers > 50% on BOS", "dead NAG sublayers", "Spearman(final norm, loss)",
                    "windows"], rows),
             image(paths[0], "depth figures", "no analysed checkpoint"),
             para("Norm: NAG = exp(mean log-norm) (geometric mean of token norms), pre-norm = mean stream RMS. "
                  "Rotation: running sum of the mean angle each sublayer turns the stream. BOS: mean attention mass "
                  "on key 0 of BOS-aligned windows (queries t >= 1). Gain: NAG's realised |alpha m warmup|.", "note"),
             "<h3>Confidence: NAG's final norm</h3>",
             image(paths[1], "confidence by final norm", "no NAG run analysed"),
             "<h3>Router load by layer</h3>",
             image(paths[2], "router load by layer", "no MoE run analysed"),
             para("Fraction of the routing slots each expert of each MoE layer received on the analysed "
                  "validation tokens (nagmoe analyze, section router: also entropy, max/mean, CV, dead experts).",
                  "note")]
    html_ += balance_tables(groups)
    html_ += milestone_tables(groups)
    return "\n".join(html_), paths


def balance_tables(groups) -> list:
    """Expert balance during training, from each run's metrics (nagmoe/analysis/report_balance.py)."""
    rows = balance_rows(groups)
    if not rows:
        return []
    return ["<h3>Expert balance during training</h3>", table(HEADERS, rows), para(BALANCE_NOTE, "note")]


def milestone_tables(groups) -> list:
    """Norm, rotation, skip and router health at each milestone checkpoint (nagmoe analyze --milestones)."""
    rows = []
    for g, rs in groups.items():
        for r in rs:
            for m in (r.analysis or {}).get("through_training", []):
                rows.append([f"{g} ({r.label})", str(m["step"]), big(m["tokens"]) if m["tokens"] else "-",
                             num(m["val_loss"]), num(m["norm_growth"], ".2f"), num(m["cumulative_rotation"], ".3f"),
                             num(m["skip_rate"], ".1%"), num(m["router_max_over_mean"], ".2f"),
                             "-" if m["router_dead_experts"] is None else str(m["router_dead_experts"])])
    if not rows:
        return []
    return ["<h3>Through training (milestone checkpoints)</h3>",
            table(["run", "step", "tokens", "val loss", "norm growth", "cumulative rotation (rad)", "MoD skip",
                   "worst expert load (max/mean)", "dead experts"], rows),
            para("Each run's milestones (train.keep_milestone_every_tokens, never pruned; weights-only in the "
                 "run's train.milestone_dtype, or full checkpoints) and its latest checkpoint, measured on the same "
                 "validation windows as above.", "note")]


def mod_section(groups, nums, pairs, fig_dir) -> tuple:
    mod_groups = [g for g, n in nums.items() if n["target_skip_rate"] > 0]
    if not mod_groups:
        return para("No MoD run in this report (model.mod.skip_rate = 0 everywhere): nothing to compare with full "
                    "depth.", "note"), None
    partner = {p.variant: p.reference for p in pairs if p.kind == "mod_vs_full"}
    rows = []
    from nagmoe.config.flops import flops_per_token

    def row(g, ref=None):
        n, cfg = nums[g], groups[g][0].config
        tokens, flops = _m(n["tokens"]), _m(n["flops"])
        full = flops_per_token(cfg.model, cfg.data.seq_len)
        per_token = flops / tokens / full if tokens and flops else None
        r = nums[ref] if ref else None
        d_bpb = (_m(n["val_bpb"]) - _m(r["val_bpb"])) if r and _m(n["val_bpb"]) is not None and _m(
            r["val_bpb"]) is not None else None
        d_loss = (_m(n["val_loss"]) - _m(r["val_loss"])) if r and _m(n["val_loss"]) is not None and _m(
            r["val_loss"]) is not None else None
        ratio = tokens / _m(r["tokens"]) if r and tokens and _m(r["tokens"]) else None
        executed, full_depth = _m(n["flops_executed"]), _m(n["flops_full_depth"])
        saving = 1.0 - executed / full_depth if executed is not None and full_depth else None
        return [g, num(n["target_skip_rate"], ".0%"), num(_m(n["skip_rate"]), ".1%"),
                num(_m(n["run_skip_rate"]), ".1%"), big(tokens),
                num(ratio, ".3f", "-" if not ref else "n/a"), big(flops),
                big(executed if executed is not None else flops),
                ", ".join(n["mod_impl"]) or "-", num(saving, ".1%", "-"), num(per_token, ".3f"),
                seconds(_m(n["wall_time_s"])), num(_m(n["final_loss"])), num(_m(n["val_bpb"])),
                num(d_bpb, "+.4f", "-" if not ref else "n/a"), num(d_loss, "+.4f", "-" if not ref else "n/a")]

    done = set()
    for g in mod_groups:
        ref = partner.get(g)
        if ref and ref not in done:
            rows.append(row(ref))
            done.add(ref)
        rows.append(row(g, ref))
    headers = ["run", "target skip", "realised skip of work (skipping steps)", "whole run", "tokens processed",
               "tokens vs full depth",
               "training FLOPs charged", "as executed", "MoD impl", "saved as executed vs full depth",
               "FLOPs per token / full depth", "wall-clock (s)", "final train loss",
               "final val bpb", "val bpb vs full depth", "val loss vs full depth (nats)"]
    rows.append(["paper (theirs): MoD 20% vs full-depth NAG", "20%", "", "", "60.9B vs 50B", "1.218", "= budget",
                 "", "", "", "", "", "", "", "", "+0.00055"])
    classes = [""] * (len(rows) - 1) + ["theirs"]
    notes = [] if all(partner.get(g) for g in mod_groups) else [
        para("A MoD run without a full-depth partner (a run whose config differs only in model.mod.*) has no "
             "difference column.", "note")]
    skips = {g: next((r.summary.get("skip_per_sublayer") for r in groups[g] if (r.summary or {}).get(
        "skip_per_sublayer")), None) for g in mod_groups}
    depth_png = fig.skip_through_depth(skips, os.path.join(fig_dir, "mod_skip_depth.png"))
    return "\n".join([table(headers, rows, classes), para(
        "Realised skip: the skipped share of the skippable work (FLOP-weighted per sublayer), averaged over the "
        "steps that skipped; the whole run includes the steps before skipping starts. Executed training FLOPs "
        "count skipped sublayer work as not done; K/V projections, embeddings, unembedding and modulators are still "
        "paid for skipped tokens (nagmoe/config/flops.py), so 20% skipped work buys fewer than 25% more tokens. "
        "As executed: what the run's MoD implementation (model.mod.impl, run_info.json's MoD.impl) computed; gather "
        "pads attention's executed queries to the longest row, static computes every row's attention, router and "
        "dense FFN and skips only the MoE's expert GEMMs, so it saves less than the budget charges. Saved as "
        "executed: 1 - executed / full-depth FLOPs of the same tokens (runs from before issue 69: -).", "note"),
        *notes, "<h3>Skip through depth</h3>",
        image(depth_png, "skipped share per sublayer", "no per-sublayer skip in the runs' summaries"),
        para("Training, skipping steps only. With model.mod.threshold=global one threshold on the rotation score "
             "decides everywhere, so depth adapts: sublayers whose rotations are small skip more (up to "
             "model.mod.max_sublayer_skip).", "note")]), depth_png


def dial_section(groups, nums, colours, fig_dir) -> tuple:
    dials, tables = {}, []
    for g, rs in groups.items():
        r = next((r for r in rs if r.analysis and isinstance(r.analysis.get("compute_dial"), list)), None)
        if r is None:
            continue
        dials[g] = r.analysis["compute_dial"]
        tables.append(f"<h3>{esc(g)} ({esc(r.label)})</h3>" + table(
            ["inference skip rate (asked)", "calibrated (other tokens)", "realised", "forward FLOPs / full depth",
             "val loss (nats)", "val bpb"],
            [[num(d["skip_rate"], ".0%"), num(d.get("calibrated_skip_rate"), ".1%"),
              num(d.get("realised_skip_rate"), ".1%"), num(d["flops_vs_full_depth"], ".3f"),
              num(d.get("val_loss")), num(d.get("val_bpb"))] for d in dials[g]]))
    # full-depth NAG runs at x = 1, measured the same way as the dial (the analysis windows)
    full = {g: (_analysis(groups[g]) or {}).get("val_bpb") for g, n in nums.items()
            if n["target_skip_rate"] == 0 and n["residual"] == "nag"}
    path = fig.compute_dial(dials, colours, os.path.join(fig_dir, "compute_dial.png"), full)
    if not dials:
        return para("No compute dial: it needs an analysed run trained with MoD (model.mod.skip_rate > 0), whose "
                    "score histograms set thresholds for other skip rates after training.", "note"), path
    return "\n".join([image(path, "compute dial", "no dial values"), para(
        "The same trained MoD model evaluated with thresholds for 0-40% skipped sublayer work (from its saved score "
        "histograms); full-depth NAG runs are drawn at 1.0 for reference. All on the analysis windows (BOS-aligned), "
        "so the bpb here can differ from the training-time val bpb under Results.", "note"), *tables]), path


def references(pairs, nums, groups, stats) -> str:
    ours = {k: [] for k in THEIRS}  # one entry per matching pair (a sweep has several)
    counts = {kind: sum(p.kind == kind for p in pairs) for kind in PAIR_TITLES}
    for p, st in zip(pairs, stats):
        a, b = nums[p.reference], nums[p.variant]
        found = {}
        resolution = claim_line(st)  # the paper's claim against what these windows resolve (report_paired.py)
        if p.kind == "nag_vs_baseline":
            cfg = groups[p.variant][0].config.model
            ratio = cfg.d_model / cfg.n_layers
            la, lb = _m(a["val_loss"]), _m(b["val_loss"])
            fa, fb = _m(a["final_loss"]), _m(b["final_loss"])
            if la is not None and lb is not None:
                found["nag_loss_advantage"] = f"{la - lb:+.4f} (val loss) at width/depth {ratio:.0f}"
            elif fa is not None and fb is not None:
                found["nag_loss_advantage"] = f"{fa - fb:+.4f} (final training loss) at width/depth {ratio:.0f}"
            if resolution:
                found["nag_loss_advantage"] = f"{found.get('nag_loss_advantage', 'n/a')}; {resolution}"
            found["val_bpb"] = f"{num(_m(a['val_bpb']))} vs {num(_m(b['val_bpb']))}"
            found["core"] = (f"{num(_m(a['eval_centred']), '.3f')} vs {num(_m(b['eval_centred']), '.3f')} "
                             "(Shakespeare next-line, centred accuracy; not CORE)")
            ra, rb = _analysis(groups[p.reference]), _analysis(groups[p.variant])
            if ra and rb:
                sa, sb = ra["attention_sink"], rb["attention_sink"]
                found["bos_mass"] = (f"{num(sa['mean_first_key_mass'], '.1%')} -> "
                                     f"{num(sb['mean_first_key_mass'], '.1%')}")
                found["bos_layers"] = (f"{sa['layers_above_half']}/{sa['n_layers']} -> "
                                       f"{sb['layers_above_half']}/{sb['n_layers']}")
                found["norm_growth"] = (f"norm growth x{num(ra['depth']['norm_growth'], '.2f')} (baseline) vs "
                                        f"x{num(rb['depth']['norm_growth'], '.2f')} (NAG); cumulative rotation "
                                        f"{ra['depth']['cumulative_rotation'][-1]:.2f} vs "
                                        f"{rb['depth']['cumulative_rotation'][-1]:.2f} rad")
                conf = rb["confidence"].get("final_log_norm")
                if conf:
                    found["confidence"] = (f"Spearman(final log-norm, loss) {num(conf['spearman_loss'], '+.3f')}, "
                                           f"(final log-norm, top-1) {num(conf['spearman_top1'], '+.3f')}")
            sa_, sb_ = _m(a["tokens_per_s"]), _m(b["tokens_per_s"])
            if sa_ and sb_:
                found["nag_cost"] = (f"NAG at {sb_ / sa_:.2f}x the baseline's tokens/s (medians per step {sb_:,.0f} vs "
                                     f"{sa_:,.0f}; timed on this machine, which may have been shared)")
        elif p.kind == "mod_vs_full":
            ta, tb = _m(a["tokens"]), _m(b["tokens"])
            if ta and tb:
                found["mod_tokens"] = (f"{tb:,.0f} vs {ta:,.0f} (x{tb / ta:.3f}) at skip rate "
                                       f"{b['target_skip_rate']:.0%}, budget in the "
                                       f"{groups[p.variant][0].config.train.flop_convention} convention")
            found["mod_tokens"] = "; ".join(filter(None, [found.get("mod_tokens"), _ratio_by_convention(
                groups[p.variant][0].config)]))
            la, lb = _m(a["val_loss"]), _m(b["val_loss"])
            ba, bb = _m(a["val_bpb"]), _m(b["val_bpb"])
            found["mod_loss"] = "; ".join(([f"{lb - la:+.4f} nats (val loss)"] if la is not None and lb is not None
                                           else []) + ([f"{bb - ba:+.4f} bpb"] if ba is not None and bb is not None
                                                       else [])) or "n/a"
            if resolution:
                found["mod_loss"] = f"{found['mod_loss']}; {resolution}"
        for key, text in found.items():
            ours[key].append(f"{p.variant} vs {p.reference}: {text}" if counts[p.kind] > 1 else text)
    rows = [[what, theirs, source.split(":")[0], "; ".join(ours[key]) or "no matching pair in this report"]
            for key, (what, theirs, source) in THEIRS.items()]
    sources = sorted({source for _, _, source in THEIRS.values()})
    return "\n".join([table(["measure", "theirs", "source", "ours (this report)"], rows, ["theirs"] * len(rows)),
                      "<ul>" + "".join(f"<li>{esc(s)}</li>" for s in sources) + "</ul>",
                      para("Their numbers come from runs thousands of times larger than a CPU demo; they show the "
                           "direction to look for, not a value a small run should reach.", "note")])


def _ratio_by_convention(cfg) -> str:
    """The ideal MoD token ratio of a config in both FLOP conventions (the paper's unit is not public)."""
    from nagmoe.config.flops import CONVENTIONS, mod_token_ratio

    skip = cfg.model.mod.skip_rate
    ratios = ", ".join(f"x{mod_token_ratio(cfg.model, cfg.data.seq_len, 1.0 - skip, c):.3f} {c}" for c in CONVENTIONS)
    return (f"ideal at {skip:.0%} skipped work: {ratios} (the paper's FLOP unit and its definition of 20% are not "
            "public: neither of ours can be declared theirs)")


def _analysis(rs):
    return next((r.analysis for r in rs if r.analysis), None)


def runs_section(records) -> str:
    from nagmoe.config.flops import param_counts

    rows = []
    for r in records:
        m = r.config.model
        try:
            params = param_counts(m)
            size = f"{params['total'] / 1e6:.2f}M / {params['active'] / 1e6:.2f}M"
        except Exception:  # a config this version cannot count
            size = "n/a"
        rows.append([r.label, r.run_dir, "finished" if r.summary else "unfinished",
                     os.path.basename(r.checkpoint) if r.checkpoint else "none",
                     f"{m.residual} {m.ffn} {m.attention.kind} d{m.d_model} x {m.n_layers}"
                     + (f" MoD {m.mod.skip_rate:.0%}" if m.mod.skip_rate else ""), size,
                     r.run_info.get("git_commit", "n/a"), "; ".join(r.notes) or "-"])
    if not rows:
        return para("No usable run dir.", "note")
    return table(["run", "run dir", "state", "checkpoint", "model", "params total / active", "git commit", "notes"],
                 rows)


# ----------------------------------------------------------------------------------------------------------
# The page
# ----------------------------------------------------------------------------------------------------------
def write_report(run_dirs: list, out_dir: str, title: Optional[str] = None, description: str = "",
                 eval_items: int = 200, analysis_tokens: int = 16384, device: str = "auto",
                 log: Callable[[str], None] = print) -> dict:
    """Write OUT/report.html (+ figures/, report.json, data/); returns the report's numbers (report.json)."""
    from nagmoe.eval.task_specs import resolve_device
    from nagmoe.data.bpb import unigram_bpb

    fig_dir = os.path.join(out_dir, FIGURE_DIR)
    os.makedirs(fig_dir, exist_ok=True)
    records, problems = [], []
    for d in run_dirs:
        record, messages = read_run(d)
        problems += messages
        if record is not None:
            records.append(record)
    unique_labels(records)
    dev = resolve_device(device) if records else "cpu"
    for r in records:
        problems += measure_checkpoint(r, out_dir, analysis_tokens, eval_items, dev, log)
    unigram = {}
    for data_dir in dict.fromkeys(r.config.data.data_dir for r in records):
        try:
            unigram[data_dir] = unigram_bpb(data_dir)
        except Exception as e:
            problems.append(f"{one_line(data_dir, 500)}: no unigram baseline ({problem_text(e)})")
    groups = group_records(records)
    colours = fig.palette(list(groups))
    nums = {g: group_numbers(rs) for g, rs in groups.items()}
    pairs = find_pairs(groups)
    stats = [pair_statistics(p, groups, nums) for p in pairs]  # paired over windows, and over seeds
    opts = {"eval_items": eval_items, "analysis_tokens": analysis_tokens}
    def curve(r):  # (flops, tokens, loss) of the logged steps
        logged = [m for m in r.metrics if m.get("loss") is not None]
        return [m["flops"] for m in logged], [m["tokens"] for m in logged], [m["loss"] for m in logged]

    curves = {g: [curve(r) for r in rs] for g, rs in groups.items()}
    points = {g: [[(m["flops"], m["val_bpb"]) for m in r.metrics if m.get("val_bpb") is not None] for r in rs]
              for g, rs in groups.items()}
    loss_png = fig.loss_curves(curves, colours, os.path.join(fig_dir, "loss_curves.png"))
    uni = next(iter(unigram.values())) if len(unigram) == 1 else None
    bpb_png = fig.val_bpb_points(points, colours, os.path.join(fig_dir, "val_bpb.png"), uni)
    paired_png = fig.paired_differences(figure_rows(pairs, stats), os.path.join(fig_dir, "paired_differences.png"))
    depth_html, (depth_png, conf_png, router_png) = depth_section(groups, colours, fig_dir)
    dial_html, dial_png = dial_section(groups, nums, colours, fig_dir)
    mod_html, skip_png = mod_section(groups, nums, pairs, fig_dir)
    made = {"loss_curves": loss_png, "val_bpb": bpb_png, "paired_differences": paired_png, "depth": depth_png,
            "confidence": conf_png, "router_load": router_png, "compute_dial": dial_png, "mod_skip_depth": skip_png}
    for name, path in made.items():  # a figure of an earlier render that has nothing to show now
        stale = os.path.join(fig_dir, f"{name}.png")
        if path is None and os.path.exists(stale):
            os.remove(stale)

    title = title or "nagmoe report"
    body = {
        "overview": overview(title, description, records, groups, nums, unigram, opts),
        "problems": ("<ul>" + "".join(f'<li class="bad">{esc(p)}</li>' for p in problems) + "</ul>") if problems
        else para("None: every run dir given was read.", "note"),
        "results": results(groups, nums, unigram) if nums else para("No usable run dir.", "note"),
        "curves": image(loss_png, "loss curves", "no logged training step") + image(
            bpb_png, "validation bpb", "no validation bpb logged"),
        "comparisons": comparisons_html(pairs, stats, nums, image(
            paired_png, "paired differences", "no pair with a difference to draw") if pairs else ""),
        "depth": depth_html,
        "mod": mod_html,
        "dial": dial_html,
        "references": references(pairs, nums, groups, stats),
        "runs": runs_section(records),
    }
    headings = {"overview": None, "problems": "Problems", "results": "Results: final val bpb and eval score",
                "curves": "Loss vs FLOPs and vs tokens", "comparisons": "Comparisons and noise",
                "depth": "Through depth: baseline vs NAG", "mod": "Mixture-of-Depths vs full depth",
                "dial": "Compute dial", "references": "Their numbers beside ours", "runs": "Runs"}
    parts = [f'<section id="{s}">' + (f"<h2>{esc(headings[s])}</h2>" if headings[s] else "") + body[s] + "</section>"
             for s in SECTIONS]
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>'
            f'<body>\n' + "\n".join(parts) + "\n</body></html>\n")
    path = os.path.join(out_dir, REPORT_HTML)
    write_atomic(path, page)  # a fresh temporary, renamed (nagmoe.base.files): a shared --out dir's planted names
    data = {"title": title, "html": path, "problems": problems, "unigram_bpb": unigram, "sections": list(SECTIONS),
            "figures": {k: os.path.relpath(v, out_dir) for k, v in made.items() if v},
            "pairs": [{**p.__dict__, **{k: st[k] for k in ("paired", "not_paired", "per_seed", "seeds", "verdict",
                                                            "claim") if k in st}} for p, st in zip(pairs, stats)],
            "groups": nums,
            "runs": {r.label: {"run_dir": r.run_dir, "group": r.group, "seed": r.seed, "checkpoint": r.checkpoint,
                               "val_bpb": r.val_bpb, "final_loss": r.final_loss, "notes": r.notes} for r in records}}
    with atomic_writer(os.path.join(out_dir, REPORT_JSON)) as f:
        json.dump(data, f, indent=1, default=str)
    log(f"[report] wrote {path} ({len(records)} run(s), {len(problems)} problem(s))")
    return data
