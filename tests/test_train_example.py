"""examples/train_hybrid.py's reference run on a user's model file: built after seed 0, called with --inputs."""
from __future__ import annotations

import math

from hybrid_matrix import run_example

USER_MODEL = "tests/user_lm.py:make"  # a factory with no example_inputs() and no seed of its own


def test_user_model_file_without_example_inputs_trains_the_same_weights_twice() -> None:
    """Two reference runs on --inputs 4x16:long: no crash for want of example inputs, equal falling losses."""
    args = ["--dp", "1", "--tp", "1", "--pp", "1", "--model", USER_MODEL, "--inputs", "4x16:long", "--steps", "3",
            "--json"]
    first, second = run_example(args, timeout=300), run_example(args, timeout=300)
    assert first["losses"] == second["losses"]  # seed 0 before the user's factory: the same weights each time
    assert all(math.isfinite(x) for x in first["losses"]) and first["losses"][-1] < first["losses"][0]
