"""cde/commands/bench_instruments.py's kernel breakdown: device kernels sorted into the kinds
issue 29 weighs, by the names CUDA profiles give them (names as an H200 profile of the engine
printed them: cuBLAS's nvjet GEMMs, the split-K Triton GEMM, FlexAttention's template, top-k)."""

from cde.commands.bench_instruments import kernel_breakdown

KERNELS = [
    ("nvjet_sm90_tst_256x64_64x4_2x1_v_bz_splitK_TNT", 2000.0),
    ("_stream_gemm_kernel", 640.0),
    ("triton_tem_fused_flex_attention_0", 320.0),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(...)", 160.0),
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<...>", 64.0),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", 96.0),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", 32.0),  # the same kernel again: summed
    ("Memcpy DtoD (Device -> Device)", 16.0),
    ("ncclDevKernel_AllReduce", 8.0),
]


def test_kernels_are_summed_by_kind_per_step_largest_first():
    lines = kernel_breakdown(KERNELS, steps=32).splitlines()
    assert lines[0] == "-- device time by kind, ms per step (32 steps)"
    kinds = [line.split(":")[0] for line in lines[1:]]
    assert kinds == [
        "GEMM",
        "attention",
        "top-k and sorts",
        "other Triton (fused pointwise, norms, reductions)",
        "copies and fills",
        "other",
    ]
    gemm = lines[1]
    assert gemm.startswith("GEMM: 0.083 (79%): nvjet_sm90") and "_stream_gemm_kernel 0.020" in gemm
    assert lines[4].startswith("other Triton (fused pointwise, norms, reductions): 0.004 (4%)")  # 96 + 32 us / 32
    assert lines[3].startswith("top-k and sorts: 0.007 (7%)")


def test_no_kernels_gives_the_header_alone():
    assert kernel_breakdown([], steps=32) == "-- device time by kind, ms per step (32 steps)"
