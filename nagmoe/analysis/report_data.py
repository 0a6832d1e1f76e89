"""What the report reads and computes from run dirs, before any drawing: one `RunRecord` per usable run dir
(config, metrics, summary, latest checkpoint, and the analysis / eval of that checkpoint), seed groups, the pairs
that make a comparison (NAG vs baseline, MoD vs full depth), seed spread and the noise rule.

Run dirs named `RUN-sSEED` (what `nagmoe experiment` writes) group by RUN; any other dir is its own group.
A dir that cannot be used (missing, no config.yaml, neither metrics nor a checkpoint) gives one message and is
left out; a dir with metrics but no checkpoint keeps its curves and numbers, without analysis and eval.

Noise rule (stated in the report): with at least two seeds on both sides, a difference of means is "inside the
noise" when it is below two standard errors, 2·sqrt(sd_a²/n_a + sd_b²/n_b); with one seed the seed noise is not
measured and the report says so. Eval accuracies also carry the binomial noise of a finite task,
sqrt(p(1-p)/N) per side, N = items x seeds.
"""
from __future__ import annotations

import json
import math
import os
import re
import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional

from nagmoe.analysis.report_cache import read_cache
from nagmoe.config import to_dict
from nagmoe.base.errors import UserError, one_line
from nagmoe.base.files import atomic_writer
from nagmoe.rundir.metrics import plain_json

PROBLEM_CHARS = 600  # one problem line of the report, at most
FINAL_LOSS_WINDOW = 10  # final training loss = mean over the last this many logged steps
CACHE_DIR = "data"  # under the report's out dir: per-run analysis/eval JSON, reused while the checkpoint is the same
# keys that do not change what a run is (for pairing runs into comparisons)
IGNORED_PREFIXES = ("train.seed", "train.flop_budget", "train.max_steps", "train.schedule_steps", "train.eval_every",
                    "train.checkpoint_every", "train.keep_checkpoints", "train.eval_tokens", "train.eval_sample",
                    "train.gc_every", "train.sync_every", "train.device", "data.prefetch", "train.checkpoint_async",
                    "train.milestone_dtype",
                    "train.compile", "train.micro_batch_tokens", "data.num_proc", "data.verify_shards",
                    "model.attention.impl", "model.moe.impl", "parallel.", "log.")
_LABEL = re.compile(r"^(?P<group>.+)-s(?P<seed>\d+)$")


@dataclass
class RunRecord:
    run_dir: str
    label: str
    group: str
    seed: Optional[int]
    config: object  # nagmoe.config.Config
    metrics: list
    summary: Optional[dict]
    checkpoint: Optional[str]
    run_info: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    analysis: Optional[dict] = None
    eval: Optional[dict] = None
    windows: Optional[object] = None  # nagmoe.eval.val_windows.WindowLosses of the final eval, when kept and usable
    windows_note: Optional[str] = None  # why there are none (old run dir, malformed or stale file)

    # -- final numbers (summary first, else the last logged step) -------------------------------------------
    def _last(self, key):
        for rec in reversed(self.metrics):
            if rec.get(key) is not None:
                return rec[key]
        return None

    @property
    def val_bpb(self) -> Optional[float]:
        if self.summary and self.summary.get("val_bpb") is not None:
            return self.summary["val_bpb"]
        return self._last("val_bpb")

    def final(self, key: str):
        """tokens / flops / steps / wall_time_s."""
        if self.summary and self.summary.get(key) is not None:
            return self.summary[key]
        return self._last({"steps": "step"}.get(key, key)) if key != "wall_time_s" else None

    @property
    def final_loss(self) -> Optional[float]:
        losses = [r["loss"] for r in self.metrics if r.get("loss") is not None][-FINAL_LOSS_WINDOW:]
        return sum(losses) / len(losses) if losses else None

    @property
    def skip_rate(self) -> float:
        return float((self.summary or {}).get("skip_rate") or self._last("skip_rate") or 0.0)

    @property
    def tokens_per_s(self) -> Optional[float]:
        values = [r["tokens_per_s"] for r in self.metrics if r.get("tokens_per_s")]
        return statistics.median(values) if values else None

    @property
    def val_loss(self) -> Optional[float]:
        return (self.analysis or {}).get("val_loss")

    @property
    def eval_accuracy(self) -> Optional[tuple]:
        """(accuracy, centred, examples) of the first eval task."""
        tasks = (self.eval or {}).get("tasks") or []
        return (tasks[0]["accuracy"], tasks[0]["centred"], tasks[0]["examples"]) if tasks else None


