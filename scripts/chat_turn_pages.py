#!/usr/bin/env python3
"""Issue 30, point 2: would keying a finished request's generated blocks help the next chat turn?

Runs first turns on the built-in demo model (instruct, greedy), re-encodes each answer through the
chat template as the next turn's history (what a client resends), and counts per second turn:
its full pages the prefix cache finds today (the first turn's full prompt pages), the pages that
keying generated blocks would add (full pages of prompt + answer before the block holding
<|eot_id|>, whose later positions stay masked), and whether the answer's tokens came back the same.

    PYTHONPATH=. python scripts/chat_turn_pages.py
"""

from __future__ import annotations

from cde.shared.config import PAGE
from cde.shared.protocol import GenerateRequest
from cde.worker.demo_model import demo_model_dir
from cde.worker.engine import Engine, EngineArgs

SYSTEM = " ".join(
    f"Rule {i}: answer briefly, in plain words, and show the arithmetic when there is some." for i in range(10)
)
QUESTIONS = [f"What is {a} plus {b}? Then name a color." for a, b in zip(range(3, 63, 3), range(7, 87, 4))]


def main() -> None:
    engine = Engine(EngineArgs(str(demo_model_dir()), max_running=len(QUESTIONS)))
    tok = engine.tokenizer
    eot = engine.cfg.eot_id
    firsts = [
        tok.chat_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]) for q in QUESTIONS
    ]
    answers = engine.generate([GenerateRequest(str(i), p, max_tokens=128) for i, p in enumerate(firsts)])
    today = extra = same = total = 0
    for i, (q, p1) in enumerate(zip(QUESTIONS, firsts)):
        answer = answers[str(i)]
        history = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": q},
            {"role": "assistant", "content": tok.decode(answer)},
            {"role": "user", "content": "And why?"},
        ]
        p2 = tok.chat_prompt(history)
        resent = p1 + answer + [eot]
        same += p2[: len(resent)] == resent
        # full pages of turn 1's prompt and answer before the page holding <|eot_id|> (or the answer's end)
        generated_pages = (len(p1) + len(answer)) // PAGE
        matching = next(
            (b for b in range(generated_pages) if p2[b * PAGE : (b + 1) * PAGE] != resent[b * PAGE : (b + 1) * PAGE]),
            generated_pages,
        )
        today += len(p1) // PAGE
        extra += max(matching - len(p1) // PAGE, 0)
        total += len(p2) // PAGE
    n = len(QUESTIONS)
    print(
        f"{n} second turns: answers re-encoded to the same tokens {same}/{n}; full pages of the second turns {total}, "
        f"cached today {today} ({today / total:.0%}), more with generated blocks keyed {extra} ({extra / total:.0%})"
    )


if __name__ == "__main__":
    main()
