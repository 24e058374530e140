"""``fit`` on encoder–decoders, a mixture of experts and the like (tests/hf_families.py), each in a fresh process
(its plans vary from process to process with the measured seconds): the first two steps of every plan peak within
1% of their prediction and never above the budget (issue 38).

Before, BART at ``"50%"`` measured 1.029 of its prediction, 1.003× its budget, and Whisper 1.027, 1.006×: a
stage option of the decoder's stage counted none of its outputs as saved by its backward, so the model freed the
encoder's last hidden state (returned to the caller, and read by the cross-attention's backward) at the loss.
A peft LoRA Llama measured 0.96 of its prediction at ``"90%"``: two of its cuts carried values no backward kept
(frozen weights save no input), which the model held to their backward (now one stage each: profiles/loose_cuts.py).
A decoder built in bf16 was one stage (issue 39); cut between its layers now, each cut's bf16 residual, which only
its fp32 copy is saved of, is held by the executor to its backward as the model counts it.
"""

import json
import subprocess
import sys

import pytest

from paths import ROOT

pytest.importorskip("transformers")

CHILD = '''
import json
import sys

import torch

if {threads!r} is not None:
    torch.set_num_threads({threads!r})
sys.path.insert(0, {tests!r})
from hf_families import FAMILIES
from planner import fit
from planner.execute.live_memory import LiveMemoryTracker
from profiles.memory import storage_bytes

rows = []
for family, budget, returns in {cases!r}:
    model, batch = FAMILIES[family]()
    fitted = fit(model, batch, budget, returns=returns, warmup=0, repeats=1, progress=False)
    inputs = fitted.discovery.chain_inputs((), batch)  # the batch tensors the chain reads as given: held before
    given = {{t.untyped_storage()._cdata for t in batch.values()}}
    held = storage_bytes([t for t in inputs if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in given])
    del inputs
    peaks = []
    for step in range(2):
        torch.manual_seed(step)
        with LiveMemoryTracker() as tracker:
            output = fitted(**batch)
            getattr(output, "loss", output).backward()
            del output
        fitted.zero_grad(set_to_none=True)
        peaks.append(tracker.peak + held)
    rows.append([family, budget, returns, peaks, fitted.predicted.peak_bytes, fitted.plan.budget_bytes,
                 fitted.plan.recomputed_forwards + sum(op.option is not None for op in fitted.plan.schedule)])
print(json.dumps(rows))
'''

MID, LOW = "75%", "50%"
# A fresh process per group (each family's first step is that of its own stages, prepared at their first call; the
# process's import of torch and transformers is paid once a group, not once per family); the bf16 decoders at the
# default thread count, and the most recomputing of them at one.
GROUPS = {
    "encoder-decoders": [("bart", LOW, "auto"), ("bart", LOW, "loss"), ("whisper", LOW, "auto"), ("t5", "70%", "auto")],
    "experts and adapters": [("mixtral", "90%", "auto"), ("lora", LOW, "auto"), ("lora", "90%", "auto")],
    "built in bf16": [("llama-bf16", "90%", "auto"), ("llama-bf16", "60%", "auto"), ("qwen2-bf16", MID, "auto")],
}
GROUPS["built in bf16, one thread"] = [("llama-bf16", "60%", "auto")]  # the recomputing plan: one thread's kernels
THREADS = {"built in bf16, one thread": 1}  # the others: torch's default count


@pytest.mark.slow
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_each_plan_peaks_at_its_prediction_and_within_its_budget_from_the_first_step(group):
    if any(family == "lora" for family, _, _ in GROUPS[group]):
        pytest.importorskip("peft")
    code = CHILD.format(tests=str(ROOT / "tests"), cases=GROUPS[group], threads=THREADS.get(group))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.splitlines()[-1])
    assert [row[:3] for row in rows] == [list(case) for case in GROUPS[group]]
    for family, budget, returns, peaks, predicted, budget_bytes, recomputed in rows:
        case = (family, budget, returns, peaks, predicted, budget_bytes)
        # a plan that recomputes, whole stages or inside them (options: which, follows the seconds measured)
        assert recomputed > 0 or budget == "90%", case  # (Mixtral's least is 66.5%)
        assert all(abs(peak / predicted - 1) <= 0.01 for peak in peaks), case
        assert all(peak <= budget_bytes for peak in peaks), case
