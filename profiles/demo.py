"""``memsched demo``: the built-in gpt-tiny profiled, solved at half its store-all memory, shown and trained.

:func:`demo_lines` is the whole demo, its text in blocks as the command prints them; ``say(line)`` tells what is
being done meanwhile (profiling).
"""

import solvers
from planner import render
from planner.plot import plot_timeline
from planner.render import say_on_stderr
from planner.simulate import simulate
from planner.units import parse_budget
from profiles.spec import load_model
from profiles.training import profiled_for_training, train_chain_plan


def demo_lines(steps: int, plot: str = None, say=say_on_stderr):
    """Yield the demo's blocks of text: the chain, the hierarchical plan at 50% (beside rotor's overhead), its
    schedule and memory timeline (saved as a PNG at ``plot`` too), then ``steps`` training steps measured."""
    model, _ = load_model("gpt-tiny")
    yield "memsched demo: the built-in gpt-tiny, trained at half the memory of storing every activation\n"
    chain = profiled_for_training(model, "cpu", say=say)
    budget = parse_budget("50%", solvers.store_all_peak(chain))
    plan, rotor = (solvers.solve(chain, budget, name) for name in ("hierarchical", "rotor"))
    result = simulate(chain, plan)
    schedule = ["  " + line for line in render.compact_schedule(plan.schedule, width=76).splitlines()]
    yield "\n".join(render.chain_table(chain) + [""] + render.solve_summary(plan, "hierarchical")
                    + [f"  (rotor, stages whole, at this budget: {rotor.predicted.overhead:+.1%})", "schedule:"]
                    + schedule + [""] + render.ascii_timeline(result, plan.budget_bytes)) + "\n"
    if plot:
        plot_timeline(result, plan.budget_bytes, plot, f"{plan.problem_name}: {plan.solver} plan")
        yield f"timeline plot written to {plot}\n"
    yield "\n".join(render.training_table(plan, train_chain_plan(model, plan, chain, steps, "cpu", 1e-3)))