# ----------------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------------
def read_run(run_dir: str) -> tuple[Optional[RunRecord], list]:
    """(record or None, messages). None when the dir cannot be used at all: missing, no config.yaml, neither
    metrics nor a checkpoint, or a file that fails its schema (config.yaml, metrics.jsonl, summary.json,
    run_info.json: one message naming the file and field)."""
    from nagmoe.checkpoint import latest_valid_checkpoint
    from nagmoe.rundir.info import CONFIG_FILE, SUMMARY_FILE, read_run_info, read_saved_config, read_summary
    from nagmoe.rundir.metrics import METRICS_FILE, read_metrics

    where = one_line(run_dir, 500)  # the dir as the Problems section names it: one bounded line
    if not os.path.isdir(run_dir):
        return None, [f"{where}: not found (not trained yet?); left out"]
    try:
        cfg = read_saved_config(run_dir)
    except Exception as e:  # a torn or foreign config.yaml: UserError, or whatever a parser raised
        return None, [f"{where}: unreadable {CONFIG_FILE} ({problem_text(e)}); left out"]
    if cfg is None:
        return None, [f"{where}: not a run dir (no {CONFIG_FILE}); left out"]
    try:
        metrics = read_metrics(os.path.join(run_dir, METRICS_FILE))
        summary = read_summary(run_dir)
        run_info = read_run_info(run_dir) or {}
    except UserError as e:  # each names the file, line and field
        return None, [f"{where}: {problem_text(e)}; left out"]
    try:
        checkpoint = latest_valid_checkpoint(run_dir)
    except Exception as e:
        checkpoint = None
        notes = [f"checkpoints unreadable ({problem_text(e)})"]
    else:
        notes = []
    if not metrics and checkpoint is None:
        return None, [f"{where}: no metrics.jsonl and no valid checkpoint: the run has not trained a step; "
                      "left out"]
    if not metrics:
        notes.append("no metrics.jsonl: no curves, no final loss")
    if checkpoint is None:
        notes.append("no valid checkpoint under checkpoints/: no depth analysis, compute dial or eval score")
    if summary is None:
        notes.append(f"unfinished (no {SUMMARY_FILE}): numbers are from the last logged step")
    windows, windows_note, problem = read_windows(run_dir, summary)
    name = os.path.basename(os.path.normpath(run_dir))
    m = _LABEL.match(name)
    group, seed = (m.group("group"), int(m.group("seed"))) if m else (name, cfg.train.seed)
    record = RunRecord(os.path.abspath(run_dir), name, group, seed, cfg, metrics, summary, checkpoint, run_info,
                       notes, windows=windows, windows_note=windows_note)
    return record, [f"{where}: {n}" for n in notes] + ([f"{where}: {problem}"] if problem else [])


def read_windows(run_dir: str, summary: Optional[dict]) -> tuple:
    """(WindowLosses or None, why none, a Problems line or None): the final eval's kept per-window losses, used
    only when they are of the run's last step (a run trained on after them would pair stale numbers)."""
    from nagmoe.eval.val_windows import read_window_losses
    from nagmoe.rundir.names import EVAL_WINDOWS_FILE

    try:
        windows = read_window_losses(run_dir)
    except UserError as e:  # a foreign or torn file: named once, the run still reports, unpaired
        return None, f"{EVAL_WINDOWS_FILE} unusable", f"{problem_text(e)}; not paired"
    if windows is None:
        return None, f"no {EVAL_WINDOWS_FILE} (a run dir from before per-window losses were kept)", None
    steps = (summary or {}).get("steps")
    if steps is not None and windows.step is not None and windows.step != steps:
        return None, f"{EVAL_WINDOWS_FILE} is of step {windows.step}, the run ended at step {steps}", None
    return windows, None, None


def problem_text(error: BaseException) -> str:
    """An exception as a bounded line for the Problems section: a UserError's message (it names the file and
    field), anything else with its type; at most a few hundred characters, whatever the exception holds."""
    text = str(error)[:PROBLEM_CHARS]
    text = text if isinstance(error, UserError) else f"{type(error).__name__}: {text}"
    return one_line(text, PROBLEM_CHARS)


def unique_labels(records: list) -> None:
    """Same dir name twice (two experiments): prefix the parent dir's name."""
    seen: dict = {}
    for r in records:
        seen.setdefault(r.label, []).append(r)
    for label, rs in seen.items():
        if len(rs) > 1:
            for r in rs:
                parent = os.path.basename(os.path.dirname(r.run_dir))
                r.label, r.group = f"{parent}/{r.label}", f"{parent}/{r.group}"


