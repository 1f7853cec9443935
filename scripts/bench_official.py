"""The official steerling generator on the same GPU and checkpoint as `cde bench engine`:
greedy, 64-token prompts, 128 new tokens, batch 1 and 4. Prints tok/s per batch size."""

import argparse
import json
import time

import torch
from safetensors.torch import load_file

from tests.oracle import official_configs, offline_tiktoken_cache


def load(model_dir):
    from pathlib import Path

    from steerling.models.interpretable.interpretable_causal_diffusion import InterpretableCausalDiffusionLM

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    model_cfg, concept_cfg = official_configs(raw)
    with torch.device("meta"):
        model = InterpretableCausalDiffusionLM(model_cfg, concept_cfg, raw["vocab_size"])
    state = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(str(f), device="cuda"))
    state["transformer.lm_head.weight"] = state["transformer.tok_emb.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.transformer._restore_weight_tying()
    return model.to(torch.bfloat16).eval(), model_cfg, raw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--json")
    args = ap.parse_args()
    offline_tiktoken_cache()
    from steerling.configs.generation import GenerationConfig
    from steerling.data.tokenizer import SteerlingTokenizer
    from steerling.inference.causal_diffusion import SteerlingGenerator

    model, model_cfg, _raw = load(args.model)
    gen = SteerlingGenerator(model, SteerlingTokenizer(), model_cfg, is_interpretable=True, device="cuda")
    cfg = GenerationConfig(
        max_new_tokens=128, steps=128, temperature=0, use_entropy_sampling=False, top_p=0, repetition_penalty=1
    )
    out = []
    for bs in [int(b) for b in args.batch.split(",")]:
        prompt = torch.randint(1000, 100000, (bs, 64), generator=torch.Generator().manual_seed(bs))
        gen.generate_full(prompt[:, :64], GenerationConfig(**{**cfg.model_dump(), "max_new_tokens": 64, "steps": 64}))
        torch.cuda.synchronize()
        t = time.perf_counter()
        gen.generate_full(prompt, cfg)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        out.append({"batch": bs, "tok_per_s": bs * 128 / dt, "seconds": dt})
        print(json.dumps(out[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
