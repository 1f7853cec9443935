"""The split-K GEMM's tile limits (kernels/stream_gemm.py), importable without Triton: its callers
decide from them which calls it may take."""

MAX_ROWS = 64  # one row tile: calls of at most one request
MIN_BLOCK_N = 32  # the narrowest output tile: at most cdiv(N, 32) tiles, one counter each
K_MULTIPLE = 256  # the largest K tile: K must be a multiple of it
MAX_SPLIT_K = 8
