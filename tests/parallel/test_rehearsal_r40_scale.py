"""Issue 25, rehearsal (b), `pytest -m scale` (not in CI; ~30 min and ~20 GB on the 2-core machine): the full
13-block r40 models through the same stages as rehearsal (a) (tests/parallel/test_rehearsal_r40.py) on 2 gloo
ranks with parallel.ep=2. Prints one `rehearsal {...}` JSON line of figures (stage seconds, save seconds, step
seconds, peak RSS per rank against the estimate, checkpoint size); docs/benchmarks.md records them."""
import pytest

from test_rehearsal_r40 import check_rehearsal, rehearse


@pytest.mark.scale
@pytest.mark.distributed
@pytest.mark.parametrize("name", ["nag-mod20-r40"])
def test_full_depth_r40_on_two_ranks_trains_resumes_evaluates_and_consolidates(name, paper_vocab_data, tmp_path):
    out = rehearse(name, paper_vocab_data, tmp_path, n_layers=13, timeout=3000)
    check_rehearsal(out, n_layers=13)
