"""The CPU LM head in vocabulary slices is the one GEMM's result, bit for bit."""

import pytest
import torch
import torch.nn.functional as F
from cde.shared.config import preset
from cde.worker.lm_head import VOCAB_SLICE, lm_head_logits


@pytest.mark.parametrize("name", ["tiny", "small"])
@pytest.mark.parametrize("rows", [1, 5, 64, 130])
def test_sliced_logits_are_the_whole_products_bits(name, rows):
    """At the presets' widths and the padded and unpadded vocabularies (the last slice short or
    whole), with one and two threads, for the row counts of one item, a few and a padded batch."""
    cfg = preset(name)
    g = torch.Generator().manual_seed(rows)
    for vocab in (cfg.vocab_size, VOCAB_SLICE * 3):
        weight = torch.randn(vocab, cfg.n_embd, generator=g)
        hidden = torch.randn(rows, cfg.n_embd, generator=g)
        threads = torch.get_num_threads()
        try:
            for n in (1, 2):
                torch.set_num_threads(n)
                assert torch.equal(lm_head_logits(hidden, weight), F.linear(hidden, weight))
        finally:
            torch.set_num_threads(threads)
