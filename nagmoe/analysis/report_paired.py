"""The report's comparisons (issue 66): for each pair of run groups, the paired difference over the validation
windows both scored (nagmoe/analysis/paired.py), per seed and pooled, beside the seed spread (report_data.py
`noise_statement`), and one verdict worded by both; the figure of every pair's difference with its two intervals,
and the paper's claims placed against what these windows resolve.

A run pairs through its kept per-window losses (RUN_DIR/eval_windows.json, RunRecord.windows); seeds pair by seed
number (A-sS with B-sS). A pair without them still reports, with a line saying why it is not paired.
"""
from __future__ import annotations

import html
from typing import Optional

from nagmoe.analysis.paired import Z95, NotPaired, paired_difference, tokens_to_resolve, verdict
from nagmoe.analysis.references import CLAIMS
from nagmoe.analysis.report_data import accuracy_noise, mean_sd, noise_statement

TITLES = {"nag_vs_baseline": "NAG vs pre-norm baseline", "mod_vs_full": "MoD vs full depth",
          "vs_first": "vs the first run"}


def _m(values):
    return mean_sd(values)[0]


def _seed_pairs(groups: dict, pair) -> tuple[list, Optional[str]]:
    """[(seed, reference record, variant record)] with window losses on both sides, and why none when empty."""
    ref = {r.seed: r for r in groups[pair.reference]}
    var = {r.seed: r for r in groups[pair.variant]}
    seeds = [s for s in ref if s in var]
    if not seeds:
        return [], "no seed was run on both sides"
    both = [(s, ref[s], var[s]) for s in seeds if ref[s].windows is not None and var[s].windows is not None]
    if both:
        return both, None
    missing = [r.label for s in seeds for r in (ref[s], var[s]) if r.windows is None]
    why = "; ".join(dict.fromkeys(r.windows_note or "no per-window losses" for s in seeds
                                  for r in (ref[s], var[s]) if r.windows is None))
    return [], f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}: {why}"


def pair_statistics(pair, groups: dict, nums: dict) -> dict:
    """Everything the report says of one pair: `paired` (pooled over seeds) or `not_paired` (why), `per_seed`,
    `seeds` (the seed spread), `verdict`."""
    names = (pair.variant, pair.reference)
    seeds = noise_statement(nums[pair.reference]["val_bpb"], nums[pair.variant]["val_bpb"], "val bpb", names=names)
    out = {"kind": pair.kind, "reference": pair.reference, "variant": pair.variant, "seeds": seeds,
           "paired": None, "not_paired": None, "per_seed": []}
    both, why = _seed_pairs(groups, pair)
    for seed, a, b in both:
        try:
            out["per_seed"].append({"seed": seed, **paired_difference([(a.windows, b.windows)])})
        except NotPaired as e:
            out["per_seed"].append({"seed": seed, "not_paired": str(e)})
    usable = [(a.windows, b.windows) for (s, a, b), p in zip(both, out["per_seed"]) if "not_paired" not in p]
    if usable:
        try:
            out["paired"] = paired_difference(usable)
        except NotPaired as e:
            why = str(e)
    elif both:
        why = out["per_seed"][0]["not_paired"]
    out["not_paired"] = None if out["paired"] else why
    claim = CLAIMS.get(pair.kind)
    if out["paired"] and claim:
        out["claim"] = {"nats_per_token": claim[0], "text": claim[1],
                        "tokens_to_resolve": tokens_to_resolve(out["paired"], claim[0])}
    out["verdict"] = verdict(out["paired"], seeds, names)
    return out


def paired_line(stats: dict) -> str:
    p = stats["paired"]
    if p is None:
        return f"not paired: {stats['not_paired']}"
    seeds = f", pooled over {p['seeds']} seeds" if p["seeds"] > 1 else ""
    return (f"paired over {p['windows']:,} validation windows ({p['tokens']:,} tokens{seeds}): "
            f"{p['difference_bpb']:+.4f} bpb, 95% interval [{p['ci95_bpb'][0]:+.4f}, {p['ci95_bpb'][1]:+.4f}] "
            f"({p['method']} method over windows; {p['difference_nats_per_token']:+.5f} ± "
            f"{p['se_nats_per_token']:.5f} nats/token, ± one standard error)")


