"""worker/stream_linear.py on the CPU (where `cde::stream_linear` is F.linear): what `install`
changes in a real checkpoint's model (nothing of its outputs or state dict), which calls take the
op (one request's rows, not more), and how `calibrate` decides per weight shape from the times it
measures (given here by the test's clock, which runs the calls: only a GPU has two kernels to time)."""

import logging

import pytest
import torch
from cde.worker import stream_linear
from cde.worker.checkpoint import load_checkpoint
from cde.worker.model import BLOCK_LINEARS
from torch.utils._python_dispatch import TorchDispatchMode


class OpNames(TorchDispatchMode):
    """Records the name of every op dispatched while active."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def clock(triton_ms, cublas_ms: float = 1.0, fused_ms=None):
    """Runs the calls it is given and says cublas_ms for the baselines (cuBLAS; c_fc plus the
    compiled activation), and for the Triton GEMM triton_ms: one figure, or one per weight's output
    rows; for the fused MLP fused_ms (default: triton_ms's one figure, else cublas_ms). An exception
    there is raised."""

    def time_ms(kernel, calls):
        n = calls()[0].shape[1]
        if kernel in ("cublas", "unfused"):
            return cublas_ms
        if kernel == "fused":
            t = fused_ms if fused_ms is not None else triton_ms if not isinstance(triton_ms, dict) else cublas_ms
        else:
            t = triton_ms[n] if isinstance(triton_ms, dict) else triton_ms
        if isinstance(t, Exception):
            raise t
        return t

    return time_ms


def linears(model):
    return [m for m in model.modules() if isinstance(m, stream_linear.StreamLinear)]


@pytest.fixture
def model(small_dir):
    return load_checkpoint(small_dir, dtype=torch.bfloat16, device="cpu")[1]


def test_install_changes_neither_outputs_nor_state_dict(small_dir, model):
    plain = load_checkpoint(small_dir, dtype=torch.bfloat16, device="cpu")[1]
    keys = list(model.state_dict())
    stream_linear.install(model, clock(0.5))
    assert list(model.state_dict()) == keys
    assert len(linears(model)) == len(model.transformer.blocks) * len(BLOCK_LINEARS)
    assert all(m.stream for m in linears(model))
    assert all(isinstance(b.mlp, stream_linear.StreamMLP) and b.mlp.fused for b in model.transformer.blocks)
    for block, ref in zip(model.transformer.blocks, plain.transformer.blocks):
        x = torch.randn(1, 64, ref.mlp.c_fc.in_features, dtype=torch.bfloat16)
        with OpNames() as ops, torch.inference_mode():  # as the engine runs
            assert torch.equal(block.mlp(x), ref.mlp(x))  # the fused op is c_fc then the activation
        assert any("cde.stream_swiglu" in n for n in ops.names)
        for path in BLOCK_LINEARS:
            owner, name = path.split(".")
            ours, theirs = getattr(getattr(block, owner), name), getattr(getattr(ref, owner), name)
            assert ours.weight is not theirs.weight and torch.equal(ours.weight, theirs.weight)
            x = torch.randn(1, 64, ours.in_features, dtype=torch.bfloat16)
            with torch.inference_mode():
                assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("rows,takes_op", [(64, True), (5, True), (65, False), (128, False)])
def test_one_requests_rows_take_the_op_more_take_cublas(model, rows, takes_op):
    stream_linear.install(model, clock(0.5))
    layer = model.transformer.blocks[0].mlp.c_fc
    with OpNames() as ops, torch.inference_mode():  # as the engine runs
        layer(torch.randn(rows, layer.in_features, dtype=torch.bfloat16))
    assert any("cde.stream_linear" in n for n in ops.names) == takes_op, ops.names


@pytest.mark.parametrize("rows,takes_op", [(64, True), (5, True), (65, False)])
def test_one_requests_mlp_takes_the_fused_op_once_calibrated_faster(model, rows, takes_op):
    stream_linear.install(model, clock(0.5, fused_ms=0.9))
    mlp = model.transformer.blocks[0].mlp
    with OpNames() as ops, torch.inference_mode():
        mlp(torch.randn(rows, mlp.c_fc.in_features, dtype=torch.bfloat16))
    assert any("cde.stream_swiglu" in n for n in ops.names) == takes_op, ops.names
    choices = stream_linear.calibrate(model, clock(0.5, fused_ms=0.99))  # within the margin: not fused
    assert choices["swiglu"] == {"unfused_ms": 1.0, "fused_ms": 0.99, "fused": False}
    with OpNames() as ops, torch.inference_mode():
        mlp(torch.randn(rows, mlp.c_fc.in_features, dtype=torch.bfloat16))
    assert not any("cde.stream_swiglu" in n for n in ops.names)


def test_gradients_flow_where_autograd_records(small_dir, model):
    """Input attribution differentiates through the blocks (64 rows for one snapshot of one block):
    the ops have no backward, so recorded calls take the plain path, with the plain model's gradient."""
    plain = load_checkpoint(small_dir, dtype=torch.bfloat16, device="cpu")[1]
    stream_linear.install(model, clock(0.5, fused_ms=0.5))
    grads = []
    for m in (model, plain):
        x = torch.randn(1, 64, m.cfg.n_embd, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
        x.requires_grad_(True)
        with torch.enable_grad():
            m.transformer.blocks[0].mlp(m.transformer.blocks[0].attn.c_proj(x)).float().sum().backward()
        grads.append(x.grad)
    assert torch.equal(*grads)


def test_calibrate_keeps_the_faster_kernel_per_shape(model, caplog):
    shapes = {m.weight.shape[0] for block in model.transformer.blocks for m in block.modules() if hasattr(m, "weight")}
    widest = model.transformer.blocks[0].mlp.c_fc.weight.shape[0]
    assert widest in shapes
    fast = {n: 0.99 for n in shapes} | {widest: 0.5}  # 0.99 of cuBLAS's time is within the margin
    with caplog.at_level(logging.INFO, logger="cde.stream_linear"):
        choices = stream_linear.install(model, clock(fast))
    linear = choices["linears"]
    assert len(linear) == 4 and all(c["stream"] == (n == widest) for (n, _), c in linear.items())
    assert all(m.stream == (m.out_features == widest) for m in linears(model))
    assert "one-request linears" in caplog.text and "one-request MLP activation: unfused" in caplog.text
    choices = stream_linear.calibrate(model, clock(RuntimeError("no kernel here")))
    assert not any(c["stream"] for c in choices["linears"].values()) and not any(m.stream for m in linears(model))
    assert not choices["swiglu"]["fused"] and choices["swiglu"]["fused_ms"] is None
    assert "triton failed (no kernel here); cublas stays" in caplog.text
    assert "fused failed (no kernel here); unfused stays" in caplog.text


def test_float32_weights_are_never_timed_on_the_triton_gemm(small_dir):
    model = load_checkpoint(small_dir, dtype=torch.float32, device="cpu")[1]
    choices = stream_linear.install(model, clock(0.1))
    assert all(c["stream_ms"] is None and not c["stream"] for c in choices["linears"].values())
    assert choices["swiglu"]["fused_ms"] is None and not choices["swiglu"]["fused"]
