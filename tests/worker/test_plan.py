"""worker/plan.py: the scheduler and the model runner meet only in a StepPlan. The runner imports
no live request (nothing of sequence.py, none of the protocol's request types), the scheduler
nothing about attribution, stop strings or the tokenizer, and a plan is frozen data that keeps
saying what its pass computed while the scheduler moves its requests on."""

import ast
from pathlib import Path

import pytest
from cde.shared.protocol import GenerateRequest
from cde.worker.plan import Picks
from cde.worker.scheduler import Scheduler

WORKER = Path(__file__).resolve().parents[2] / "worker"


def imports(module: str) -> set[str]:
    """`module` and `module.name` for every `import module` / `from module import name` of a
    worker file, wherever it stands (TYPE_CHECKING blocks included)."""
    out = set()
    for node in ast.walk(ast.parse((WORKER / f"{module}.py").read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_the_runner_sees_no_live_request():
    found = imports("model_runner") | imports("step_inputs") | imports("logit_rules") | imports("carried_picks")
    assert not {m for m in found if m.startswith("cde.worker.sequence")}
    requests = {"GenerateRequest", "SteeringSpec", "AttributionSpec", "FlashBlockSpec", "InputAttributionSpec"}
    assert not {m for m in found if m.startswith("cde.shared.protocol.") and m.rsplit(".", 1)[1] in requests}


def test_the_scheduler_knows_nothing_of_attribution_stops_or_tokens():
    found = imports("scheduler") | imports("sequence") | imports("flashblock_policy") | imports("plan")
    found |= imports("plan_ahead")
    assert not {m for m in found if any(w in m.lower() for w in ("attribution", "stops", "tokenizer", "torch"))}


def test_a_plan_keeps_what_its_pass_computed():
    s = Scheduler(num_pages=4, max_running=1, max_items=4, eot_id=None)
    s.add(GenerateRequest("r", [1] * 10, max_tokens=100, tokens_per_step=4))
    plan = s.schedule()
    (step,) = plan.step_items
    with pytest.raises(AttributeError):
        step.step = 5
    before = (step.tokens, step.step, step.eligible, step.committed)
    s.place(plan, [Picks([10, 11, 12, 13], [7, 8, 9, 10])])
    assert (step.tokens, step.step, step.eligible, step.committed) == before
    seq = s.running_in(step.slot)
    assert seq.tokens[10:14] == [7, 8, 9, 10] and (seq.step, seq.committed) == (1, 4)
    (following,) = s.schedule().step_items
    assert following.tokens[10:14] == (7, 8, 9, 10) and (following.step, following.committed) == (1, 4)
    assert following.eligible[10:14] == (False,) * 4 and step.eligible[10:14] == (True,) * 4
