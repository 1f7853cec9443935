"""kernels/stream_gemm_configs.py's shared-memory pruning against the compiler: the weight-streaming
GEMMs compiled for sm_90 (the H200) on the CPU (tests/kernels/compile_sm90.py, its own process).
At the boundary of every operand kind the smallest pruned config does not fit a CTA's shared memory
and every compiled kernel takes at least `pipeline_bytes`, so the pruning drops only configs that
could never launch; for same-dtype operands (the engine's default paths) the largest kept config
fits, so it drops all of those. The bound counts every stage in flight, so a kernel that Triton
stopped pipelining (one buffer, not num_stages) fails it too. Widening FP8 weights beside
bfloat16 rows (`--fp8-weight-only-rows`) takes a bfloat16 copy of some weight tiles besides, which
the bound leaves out: a kept config may still fail there, and the warm-up tuning skips it, as it
skips any config that fails to build. And no split-K config spills registers: its last share sums
the others' partial tiles one at a time, however many there are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cde.kernels import stream_gemm_configs as configs
from cde.kernels.stream_tiles import MAX_SPLIT_K

HELPER = Path(__file__).with_name("compile_sm90.py")
SM90_OPTIN = 232448  # CUDA's sharedMemPerBlockOptin on sm_90 (227 KB), which Triton's launcher checks

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
CASES = {  # operand kind: (a's dtype, b's dtype, SwiGLU)
    "bfloat16": (BF16, BF16, False),
    "bfloat16 SwiGLU": (BF16, BF16, True),
    "FP8": (FP8, FP8, False),
    "FP8 weights beside bfloat16 rows": (BF16, FP8, False),
}


def offered(a: torch.Tensor, b: torch.Tensor, swiglu: bool) -> list[tuple[str, dict]]:
    """Every (kernel, config) the engine offers these operands before the shared-memory pruning."""
    widened, tma = a.dtype != b.dtype, configs.tma_fits(a, b)
    out = [
        ("split_k", {**c.kwargs, "TMA": tma, "num_warps": c.num_warps, "num_stages": c.num_stages})
        for c in configs.autotune_configs()
        if widened or not c.kwargs["SWAP_AB"]
    ]
    if not (widened or swiglu):
        out += [("stream_k", c) for c in configs.stream_k_configs(configs.programs(a.device), tma)]
    return out


def operands(case: str) -> dict:
    """A case's operand fields as compile_sm90.py reads them."""
    a_dtype, b_dtype, swiglu = CASES[case]
    return {"a": str(a_dtype).removeprefix("torch."), "b": str(b_dtype).removeprefix("torch."), "swiglu": swiglu}


def boundary(case: str) -> list[tuple[dict, bool]]:
    """Per kernel and operand order, the largest kept config and the smallest pruned one (as
    compile_sm90.py's cases), each with whether it was kept."""
    a_dtype, b_dtype, swiglu = CASES[case]
    a, b = torch.zeros(64, 4096, dtype=a_dtype), torch.zeros(4096, 4096, dtype=b_dtype)
    groups: dict[tuple[str, bool, bool], list[dict]] = {}
    for kernel, config in offered(a, b, swiglu):
        kept = configs.fits(config, a, b, swiglu)
        groups.setdefault((kernel, config.get("SWAP_AB", False), kept), []).append(config)

    def size(config: dict) -> int:
        return configs.pipeline_bytes(config, a.element_size(), b.element_size(), swiglu)

    return [
        ({"kernel": kernel, **operands(case), "config": (max if kept else min)(members, key=size)}, kept)
        for (kernel, _, kept), members in groups.items()
    ]


def compiled_usage(cases: list[dict]) -> list[dict]:
    """compile_sm90.py's {"shared", "stack"} bytes per case."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, str(HELPER)], input=json.dumps(cases), capture_output=True, text=True, env=env, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_hopper_limit_is_the_one_the_launcher_checks() -> None:
    assert configs.SM90_SHARED_BYTES == SM90_OPTIN
    assert configs.shared_limit(torch.device("cpu")) == SM90_OPTIN


@pytest.mark.parametrize("case", CASES)
def test_pruning_keeps_what_fits_and_drops_only_what_cannot_launch(case: str) -> None:
    picked = boundary(case)
    assert any(kept for _, kept in picked)
    usage = compiled_usage([c for c, _ in picked])
    for (c, kept), took in zip(picked, (u["shared"] for u in usage)):
        a, b = torch.zeros(1, dtype=CASES[case][0]), torch.zeros(1, dtype=CASES[case][1])
        bound = configs.pipeline_bytes(c["config"], a.element_size(), b.element_size(), c["swiglu"])
        assert took >= bound, (c, took, bound)  # a lower bound: never prunes what fits
        if not kept:
            assert took > SM90_OPTIN, (c, took)
        elif c["a"] == c["b"]:  # same-dtype operands: the bound is the tiles' bytes, exact but for barriers
            assert took <= SM90_OPTIN, (c, took)


@pytest.mark.parametrize("case", CASES)
def test_the_widest_tile_at_the_deepest_split_spills_no_register(case: str) -> None:
    """The split-K config with the most accumulator registers per thread (the widest output tile)
    at the most shares: its epilogue once loaded every share's partial tile before adding them
    (an unrolled loop), 255 registers and up to 1.2 KB spilled to local memory per thread on sm_90;
    summed one share at a time, it takes as few registers as an unsplit config and spills none."""
    a_dtype, b_dtype, swiglu = CASES[case]
    a, b = torch.zeros(64, 4096, dtype=a_dtype), torch.zeros(4096, 4096, dtype=b_dtype)
    kept = [c for k, c in offered(a, b, swiglu) if k == "split_k" and configs.fits(c, a, b, swiglu)]
    widest = max(kept, key=lambda c: (c["BLOCK_N"], c["SPLIT_K"], -c["BLOCK_K"]))
    assert widest["SPLIT_K"] == MAX_SPLIT_K
    (usage,) = compiled_usage([{"kernel": "split_k", **operands(case), "config": widest}])
    assert usage["stack"] == 0, (widest, usage)
