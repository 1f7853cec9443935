"""The training data generator: task families and their checkers, the held-out split, topic
text and its judge, the concept catalog, and the packing of documents into rows."""

import random
import re

import pytest
import torch
from cde.shared.config import EOS_ID, EOT_ID, PAGE
from cde.shared.tokenizer import get_tokenizer

from cde.train import tasks
from cde.train.heldout import problems
from cde.train.reference_concepts import concepts, topic_concept, write_catalog
from cde.train.rows import make_batch, pack_row
from cde.train.samples import EOT, PROMPT, TEXT, TRAIL, chat_doc, plain_doc
from cde.train.text import judge, on_topic_share, paragraph
from cde.train.vocab import TOPICS

# ../shared/fixtures/concept_labels.schema.txt: the columns of the official concept_labels.parquet
OFFICIAL_COLUMNS = [
    "concept_id",
    "concept_name",
    "concept_description",
    "head",
    "public_group_id",
    "group_name",
    "is_steerable",
    "is_tone",
    "is_alignment",
    "is_demographic",
]


@pytest.mark.parametrize("family", tasks.FAMILIES)
def test_checker_accepts_the_answer_and_rejects_a_wrong_one(family):
    rng = random.Random(family)
    for _ in range(50):
        p = tasks.problem(family, rng)
        assert tasks.check(p, p.answer), (p.prompt, p.answer)
        if p.family in ("arithmetic", "word_problem"):
            wrong = f"The answer is {tasks.digits(p.expected[0] + 1)}."
        else:  # the first two items swapped
            head, items = p.answer.split(": ")
            first, second, *rest = items.split()
            wrong = f"{head}: " + " ".join([second, first, *rest])
        assert not tasks.check(p, wrong), (p.prompt, wrong)
        assert not tasks.check(p, "I do not know.")


def test_arithmetic_is_on_numbers_of_three_or_four_digits_written_digit_by_digit():
    rng = random.Random(1)
    for _ in range(200):
        p = tasks.problem("arithmetic", rng)
        nums = [int(m.replace(" ", "")) for m in re.findall(r"\d(?: \d)*", p.prompt)]
        assert len(nums) == 2 and all(100 <= n <= 9999 for n in nums)
        value = sum(nums) if p.kind == "Addition" else max(nums) - min(nums)
        assert p.expected == (value,) and p.answer == f"The answer is {' '.join(str(value))}."


@pytest.mark.parametrize("family", tasks.FAMILIES)
def test_train_and_eval_splits_share_no_operands(family):
    rng = random.Random(family)
    train = {tasks.problem(family, rng, "train").key for _ in range(400)}
    held = {tasks.problem(family, rng, "eval").key for _ in range(100)}
    assert {tasks.split_of(k) for k in train} == {"train"} and {tasks.split_of(k) for k in held} == {"eval"}
    assert not train & held
    rng = random.Random(0)
    share = (
        sum(tasks.split_of(("+", rng.randint(100, 9999), rng.randint(100, 9999))) == "eval" for _ in range(4000)) / 4000
    )
    assert 0.04 < share < 0.09  # one bucket of 16 held out
    assert problems(5, seed=0) == problems(5, seed=0) != problems(5, seed=1)


def test_paragraphs_are_judged_on_their_topic():
    rng = random.Random(3)
    right = total = 0
    for _ in range(300):
        par = paragraph(rng)
        right += on_topic_share(par.text, par.topic.name) == 1.0
        total += 1
    assert right / total > 0.95
    assert judge("The sailor drops the anchor in the bay.") == "Ocean"
    assert judge("The astronaut fires the thrusters.") == "Space"
    assert judge("It is a nice day.") is None


def test_catalog_has_the_official_schema_and_search_works(tmp_path):
    from steerling.concepts import ConceptCatalog

    path = write_catalog(tmp_path / "concept_labels.parquet")
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    assert table.column_names == OFFICIAL_COLUMNS
    assert (
        str(table.schema.field("public_group_id").type) == "int64" and str(table.schema.field("is_tone").type) == "bool"
    )
    assert 50 <= len(concepts()) <= 200
    catalog = ConceptCatalog.load(path)
    assert catalog.search("ocean")[0].concept_id == topic_concept("Ocean")
    ocean = catalog.get(topic_concept("Ocean"))
    assert ocean.is_steerable and not ocean.is_tone and ocean.head == "known"
    assert len(catalog.group(topic_concept("Ocean"))) == 4  # the topic and its three subtopics
    assert catalog.search("excited")[0].is_tone


def test_chat_documents_follow_the_instruct_template():
    tok = get_tokenizer(True)
    doc = chat_doc("What is 1 + 2?", "The answer is 3.", [0])
    prompt = tok.chat_prompt([{"role": "user", "content": "What is 1 + 2?"}])
    assert doc.ids[: len(prompt)] == prompt and doc.ids[-1] == EOT_ID
    assert tok.decode(doc.ids[len(prompt) : -1]) == "The answer is 3."
    assert doc.kinds == [PROMPT] * len(prompt) + [TEXT] * (len(doc.ids) - len(prompt) - 1) + [EOT]


def test_rows_start_documents_on_blocks_and_fill_after_eot():
    rng = random.Random(4)
    chat = chat_doc("Hello!", "Hi! What would you like to talk about?", [1], steer=-1)
    plain = plain_doc(rng, 4 * PAGE)
    row = pack_row([chat, plain], 4 * PAGE, len(concepts()))
    n = len(chat.ids)
    assert row["ids"][:n].tolist() == chat.ids
    assert (row["ids"][n:PAGE] == EOS_ID).all() and (row["kinds"][n:PAGE] == TRAIL).all()
    assert row["doc"][:PAGE].eq(0).all() and row["doc"][PAGE:].eq(1).all()
    assert row["pos"][PAGE] == 0 and row["pos"][-1] == 3 * PAGE - 1  # positions restart per document
    assert row["ids"][PAGE:].tolist() == plain.ids[: 3 * PAGE]
    assert row["labels"][1, plain.labels].all() and row["steer"][1] == plain.steer >= 0


def test_batches_are_a_function_of_seed_and_step():
    a, b = make_batch(0, 5, 4, 256, len(concepts())), make_batch(0, 5, 4, 256, len(concepts()))
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = make_batch(0, 6, 4, 256, len(concepts()))
    assert not torch.equal(a["ids"], c["ids"])
    starts = a["pos"] == 0
    assert (starts.nonzero()[:, 1] % PAGE == 0).all()  # every document starts on a block
    steered = {int(s) for s in a["steer"].flatten() if s >= 0}
    assert steered <= {topic_concept(t.name) for t in TOPICS}
