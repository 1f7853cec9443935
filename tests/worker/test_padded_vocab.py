"""A checkpoint whose embedding has more rows than the tokenizer has ids (a public report gives
100352 rows for the published instruct model): the rows past the tokenizer are never sampled,
even when the model prefers them by a wide margin."""

import dataclasses

import torch
from cde.shared.config import INSTRUCT_VOCAB, preset
from cde.shared.protocol import GenerateRequest
from cde.worker.checkpoint import random_model, save_checkpoint
from cde.worker.engine import Engine, EngineArgs


def test_rows_past_the_tokenizer_are_never_generated(tmp_path):
    cfg = dataclasses.replace(preset("tiny", instruct=True), vocab_size=100352)
    model = random_model(cfg, seed=1)
    with torch.no_grad():  # every hidden state gets a large dimension 0; the padded rows align with it
        w = model.transformer.lm_head.weight
        w[:, 0] = 20.0
        w[INSTRUCT_VOCAB:, 0] += 5.0
        model.transformer.ln_f.weight[0] = 1.0
    save_checkpoint(model, cfg, tmp_path)
    engine = Engine(EngineArgs(str(tmp_path), max_running=2))
    assert engine.cfg.vocab_size == 100352 and engine.cfg.token_vocab == INSTRUCT_VOCAB
    prompt = torch.randint(0, 100000, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request(GenerateRequest("g", prompt, max_tokens=24))
    engine.add_request(GenerateRequest("s", prompt, max_tokens=24, temperature=1.0, seed=3))
    tokens = []
    while engine.has_work():
        for res in engine.step():
            tokens.extend(res.token_ids)
    assert len(tokens) == 48 and max(tokens) < INSTRUCT_VOCAB
    engine.tokenizer.decode(tokens)  # every id decodes
