"""Verifiable task families: a problem generator, its answer, and a checker for each.

Numbers in arithmetic are written digit by digit ("4 8 2 1"): cl100k cuts digit runs into
tokens of up to three digits whose boundaries move with the number's length, while one digit
per token lets a diffusion decoder fill each answer digit from the aligned operand digits.

Held-out split: a problem belongs to the eval split when a stable hash of its operands falls in
one bucket of EVAL_BUCKETS, so train and eval never share operands, whatever the seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from dataclasses import dataclass

EVAL_BUCKETS = 16
FAMILIES = ("arithmetic", "sorting", "reversal", "word_problem")

# A word list, wrapped by hand rather than one word a line.
# fmt: off
WORDS = [
    "cat", "dog", "fish", "bird", "tree", "house", "car", "book", "lamp", "chair", "table", "door", "window", "apple",
    "bread", "cheese", "milk", "river", "stone", "cloud", "moon", "star", "road", "ship", "train", "coin", "ring",
    "shoe", "hat", "coat", "glove", "bell", "drum", "cup", "plate", "spoon", "fork", "knife", "box", "bag", "key",
    "lock", "clock", "phone", "card", "map", "pen", "paper", "rope", "wheel", "horse", "cow", "sheep", "goat", "duck",
    "frog", "bee", "ant", "lion", "tiger", "bear", "wolf", "fox", "owl", "rose", "lily", "grass", "sand", "snow",
    "rain", "wind", "fire", "ice", "gold", "iron", "salt", "sugar", "tea", "rice", "egg", "nut", "leaf", "root", "seed",
]
# fmt: on
NAMES = ("Tom", "Anna", "Ben", "Maria", "Sam", "Lucy", "Omar", "Mia", "Leo", "Nina")
ITEMS = ("apples", "pencils", "marbles", "stickers", "coins", "books", "cookies", "stamps", "shells", "cards")


@dataclass(frozen=True)
class Problem:
    family: str
    kind: str  # the task-kind concept: Addition, Subtraction, Sorting, Reversal, Word problem
    prompt: str
    answer: str  # the assistant's reply
    expected: tuple  # what check() compares against
    key: tuple = ()  # the operands: what the split is decided on


def digits(n: int) -> str:
    return " ".join(str(n))


def split_of(key: tuple) -> str:
    h = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "big")
    return "eval" if h % EVAL_BUCKETS == 0 else "train"


_ADD = ("What is {a} + {b}?", "Compute {a} + {b}.", "Add {a} and {b}.", "{a} + {b} = ?")
_SUB = ("What is {a} - {b}?", "Compute {a} - {b}.", "Subtract {b} from {a}.", "{a} - {b} = ?")
_SORT = ("Sort these numbers from smallest to largest: {xs}", "Put these numbers in increasing order: {xs}")
_REV = ("Reverse the order of these words: {xs}", "Write these words in reverse order: {xs}")
_WORD_ADD = (
    "{name} has {a} {items}. {name} gets {b} more. How many {items} does {name} have now?",
    "A box holds {a} {items}. Someone puts {b} more {items} in the box. How many {items} are in the box?",
)
_WORD_SUB = (
    "{name} has {a} {items} and gives {b} to a friend. How many {items} does {name} have left?",
    "A box holds {a} {items}. {name} takes {b} {items} out. How many {items} are in the box now?",
)


def _arithmetic(rng: random.Random) -> tuple[tuple, Problem]:
    a, b = rng.randint(100, 9999), rng.randint(100, 9999)
    if rng.random() < 0.5:
        prompt = rng.choice(_ADD).format(a=digits(a), b=digits(b))
        return ("+", a, b), Problem("arithmetic", "Addition", prompt, f"The answer is {digits(a + b)}.", (a + b,))
    a, b = max(a, b), min(a, b)
    prompt = rng.choice(_SUB).format(a=digits(a), b=digits(b))
    return ("-", a, b), Problem("arithmetic", "Subtraction", prompt, f"The answer is {digits(a - b)}.", (a - b,))


def _sorting(rng: random.Random) -> tuple[tuple, Problem]:
    xs = rng.sample(range(100), rng.randint(4, 8))
    prompt = rng.choice(_SORT).format(xs=" ".join(map(str, xs)))
    out = sorted(xs)
    return tuple(xs), Problem("sorting", "Sorting", prompt, "Sorted: " + " ".join(map(str, out)), tuple(out))


def _reversal(rng: random.Random) -> tuple[tuple, Problem]:
    xs = rng.sample(WORDS, rng.randint(3, 7))
    prompt = rng.choice(_REV).format(xs=" ".join(xs))
    out = xs[::-1]
    return tuple(xs), Problem("reversal", "Reversal", prompt, "Reversed: " + " ".join(out), tuple(out))


def _word_problem(rng: random.Random) -> tuple[tuple, Problem]:
    a, b = rng.randint(10, 999), rng.randint(1, 999)
    slots = dict(name=rng.choice(NAMES), items=rng.choice(ITEMS))
    if rng.random() < 0.5:
        prompt = rng.choice(_WORD_ADD).format(a=digits(a), b=digits(b), **slots)
        key, c = ("w+", a, b), a + b
    else:
        a, b = max(a, b), min(a, b)
        prompt = rng.choice(_WORD_SUB).format(a=digits(a), b=digits(b), **slots)
        key, c = ("w-", a, b), a - b
    return key, Problem("word_problem", "Word problem", prompt, f"The answer is {digits(c)}.", (c,))


_MAKERS = {"arithmetic": _arithmetic, "sorting": _sorting, "reversal": _reversal, "word_problem": _word_problem}


def problem(family: str, rng: random.Random, split: str = "train") -> Problem:
    """A problem of the family whose operands belong to `split` (rejection sampling: 1 in
    EVAL_BUCKETS draws is held out)."""
    while True:
        key, p = _MAKERS[family](rng)
        if split_of(key) == split:
            return dataclasses.replace(p, key=key)


_NUMBER = re.compile(r"answer is ((?:\d ?)+)")


def check(p: Problem, reply: str) -> bool:
    """Whether a model's reply solves the problem (the reply's first answer counts)."""
    if p.family in ("arithmetic", "word_problem"):
        m = _NUMBER.search(reply)
        return bool(m) and int(m.group(1).replace(" ", "")) == p.expected[0]
    head = "Sorted:" if p.family == "sorting" else "Reversed:"
    if head not in reply:
        return False
    got = reply.split(head, 1)[1].split("\n")[0].split()
    if p.family == "sorting":
        return got == [str(x) for x in p.expected]
    return got == list(p.expected)