def claim_line(stats: dict) -> Optional[str]:
    c, p = stats.get("claim"), stats["paired"]
    if not c or p is None:
        return None
    resolves = Z95 * p["se_nats_per_token"]
    need = c["tokens_to_resolve"]
    would = "would" if c["nats_per_token"] > resolves else "would not"
    return (f"a difference the size of {c['text']} {would} be resolved by these windows, which resolve "
            f"{resolves:.5f} nats/token (95%); at this sample's per-token noise it needs ~{need:,.0f} tokens"
            if need is not None else None)


def comparisons_html(pairs: list, stats: list, nums: dict, figure_html: str) -> str:
    esc = html.escape
    if not pairs:
        return "<p class=\"note\">Only one run group: nothing to compare.</p>"
    out = [figure_html]
    for pair, s in zip(pairs, stats):
        a, b = nums[pair.reference], nums[pair.variant]
        out.append(f"<h3>{esc(TITLES[pair.kind])}: {esc(pair.variant)} vs {esc(pair.reference)}</h3>")
        items = [f"verdict: {s['verdict']['text']}",
                 f"eval windows: {paired_line(s)}",
                 f"seeds: val bpb difference ({pair.variant} - {pair.reference}) "
                 f"{'n/a' if s['seeds']['diff'] is None else format(s['seeds']['diff'], '+.4f')} — "
                 f"{s['seeds']['text']}"]
        items += [f"seed {p['seed']}: " + (f"not paired: {p['not_paired']}" if "not_paired" in p else
                                           f"{p['difference_bpb']:+.4f} bpb [{p['ci95_bpb'][0]:+.4f}, "
                                           f"{p['ci95_bpb'][1]:+.4f}]")
                  for p in s["per_seed"] if len(s["per_seed"]) > 1]
        claim = claim_line(s)
        if claim:
            items.append(f"against the paper: {claim}")
        loss = noise_statement(a["val_loss"], b["val_loss"], "val loss", " nats", names=(pair.variant, pair.reference))
        if loss["diff"] is not None:
            items.append(f"val loss difference (nats, analysis windows): {loss['diff']:+.4f} — {loss['text']}")
        if a["eval_accuracy"] and b["eval_accuracy"]:
            acc = accuracy_noise((_m(a["eval_accuracy"]), a["eval_items"]), (_m(b["eval_accuracy"]), b["eval_items"]))
            items.append(f"eval accuracy difference: {acc['diff']:+.3f} — {acc['text']}")
        ta, tb = _m(a["tokens"]), _m(b["tokens"])
        if ta and tb:
            items.append(f"tokens seen: {tb / ta:.3f}x the reference's under the same budget")
        items.append(f"configs differ in: {', '.join(pair.differs) or 'nothing but the seed and budget keys'}")
        out.append("<ul>" + "".join(f"<li>{esc(i)}</li>" for i in items) + "</ul>")
    out.append("<p class=\"note\">Two noises, two intervals. Eval windows: both runs scored the same validation "
               "windows (a strided sample over the whole split, train.eval_tokens), so the difference is taken window "
               "by window and the document-to-document variation cancels; its 95% interval (delta method on the ratio "
               "of sums, windows as units) is the eval-sample error of these trained models. Seeds: the spread of the "
               "seed means, the training noise (two standard errors). A difference is decided when both resolve "
               "it.</p>")
    return "\n".join(out)


def figure_rows(pairs: list, stats: list) -> list:
    """(label, difference, windows interval or None, seed half-width or None) per pair, for the figure."""
    rows = []
    for pair, s in zip(pairs, stats):
        p, seeds = s["paired"], s["seeds"]
        diff = p["difference_bpb"] if p else seeds.get("diff")
        if diff is None:
            continue
        label = f"{pair.variant} - {pair.reference}" + ("" if p else " (not paired)")
        rows.append((label, diff, p["ci95_bpb"] if p else None,
                     seeds.get("two_se")))
    return rows
