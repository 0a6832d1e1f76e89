"""The report's expert-balance table (nagmoe/analysis/report_balance.py, issue 43): each cell is the hand-computed
reduction of the last logged step's router telemetry; fields written by someone else that are not numbers show
"-" and never fail the report."""
from nagmoe.analysis.report_balance import HEADERS, balance_row

ROUTER = {"max_over_mean_p50": 1.5, "max_over_mean_p90": 2.25, "max_over_mean_max": 3.0,
          "min_over_mean": [0.5, 0.25], "dead": [0, 2], "receive_peak_over_mean": 1.75,
          "dropped_frac": [0.1, 0.3], "rerouted_frac": [0.05, 0.15], "bias_range": [0.02, 0.04],
          "bias_flip_share": [0.5, 1.0]}


def test_each_cell_is_the_reduction_of_the_last_logged_step():
    metrics = [{"step": 1, "clip_coef": 0.5, "router": {"max_over_mean_p50": 9.0}},
               {"step": 2, "clip_coef": 1.0, "router": ROUTER}, {"step": 3, "clip_coef": None}]
    row = balance_row("nag (s0)", metrics)
    assert len(row) == len(HEADERS)
    assert row == ["nag (s0)", "1.50", "2.25", "3.00", "0.25", "2", "1.75", "20.0%", "10.0%", "0.04", "75%", "0.750"]


def test_no_router_telemetry_no_row_and_foreign_values_show_a_dash():
    assert balance_row("dense", [{"step": 1, "clip_coef": 1.0}]) is None
    foreign = {"max_over_mean_p50": "x" * 10 ** 5, "max_over_mean_p90": [], "max_over_mean_max": float("nan"),
               "min_over_mean": [1, None], "dead": True, "receive_peak_over_mean": {"a": 1},
               "dropped_frac": [[0.1]], "rerouted_frac": None}
    row = balance_row("odd", [{"step": 1, "clip_coef": "big", "router": foreign}])
    assert row[1:] == ["-"] * (len(HEADERS) - 1)
