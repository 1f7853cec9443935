"""The measures `cde eval` adds for issue 27, against values worked out by hand: repeated 3-grams,
a chunk's top-1/top-3 known concept against the topic, the weakest strength that puts 80% on
topic, and the masked-token loss (against the same loss written out position by position)."""

import torch
import torch.nn.functional as F
from cde.shared.config import MASK_ID
from cde.shared.tokenizer import get_tokenizer

from cde.eval.concept_eval import chunk_ranks, on_topic_strength
from cde.eval.fluency import masked_token_loss
from cde.eval.repetition import repeated_trigram_share
from cde.train.loop import Options, build
from cde.train.program import model_config
from cde.train.reference_concepts import concept_id, topic_concept
from cde.train.token_set import used_ids
from cde.train.train_model import block_causal_mask


def test_repeated_trigrams_are_counted_within_each_text_and_pooled():
    # "sand sand sand sand sand": 3 trigrams, all (sand, sand, sand): the 2nd and 3rd repeat the 1st.
    assert repeated_trigram_share(["Sand sand sand, sand sand."]) == 2 / 3
    # a b c a b c: abc bca cab abc -> 1 repeat of 4; "x y z": 1 trigram, no repeat -> 1 of 5 pooled.
    assert repeated_trigram_share(["a b c a b c", "x y z"]) == 1 / 5
    # the same sentence in two texts is no repetition; texts under 3 words have no trigrams
    assert repeated_trigram_share(["a b c", "a b c"]) == 0.0
    assert repeated_trigram_share(["hi there", ""]) == 0.0


def test_chunk_ranks_compare_the_first_and_first_three_known_concepts_with_the_topic():
    ocean, space = topic_concept("Ocean"), topic_concept("Space")
    sailing, calm = concept_id("Sailing"), concept_id("Calm tone")
    ranked = [
        [[ocean, calm], [sailing, calm, ocean], [calm, space, sailing, ocean]],  # top1, top3 (group), neither
        [[calm, space]],  # the second reply is about space: top 3 only
    ]
    r = chunk_ranks(ranked, [ocean, space])
    assert r == {"chunks": 4, "top_is_topic": 1 / 4, "topic_in_top3": 3 / 4, "top_in_topic_group": 2 / 4}


def test_on_topic_strength_is_the_weakest_steered_row_at_80_percent():
    rows = [{"strength": 0, "on_topic": 0.9}, {"strength": 8, "on_topic": 0.5}, {"strength": 16, "on_topic": 0.8}]
    assert on_topic_strength(rows)["strength"] == 16
    assert on_topic_strength(rows[:2]) is None


def test_masked_token_loss_masks_the_reply_in_two_interleaved_halves():
    torch.manual_seed(0)
    model, _, _ = build(Options(out="", config=model_config("mini")), used_ids(sample_docs=200))
    model.eval()
    tok = get_tokenizer(True)
    prompt, reply = tok.encode("Tell me"), tok.encode(" about the ocean and the")
    assert (len(prompt), len(reply)) == (2, 5)
    ids = torch.tensor([prompt + reply])
    pos = torch.arange(7)[None]
    mask = block_causal_mask(torch.zeros_like(ids))
    expected = 0.0
    for masked_positions in ([2, 4, 6], [3, 5]):  # the reply's even, then odd positions
        x = ids.clone()
        for p in masked_positions:
            x[0, p] = MASK_ID
        with torch.no_grad():
            h = model.hidden(x, pos, mask)[0]
            for p in masked_positions:
                logits = model.logits(h[p])
                expected -= float(F.log_softmax(logits, -1)[int(model.lookup[ids[0, p]])])
    total, count = masked_token_loss(model, prompt, reply)
    assert count == 5
    assert abs(total - expected) < 1e-4 * max(1.0, abs(expected))
