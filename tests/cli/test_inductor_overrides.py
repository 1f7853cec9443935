"""`cde bench engine --inductor KEY=VALUE` (cde/commands/inductor_overrides.py): torch's own
Inductor config is the reference for which keys exist and what type each takes."""

import subprocess
import sys

import pytest
import torch._inductor.config as inductor_config

from cde.commands.inductor_overrides import apply_inductor_overrides, parse_inductor_overrides


def test_literals_of_the_options_type_are_parsed_and_set_dotted_keys_too() -> None:
    overrides = parse_inductor_overrides(["combo_kernels=True", "triton.cudagraph_trees=False"])
    assert overrides == {"combo_kernels": True, "triton.cudagraph_trees": False}
    with inductor_config.patch({"combo_kernels": False, "triton.cudagraph_trees": True}):
        apply_inductor_overrides(overrides)
        assert inductor_config.combo_kernels is True
        assert inductor_config.triton.cudagraph_trees is False


@pytest.mark.parametrize(
    "item,reason",
    [
        ("combo_kernel=True", "has no option 'combo_kernel'"),
        ("triton.nope=1", "has no option 'triton.nope'"),
        ("combo_kernels", "expected KEY=VALUE"),
        ("combo_kernels=yes", "is not a Python literal"),
        ("combo_kernels=1", "combo_kernels takes a bool"),
    ],
)
def test_what_would_be_ignored_or_mistyped_is_refused(item: str, reason: str) -> None:
    with pytest.raises(SystemExit, match=reason):
        parse_inductor_overrides([item])


def test_the_bench_refuses_it_before_loading_a_model() -> None:
    cmd = [sys.executable, "-m", "cde", "bench", "engine", "--preset", "tiny", "--device", "cpu"]
    res = subprocess.run([*cmd, "--inductor", "combo_kernel=True"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    assert "has no option 'combo_kernel'" in res.stderr and "wrote random" not in res.stdout
