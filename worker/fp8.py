"""FP8 (e4m3) weights for the transformer's linear layers (`--quantization fp8`).

At load, every block's attention `c_attn`/`c_proj` and MLP `c_fc`/`c_proj` is replaced by an
`Fp8Linear`: the bfloat16 weight [N, K] becomes float8_e4m3fn with one float32 scale per output
channel (row), scale = amax(|row|) / 448, so every row uses the whole e4m3 range. Embeddings, the
LM head and the concept heads stay bfloat16 (attribution and steering read them).

Each call picks its path by its row count (64 rows per item, so per batch bucket):
- weight-only (rows <= `weight_only_rows`, default 0: never): the activations stay bfloat16; at
  most MAX_ROWS rows by the Triton GEMM, which widens each FP8 weight tile in registers and applies
  the channel scales to its float32 sums (`cde::fp8_weight_matmul`); more rows (or a K it cannot
  tile) dequantize the weight to bfloat16 inside the compiled graph for a bfloat16 GEMM;
- scaled (more rows): the activations are quantized per token (row) inside the compiled graph,
  scale = amax(|row|) / 448, and multiplied with row-wise scales: at most MAX_ROWS rows by
  the Triton GEMM of kernels/stream_gemm.py (cuBLAS reads the weights at half the bandwidth there),
  more by `torch._scaled_mm` (scale_a [M, 1], scale_b [1, N], float32; bfloat16 out).
The MLP's `silu(gate) * up` is quantized by one fused op on its way to c_proj (`Fp8MLP`), a
post-norm block's two residuals by another, on their way to c_fc and to the next block's c_attn
(`Fp8Block`), and at one request attention's output by a third on its way to c_proj (`Fp8Attention`).
On the CPU the ops of kernels/fp8_ops.py emulate the GPU's: the same e4m3 rounding
(float8_e4m3fn casts) and the same scales, multiplied in float32. So the CPU tests cover the
quantizer, the path choice and the accuracy of every path; the GPU tests measure the real kernels.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.nn.functional as F
from cde.kernels.fp8_ops import (
    add_norm_quantize,
    fp8_matmul,
    fp8_weight_matmul,
    heads_quantize,
    quantize_rows,
    silu_mul_quantize,
)
from cde.kernels.stream_ops import swiglu, tile_counters
from cde.kernels.stream_tiles import K_MULTIPLE, MAX_ROWS
from cde.shared.config import FP8_WEIGHT_ONLY_ROWS, PAGE
from cde.worker.cuda_graphs import BUCKETS
from cde.worker.model import BLOCK_LINEARS, Attention, Block, HandedOn

QUANTIZATIONS = ("none", "fp8")
MIN_CAPABILITY = (8, 9)  # Ada, Hopper and later have e4m3 tensor cores
# At most MAX_ROWS rows (one request) go through the Triton GEMM (kernels/stream_gemm.py), more
# through cuBLAS (`torch._scaled_mm`). H200, the 8b's 32-layer linear stack (docs/benchmarks.md):
# 64 rows 2.42 ms vs 3.64 ms; 128 rows 3.90 vs 3.66; 256 rows 6.93 vs 4.81.

log = logging.getLogger("cde.fp8")


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 q * scale (scale broadcast: [N, 1] per row)."""
    return q.float() * scale