# ----------------------------------------------------------------------------------------------------------
# Measuring checkpoints (cached per run under OUT/data/)
# ----------------------------------------------------------------------------------------------------------
def has_milestones(run_dir: str) -> bool:
    """Weights-only milestones (milestones/) or full ones (checkpoints marked so): nagmoe.checkpoint.milestone."""
    from nagmoe.checkpoint import list_milestones

    return bool(list_milestones(run_dir))


def measure_checkpoint(record: RunRecord, out_dir: str, analysis_tokens: int, eval_items: int, device: str,
                       log: Callable[[str], None]) -> list:
    """Fill record.analysis / record.eval from the latest checkpoint (or the cache); returns problem messages."""
    if record.checkpoint is None or (analysis_tokens == 0 and eval_items == 0):
        return []
    cache_path = os.path.join(out_dir, CACHE_DIR, record.label.replace("/", "__") + ".json")
    problems = []
    try:
        cache = read_cache(cache_path) or {}
    except UserError as e:  # a planted or foreign file in a shared --out dir: named, and the run measured again
        problems.append(f"{record.label}: report cache {problem_text(e)}; measured again")
        cache = {}
    same = cache.get("run_dir") == record.run_dir and cache.get("checkpoint") == record.checkpoint
    if analysis_tokens:
        if (same and cache.get("analysis_tokens") == analysis_tokens and cache.get("analysis")
                and "router" in cache["analysis"]):  # analyses cached before the router section: redo
            record.analysis = cache["analysis"]
        else:
            log(f"[report] {record.label}: analysing {os.path.basename(record.checkpoint)} on {analysis_tokens} "
                "validation tokens")
            try:
                from nagmoe.analysis.run_analysis import analyze_run

                record.analysis = plain_json(analyze_run(record.run_dir, device, analysis_tokens))
                if has_milestones(record.run_dir):  # through training (train.keep_milestone_every_tokens)
                    from nagmoe.analysis.run_analysis import analyze_milestones

                    record.analysis["through_training"] = plain_json(
                        analyze_milestones(record.run_dir, device, analysis_tokens))
            except Exception as e:
                problems.append(f"{one_line(record.run_dir, 500)}: depth analysis failed ({problem_text(e)})")
    if eval_items:
        if same and cache.get("eval_items") == eval_items and cache.get("eval"):
            record.eval = cache["eval"]
        else:
            log(f"[report] {record.label}: eval (shakespeare next-line task, {eval_items} items)")
            try:
                record.eval = plain_json(run_eval(record.run_dir, device, eval_items))  # NaN -> null
            except Exception as e:
                problems.append(f"{one_line(record.run_dir, 500)}: eval failed ({problem_text(e)})")
    os.makedirs(os.path.dirname(cache_path), exist_ok=True)
    with atomic_writer(cache_path) as f:  # a fresh temporary, renamed (nagmoe.base.files)
        json.dump({"run_dir": record.run_dir, "checkpoint": record.checkpoint,
                   "analysis_tokens": analysis_tokens, "analysis": record.analysis,
                   "eval_items": eval_items, "eval": record.eval}, f)
    return problems


def run_eval(run_dir: str, device: str, items: int) -> dict:
    """The offline Shakespeare next-line task (nagmoe eval's default) on the run's latest checkpoint."""
    from nagmoe.eval.task_specs import OFFLINE_TASK, resolve_tasks
    from nagmoe.eval.core import evaluate_tasks, tokenizer_encoder
    from nagmoe.eval.generate import load_run

    run = load_run(run_dir, device)
    tasks = resolve_tasks([OFFLINE_TASK], run.config.data.val_fraction, offline_items=items)
    return evaluate_tasks(run.model, tasks, tokenizer_encoder(run.tokenizer), run.bos_id, device,
                          max_len=run.config.model.max_seq_len)


# ----------------------------------------------------------------------------------------------------------
# Groups, pairs, spread
# ----------------------------------------------------------------------------------------------------------
def group_records(records: list) -> dict:
    """{group: [records in seed order]}, groups in first-seen order."""
    groups: dict = {}
    for r in records:
        groups.setdefault(r.group, []).append(r)
    return {g: sorted(rs, key=lambda r: (r.seed is None, r.seed)) for g, rs in groups.items()}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_difference(a, b) -> set:
    """Config keys that differ between two runs, ignoring seeds, budgets, schedule and bookkeeping keys."""
    fa, fb = _flat(to_dict(a)), _flat(to_dict(b))
    return {k for k in set(fa) | set(fb)
            if fa.get(k) != fb.get(k) and not any(k.startswith(p) for p in IGNORED_PREFIXES)}


