"""bfloat16 on the CPU, `small` preset: the engine's logits for an active block (context written
by prefill) against the official model's full forward, in bfloat16 and against the float32
forward (the exact result): CDE's bfloat16 path is no further from exact than the official one."""

import torch
from cde.shared.config import MASK_ID
from cde.shared.protocol import GenerateRequest
from cde.worker.checkpoint import make_model
from cde.worker.engine import Engine, EngineArgs

from tests.oracle import official_model


def engine_logits(model_dir, dtype: str, prompt: list[int], device: str = "cpu") -> torch.Tensor:
    engine = Engine(EngineArgs(str(model_dir), device=device, dtype=dtype, max_running=2))
    captured = []
    inner = engine.runner._logits

    def capture(hidden):  # the sampler adjusts float32 logits in place: keep a copy
        out = inner(hidden)
        captured.append(out.clone())
        return out

    engine.runner._logits = capture
    engine.add_request(GenerateRequest("r", prompt, max_tokens=64))
    engine.step()  # prefill of block 0 and the first step of block 1
    return captured[0][:, : engine.cfg.vocab_size].float().cpu()  # CUDA pads the vocabulary (banned columns)


def official_logits(model_dir, dtype, prompt: list[int], device: str = "cpu") -> torch.Tensor:
    model, _ = official_model(model_dir, device=device, dtype=dtype)
    with torch.inference_mode():
        ids = torch.tensor([prompt + [MASK_ID] * 64], device=device)
        return model(ids, minimal_output=True)[0][0, 64:].float().cpu()


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_bfloat16_logits_as_close_to_exact_as_the_official_forward(tmp_path):
    model_dir = make_model("small", tmp_path / "small", seed=3, dtype="bfloat16")
    prompt = torch.randint(0, 100000, (64,), generator=torch.Generator().manual_seed(7)).tolist()
    exact = official_logits(model_dir, torch.float32, prompt)
    ours = engine_logits(model_dir, "bfloat16", prompt)
    theirs = official_logits(model_dir, torch.bfloat16, prompt)
    print(
        f"bf16 CDE vs official bf16 {rel(ours, theirs):.2e}; vs fp32: CDE {rel(ours, exact):.2e}, "
        f"official {rel(theirs, exact):.2e}"
    )
    assert rel(engine_logits(model_dir, "float32", prompt), exact) < 1e-5
    assert rel(ours, theirs) < 2e-2
    assert rel(ours, exact) <= 1.1 * rel(theirs, exact)
