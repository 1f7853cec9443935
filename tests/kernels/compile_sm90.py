"""Compiles the weight-streaming GEMM kernels for sm_90 (the H200) without a GPU and prints the
shared memory each takes, as the launcher would see it, and its stack frame (registers spilled to
local memory, read from the cubin by the CUDA toolkit's cuobjdump that Triton ships): the helper of
tests/kernels/test_stream_gemm_configs.py, run in its own process because the test process defines
the kernels in Triton's interpreter (tests/conftest.py), where they cannot be compiled.

Reads a JSON list of {"kernel": "split_k" | "stream_k", "a": DTYPE, "b": DTYPE, "swiglu": bool,
"config": stream_gemm's config} from stdin; writes the list of {"shared": `metadata.shared`,
"stack": the kernel's stack frame}, in bytes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile

import triton
from cde.kernels.stream_gemm import _stream_gemm_kernel
from cde.kernels.stream_k import stream_k_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

POINTEE = {"bfloat16": "bf16", "float8_e4m3fn": "fp8e4nv"}
META = ("CTAS", "num_warps", "num_stages")


def compiled(case: dict) -> triton.compiler.CompiledKernel:
    config, a, b = case["config"], POINTEE[case["a"]], POINTEE[case["b"]]
    split_k = case["kernel"] == "split_k"
    fn = _stream_gemm_kernel if split_k else stream_k_kernel
    constexprs = {k: v for k, v in config.items() if k not in META}
    scaled = b == "fp8e4nv"  # FP8 weights carry channel scales; FP8 rows carry row scales
    constexprs.update(SCALE_A=a == "fp8e4nv", SCALE_B=scaled, PREFETCH=2)  # the engine's FP8 launches
    if split_k:
        constexprs.update(SWIGLU=case["swiglu"], TIMELINE=False)
    if not config["TMA"]:
        constexprs.update(a_desc=None, b_desc=None)
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name in ("a_desc", "b_desc"):
            rows = config["BLOCK_M"] if name == "a_desc" else config["BLOCK_N"]
            signature[name] = f"tensordesc<{a if name == 'a_desc' else b}[{rows}, {config['BLOCK_K']}]>"
            continue
        signature[name] = {"a_ptr": f"*{a}", "b_ptr": f"*{b}", "c_ptr": "*bf16", "count_ptr": "*i32"}.get(
            name, "*fp32" if name.endswith("_ptr") else "i32"
        )
        attrs[(i,)] = [["tt.divisibility", 16]]  # as the launcher specializes the 8b's aligned operands
    src = ASTSource(
        fn=fn,
        signature=signature,
        constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
        attrs=attrs,
    )
    options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def stack_bytes(kernel: triton.compiler.CompiledKernel) -> int:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [triton.knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1))


def usage(case: dict) -> dict:
    kernel = compiled(case)
    return {"shared": kernel.metadata.shared, "stack": stack_bytes(kernel)}


if __name__ == "__main__":
    print(json.dumps([usage(case) for case in json.load(sys.stdin)]))