class Fp8Linear(nn.Module):
    """A bias-free linear layer with an e4m3 weight [N, K] and per-output-channel float32 scales [N]."""

    weight: torch.Tensor  # buffers, typed for the checker (nn.Module's __getattr__ says Tensor | Module)
    scale: torch.Tensor
    counters: torch.Tensor

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, weight_only_rows: int = FP8_WEIGHT_ONLY_ROWS):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        # The Triton GEMM's split-K tile counters (kernels/stream_gemm.py): scratch, not state.
        self.register_buffer("counters", tile_counters(self.out_features, weight.device), persistent=False)
        self.weight_only_rows = weight_only_rows
        # CUDA runs torch._scaled_mm; anything else emulates it in float32 (CPU tests).
        self.emulate = weight.device.type != "cuda"

    @classmethod
    def from_linear(cls, linear: nn.Linear, weight_only_rows: int = FP8_WEIGHT_ONLY_ROWS) -> Fp8Linear:
        if linear.bias is not None:
            raise ValueError("Fp8Linear has no bias")
        with torch.no_grad():
            q, scale = quantize_rows(linear.weight)
        return cls(q, scale[:, 0].contiguous(), weight_only_rows)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"weight_only_rows={self.weight_only_rows}"
        )

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows <= self.weight_only_rows:
            if path_for_rows(rows, 0, self.in_features) == "triton":  # the CPU takes the GPU's path
                out = fp8_weight_matmul(x.reshape(rows, self.in_features), self.weight, self.scale, self.counters)
                return out.reshape(*x.shape[:-1], self.out_features)
            # More rows than the Triton GEMM takes: dequantized in the graph (one fused pointwise
            # kernel that writes a bfloat16 copy of the weight), then a bf16 GEMM.
            return F.linear(x, self.dequantized(x.dtype))
        xq, x_scale = quantize_rows(x.reshape(rows, self.in_features))  # per token, fused into the compiled graph
        return self.matmul(xq, x_scale[:, 0], x.dtype).reshape(*x.shape[:-1], self.out_features)

    def matmul(self, xq: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """e4m3 rows [M, K] with their float32 scales [M] -> [M, N] in dtype."""
        if self.emulate or path_for_rows(xq.shape[0], 0, self.in_features) == "triton":
            return fp8_matmul(xq, x_scale, self.weight, self.scale, self.counters, dtype)
        return torch._scaled_mm(
            xq,
            self.weight.t(),  # column-major [K, N], as the FP8 GEMM wants its second operand
            scale_a=x_scale[:, None],
            scale_b=self.scale[None, :],
            out_dtype=dtype,
            # The tensor cores' own accumulation, without cuBLAS's periodic promotion to float32
            # (vLLM's and torchao's inference choice): the 32-layer stack at 2,048 rows 27.7 ->
            # 25.0 ms on the H200, 3.9e-03 relative to the promoted sums, far below the
            # quantization's own error (docs/benchmarks.md, 2026-12-03 11:14).
            use_fast_accum=True,
        )


class Fp8MLP(nn.Module):
    """The MLP on Fp8Linear layers: `silu(gate) * up` goes to c_proj quantized by one fused op
    (`cde::silu_mul_quantize`) instead of being written in bfloat16 and quantized again."""

    def __init__(self, c_fc: Fp8Linear, c_proj: Fp8Linear):
        super().__init__()
        self.c_fc, self.c_proj = c_fc, c_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        rows = h.numel() // h.shape[-1]
        if rows <= self.c_proj.weight_only_rows:
            return self.c_proj(swiglu(h))
        return self.project(h.reshape(rows, h.shape[-1])).reshape(*x.shape[:-1], self.c_proj.out_features)

    def quantized(self, xq: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The MLP of e4m3 rows [M, K] with their float32 scales [M] -> [M, K] in dtype."""
        return self.project(self.c_fc.matmul(xq, x_scale, dtype))

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """c_fc's output [M, 2F] -> c_proj of `silu(gate) * up`, quantized by the fused op."""
        q, scale = silu_mul_quantize(h)
        return self.c_proj.matmul(q, scale, h.dtype)


class Fp8Attention(Attention):
    """Attention on Fp8Linear layers. Where c_proj runs the Triton GEMM (one request), the output's
    heads are joined and quantized by one kernel (`cde::heads_quantize`) that reads them where the
    attention left them and signals the GEMM to start fetching its weights, as the kernels before
    the other three FP8 GEMMs do. More rows keep the compiled join and quantization: the kernel
    there would need the heads copied first (the attention's output is a view only for one item),
    and cuBLAS fetches nothing early."""

    def project(self, y: torch.Tensor) -> torch.Tensor:
        n, _, t, _ = y.shape
        rows, c_proj = n * t, self.c_proj
        if rows <= c_proj.weight_only_rows or path_for_rows(rows, 0, c_proj.in_features) != "triton":
            return super().project(y)
        q, scale = heads_quantize(y)
        return c_proj.matmul(q, scale, y.dtype).reshape(n, t, c_proj.out_features)


class Fp8Block(Block):
    """A post-norm block whose residuals come with their rows quantized for the next linear, each
    from one fused op (`cde::add_norm_quantize`): after attention, x + ln_1(a) for c_fc; at the
    end, x + ln_2(m) plus the steering for the next block's c_attn, handed on with x. The rows are
    read once, where the compiled graph read them twice (the norm, then the add and the
    quantization, two looped reductions) or, at the end, in the next block again."""

    def attn_input(self, x: torch.Tensor, handed: HandedOn) -> torch.Tensor:
        if handed is None:  # the first block, or bfloat16 rows
            return super().attn_input(x, handed)
        return self.attn.c_attn.matmul(*handed, x.dtype).reshape(*x.shape[:-1], -1)

    def residual_out(
        self, x: torch.Tensor, m: torch.Tensor, inject: torch.Tensor, gate: torch.Tensor
    ) -> tuple[torch.Tensor, HandedOn]:
        rows = x.numel() // x.shape[-1]
        if rows <= self.attn.c_attn.weight_only_rows:  # bfloat16 rows into the next c_attn
            return super().residual_out(x, m, inject, gate)
        out, q, scale = add_norm_quantize(
            x.reshape(rows, -1), m.reshape(rows, -1), self.ln_2.weight, self.ln_2.eps, inject.reshape(rows, -1), gate
        )
        return out.reshape(x.shape), (q, scale)

    def attn_residual_and_mlp(self, x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = x.numel() // x.shape[-1]
        if rows <= self.mlp.c_fc.weight_only_rows:  # bfloat16 rows into c_fc: nothing to quantize
            return super().attn_residual_and_mlp(x, a)
        x2, a2 = x.reshape(rows, x.shape[-1]), a.reshape(rows, x.shape[-1])
        out, q, scale = add_norm_quantize(x2, a2, self.ln_1.weight, self.ln_1.eps)
        return out.reshape(x.shape), self.mlp.quantized(q, scale, x.dtype).reshape(x.shape)


def path_for_rows(rows: int, weight_only_rows: int, in_features: int = K_MULTIPLE) -> str:
    """The path of a call with `rows` rows on CUDA: "weight-only", "triton" or "cublas"."""
    if rows <= weight_only_rows:
        return "weight-only"
    if rows <= MAX_ROWS and in_features % K_MULTIPLE == 0:
        return "triton"
    return "cublas"


def path_table(weight_only_rows: int, buckets: tuple[int, ...] = BUCKETS) -> dict[int, str]:
    """The path each batch bucket (items of 64 rows) runs."""
    return {n: path_for_rows(PAGE * n, weight_only_rows) for n in buckets}


@torch.no_grad()
def quantize_model(model: nn.Module, weight_only_rows: int = FP8_WEIGHT_ONLY_ROWS) -> nn.Module:
    """Replaces every transformer block's linear layers by Fp8Linear, in place, one at a time (the
    bfloat16 weight is freed as its replacement is made). Returns the model."""
    if weight_only_rows < 0:
        raise ValueError("weight_only_rows must be >= 0")
    before = after = 0
    for block in model.transformer.blocks:
        for path in BLOCK_LINEARS:
            owner_name, name = path.split(".")
            owner = getattr(block, owner_name)
            linear = getattr(owner, name)
            q = Fp8Linear.from_linear(linear, weight_only_rows)
            before += linear.weight.numel() * linear.weight.element_size()
            after += q.weight.numel() + q.scale.numel() * 4
            setattr(owner, name, q)
        block.mlp = Fp8MLP(block.mlp.c_fc, block.mlp.c_proj)
        block.attn.__class__ = Fp8Attention
        block.__class__ = Fp8Block  # the same modules and weights; only the step between attention and the MLP changes
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log.info(
        "fp8: %d linear layers quantized (%.2f GB -> %.2f GB); paths per batch bucket: %s",
        len(model.transformer.blocks) * len(BLOCK_LINEARS),
        before / 1e9,
        after / 1e9,
        path_table(weight_only_rows),
        extra={"fp8_bytes_before": before, "fp8_bytes_after": after},
    )
    return model


def check_quantization(quantization: str, device: str | torch.device, dtype: torch.dtype) -> None:
    """Raise ValueError, with what to do instead, for a quantization this device and dtype cannot run."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose from {', '.join(QUANTIZATIONS)}")
    if quantization == "none":
        return
    if dtype != torch.bfloat16:
        raise ValueError(
            f"--quantization fp8 computes in bfloat16 (its FP8 GEMMs write bfloat16), not {str(dtype).split('.')[-1]}: "
            "use --dtype bfloat16 or --dtype auto"
        )
    dev = torch.device(device)
    if dev.type == "cpu":
        return  # emulated
    if dev.type != "cuda":
        raise ValueError(f"--quantization fp8 runs on CUDA GPUs (emulated on the CPU), not on {dev.type}")
    capability = torch.cuda.get_device_capability(dev)
    if tuple(capability) < MIN_CAPABILITY:
        raise ValueError(
            f"--quantization fp8 needs a GPU with FP8 tensor cores (compute capability >= "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: Ada, Hopper or later); "
            f"{torch.cuda.get_device_name(dev)} is {capability[0]}.{capability[1]}"
        )


def engine_dtype(requested: str, device: str, quantization: str) -> str:
    """The dtype name of an engine: `auto` is bfloat16 on CUDA and with fp8 (emulated on the CPU
    too), float32 on the CPU otherwise."""
    if requested != "auto":
        return requested
    return "bfloat16" if device.startswith("cuda") or quantization == "fp8" else "float32"


def deviation(reference: torch.Tensor, logits: torch.Tensor) -> dict[str, float]:
    """How far logits [R, V] are from reference logits: relative error (Frobenius), mean
    KL(reference || logits) of the softmax per row, and the fraction of rows whose argmax agrees."""
    ref, out = reference.float(), logits.float()
    p_log, q_log = torch.log_softmax(ref, -1), torch.log_softmax(out, -1)
    return {
        "rel_error": ((out - ref).norm() / ref.norm()).item(),
        "mean_kl": (p_log.exp() * (p_log - q_log)).sum(-1).mean().item(),
        "greedy_agreement": (ref.argmax(-1) == out.argmax(-1)).float().mean().item(),
    }
