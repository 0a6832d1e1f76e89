"""The fuzz of tests/base/test_bounded_messages.py, run as its own process: under a 1 GiB address-space
limit, every case (a config file value, a command-line override or an experiment field holding an alias bomb,
deep nesting, a huge number or string, control characters, a container where a scalar belongs) runs through the
CLI's `main` in this process with a 20 s alarm. Prints one JSON object: the case count, the longest stderr line,
and the cases that broke a promise (a line over 4,000 characters, an exception other than UserError escaping
main, a timeout, a MemoryError)."""
import contextlib
import io
import json
import os
import resource
import signal
import sys
import tempfile

LIMIT_BYTES = 1 << 30
CASE_S = 20
MAX_LINE = 4000


def bomb(levels: int, width: int = 9) -> str:
    """A flow sequence defining `levels` anchors, each a list of `width` aliases of the previous one:
    width**levels values once expanded, a few hundred bytes as text."""
    parts = ["&a0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        parts.append(f"&a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "[" + ", ".join(parts) + "]"


def payloads() -> list:
    out = [bomb(n) for n in range(1, 11)]
    out += ["[" * n + "]" * n for n in (10, 70, 1000, 5000, 100_000)]
    out += ["{" * n + "}" * n for n in (70, 5000)]
    out += ['"' + "x" * 100_000 + '"', '"\\e[31m\\nline two\\r\\u2028"', "9" * 5001, "-" + "9" * 4301, "1e23",
            "1e400", "1099511627776", "-1", ".nan", ".inf", "{a: 1, a: 2}", "null", "true", "off", "[1]",
            "{x: [1, 2]}", "!!python/object:os.system x", "&x [*x]", "*undefined", "'unterminated"]
    return out


KEYS = ["train.seed", "model.d_model", "train.lr_matrix", "train.compile", "log.wandb", "data.corpus", "model.moe",
        "model.mod.p_thres", "unknown.key", "inherit"]  # an int, a size, a float, a tristate, a choice, a string,
# a section, an optional float, a typo, the inherit list
EXP_FIELDS = ["seeds", "flop_budget", "name", "overrides", "run_overrides", "report", "include", "description",
              "runs", "flop_convention"]


def config_text(key: str, payload: str, tiny: str) -> str:
    if key == "inherit":
        return f"inherit: {payload}\n"
    parts = key.split(".")
    lines = [f"inherit: {json.dumps(tiny)}"]
    for depth, part in enumerate(parts[:-1]):
        lines.append("  " * depth + f"{part}:")
    lines.append("  " * (len(parts) - 1) + f"{parts[-1]}: {payload}")
    return "\n".join(lines) + "\n"


def experiment_text(field: str, payload: str, tiny: str) -> str:
    base = {"name": "fuzz", "flop_budget": "1e12", "seeds": "[0]", "description": "x", "flop_convention": "matmul"}
    runs = f"runs:\n  nag:\n    config: {json.dumps(tiny)}\n"
    if field in base:
        base[field] = payload
    lines = [f"{k}: {v}" for k, v in base.items()]
    if field == "overrides":
        lines.append(f"overrides: [{json.dumps('train.seed=' + payload[:200_000])}, {payload}]")
    elif field == "report":
        lines.append(f"report: {{eval_items: {payload}}}")
    elif field == "include":
        lines.append(f"include: {payload}")
    if field == "runs":
        runs = f"runs: {payload}\n"
    elif field == "run_overrides":
        runs += f"    overrides: {payload}\n"
    return "\n".join(lines) + "\n" + runs


def run_case(args: list) -> dict:
    from nagmoe.cli import main

    err = io.StringIO()
    outcome = {"args": [a[:120] for a in args]}
    signal.alarm(CASE_S)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                outcome["exit"] = main(args)
            except SystemExit as e:
                outcome["exit"] = e.code
    except BaseException as e:  # what escaped main: a broken promise (the alarm's TimeoutError included)
        outcome["escaped"] = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        signal.alarm(0)
    lines = err.getvalue().splitlines() or [""]
    outcome["longest"] = max(len(line) for line in lines)
    return outcome


def _timeout(signum, frame):
    raise TimeoutError(f"case ran past {CASE_S} s")


def main_driver(repo: str) -> dict:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))
    signal.signal(signal.SIGALRM, _timeout)
    tiny = os.path.join(repo, "configs", "tiny.yaml")
    cases, broken, longest = 0, [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, payload in enumerate(payloads()):
            for key in KEYS:
                path = os.path.join(tmp, f"c{i}.yaml")
                with open(path, "w", encoding="utf-8") as f:
                    f.write(config_text(key, payload, tiny))
                runs = [["config", "--config", path]]
                if key != "inherit":
                    runs.append(["config", "--config", tiny, f"{key}={payload}"])
                for args in runs:
                    out = run_case(args)
                    cases, longest = cases + 1, max(longest, out["longest"])
                    if "escaped" in out or out["longest"] > MAX_LINE:
                        broken.append(out)
            for field in EXP_FIELDS:
                path = os.path.join(tmp, f"e{i}.yaml")
                with open(path, "w", encoding="utf-8") as f:
                    f.write(experiment_text(field, payload, tiny))
                out = run_case(["experiment", path, "--slurm", "--dry-run", "--runs-root", os.path.join(tmp, "runs")])
                cases, longest = cases + 1, max(longest, out["longest"])
                if "escaped" in out or out["longest"] > MAX_LINE:
                    broken.append(out)
    return {"cases": cases, "longest_line": longest, "broken": broken[:30], "n_broken": len(broken)}


if __name__ == "__main__":
    print(json.dumps(main_driver(sys.argv[1])))