@dataclass
class Pair:
    kind: str  # "nag_vs_baseline" | "mod_vs_full" | "vs_first"
    reference: str  # group name
    variant: str
    differs: list


def find_pairs(groups: dict) -> list:
    """Comparisons the configs make meaningful: runs that differ only in model.residual (NAG vs baseline), or
    only in model.mod.* with one at skip rate 0 (MoD vs full depth). Without any, every group vs the first."""
    names = list(groups)
    pairs = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ca, cb = groups[a][0].config, groups[b][0].config
            diff = config_difference(ca, cb)
            if diff == {"model.residual"}:
                ref, var = (a, b) if ca.model.residual == "prenorm" else (b, a)
                pairs.append(Pair("nag_vs_baseline", ref, var, sorted(diff)))
            elif diff and all(k.startswith("model.mod.") for k in diff):
                sa, sb = ca.model.mod.skip_rate, cb.model.mod.skip_rate
                if (sa == 0) != (sb == 0):
                    ref, var = (a, b) if sa == 0 else (b, a)
                    pairs.append(Pair("mod_vs_full", ref, var, sorted(diff)))
    if not pairs and len(names) > 1:
        first = groups[names[0]][0].config
        pairs = [Pair("vs_first", names[0], n, sorted(config_difference(first, groups[n][0].config)))
                 for n in names[1:]]
    return pairs


def mean_sd(values) -> tuple:
    """(mean, sd or None, n) of the known values; (None, None, 0) when there is none."""
    known = [v for v in values if v is not None]
    if not known:
        return None, None, 0
    return statistics.fmean(known), (statistics.stdev(known) if len(known) > 1 else None), len(known)


def noise_statement(ref_values, var_values, what: str = "val bpb", unit: str = "",
                    names: tuple = ("the variant", "the reference")) -> dict:
    """The difference variant - reference of the seed means (lower is better), its standard error over the
    seeds, the smallest difference those seeds resolve (two standard errors) and a verdict worded by it:
    "nag ahead of baseline by 0.0210 ± 0.0040 nats" or "below what 3 and 3 seeds resolve"."""
    ma, sa, na = mean_sd(ref_values)
    mb, sb, nb = mean_sd(var_values)
    if ma is None or mb is None:
        return {"diff": None, "inside_noise": None, "text": f"no {what} on one side"}
    diff = mb - ma
    if na < 2 or nb < 2:
        return {"diff": diff, "inside_noise": None, "two_se": None, "se": None,
                "text": f"one seed on {'both sides' if na < 2 and nb < 2 else 'one side'}: the seed-to-seed noise "
                        f"is not measured, so this {what} difference cannot be told apart from noise (run more "
                        "seeds)"}
    se = math.sqrt(sa ** 2 / na + sb ** 2 / nb)
    two_se = 2 * se
    inside = abs(diff) < two_se or (two_se == 0 and diff == 0)
    variant, reference = names
    seeds = f"{nb} and {na} seeds" if na != nb else f"{na} seeds"
    if inside:
        text = (f"below what {seeds} resolve: |difference| {abs(diff):.4f}{unit} < {two_se:.4f}{unit}, the smallest "
                f"difference they resolve (two standard errors; one standard error {se:.4f}{unit})")
    else:
        text = (f"{variant} {'ahead of' if diff < 0 else 'behind'} {reference} by {abs(diff):.4f} ± {se:.4f}{unit} "
                f"(± one standard error of {seeds}; they resolve differences above {two_se:.4f}{unit})")
    return {"diff": diff, "inside_noise": inside, "two_se": two_se, "se": se, "text": text}


def accuracy_noise(ref: tuple, var: tuple) -> dict:
    """Eval accuracies (p, N items in total) of two groups: inside the binomial noise of a finite task?"""
    (pa, na), (pb, nb) = ref, var
    diff = pb - pa
    two_se = 2 * math.sqrt(pa * (1 - pa) / na + pb * (1 - pb) / nb)
    inside = abs(diff) < two_se or (two_se == 0 and diff == 0)
    return {"diff": diff, "inside_noise": inside, "two_se": two_se,
            "text": f"{'inside' if inside else 'outside'} the noise of a {na}- and {nb}-item task: |difference| "
                    f"{abs(diff):.3f} vs two binomial standard errors {two_se:.3f}"}
