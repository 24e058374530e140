"""The first step of a fresh process with stage options, and the same options on every profile (issue 29).

A stage run with one of its options (planner/execute/selective.py) is prepared at its first call: its graph
exported by ``torch.export`` (on fake tensors), marked, and, compiled, its dispatch order learnt. That tracing
ran inside the first step, where a memory tracker around the step counted the fake tensors' storages: a plan
applied in a new process (``memsched train SPEC --chain --plan``, ``apply_plan`` in one's own script) measured
2.012 of its predicted peak at step 1 on the mixer here, 1.000 from step 2. The first-step checks run in a fresh
Python process, which has prepared nothing, and measure its *first* step.

Candidate options were ranked by measured seconds, so two profiles of one model proposed different ones and
the least budget moved (1.48 MB on one run, 1.68 MB on the next, for the residual-list model here); ranked by
counted work (profiles/options.py) they are the same on every run.
"""

import json
import subprocess
import sys
import textwrap

import pytest

import cli
from paths import ROOT

MIXER = '''
    import torch
    from torch import nn


    class MixerBlock(nn.Module):
        """Token mixing (an MLP across the tokens) then channel mixing, each with dropout and a residual."""

        def __init__(self, tokens=16, channels=32, hidden=64, p=0.1):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(channels), nn.LayerNorm(channels)
            self.token = nn.Sequential(nn.Linear(tokens, hidden), nn.GELU(), nn.Dropout(p), nn.Linear(hidden, tokens))
            self.channel = nn.Sequential(nn.Linear(channels, hidden), nn.GELU(), nn.Dropout(p),
                                         nn.Linear(hidden, channels))

        def forward(self, x):
            x = x + self.token(self.norm1(x).transpose(1, 2)).transpose(1, 2)
            return x + self.channel(self.norm2(x))


    class Mixer(nn.Module):
        def __init__(self, blocks=2):
            super().__init__()
            self.embed = nn.Linear(32, 32)
            self.blocks = nn.Sequential(*[MixerBlock() for _ in range(blocks)])
            self.head = nn.Linear(32, 10)

        def forward(self, x, labels):
            return nn.functional.cross_entropy(self.head(self.blocks(self.embed(x)).mean(1)), labels)


    def stages(batch=8):
        """The mixer as stages of its own (not discovered: each option's graph is exported at its first call)."""
        torch.manual_seed(0)
        mixer = Mixer()
        return nn.Sequential(mixer.embed, *mixer.blocks).train(), torch.randn(batch, 16, 32)


    def whole(batch=8):
        torch.manual_seed(0)
        return Mixer().train(), (torch.randn(batch, 16, 32), torch.randint(0, 10, (batch,)))
'''

RESIDUALS = '''
    import torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self, d=64):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, d))

        def forward(self, x, residuals):
            out = x + self.mlp(self.norm(x))
            residuals.append(out)
            return out


    class Net(nn.Module):
        """Each block appends its output to a list, a final sum reads them all: discovery cuts it in few stages."""

        def __init__(self, blocks=4, d=64):
            super().__init__()
            self.inp = nn.Linear(d, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
            self.out = nn.Linear(d, 10)

        def forward(self, x, y):
            residuals = []
            h = self.inp(x)
            for block in self.blocks:
                h = block(h, residuals)
            return nn.functional.cross_entropy(self.out(sum(residuals)), y)


    def build(batch=128):
        torch.manual_seed(0)
        return Net().train(), (torch.randn(batch, 64), torch.randint(0, 10, (batch,)))
'''

FIRST_STEP = '''
import sys
import torch
torch.set_num_threads({threads})
from planner.chain import load_chain
from planner.execute.chain import apply_plan
from planner.execute.live_memory import LiveMemoryTracker
from planner.plan import load_plan
from profiles.memory import storage_bytes
from profiles.spec import load_model

model = load_model({spec!r})[0]
planned = apply_plan(model.stages, load_plan({plan!r}), load_chain({chain!r}))
peaks = []
for step in range(2):
    with LiveMemoryTracker() as tracker:
        model.loss_fn(planned(*model.example_inputs)).backward()
    planned.zero_grad(set_to_none=True)
    peaks.append(tracker.peak + storage_bytes(list(model.example_inputs)))
print(peaks)
'''

FIT_FIRST_STEP = '''
import sys
import torch
torch.set_num_threads({threads})
from planner import fit
from planner.execute.live_memory import LiveMemoryTracker
from profiles.memory import storage_bytes
sys.path.insert(0, {folder!r})
from mixer import whole

model, batch = whole()
fitted = fit(model, batch, "50%", warmup=0, repeats=1)
assert fitted.plan.recomputed_forwards > 0
inputs = fitted.discovery.chain_inputs(batch, {{}})
with LiveMemoryTracker() as tracker:
    fitted._current.run(*inputs).backward()
print([tracker.peak + storage_bytes(list(inputs)), fitted.predicted.peak_bytes])
'''


def child(code: str) -> list:
    """What a fresh Python process running ``code`` prints last, as a list."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def mixer_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixer") / "mixer.py"
    path.write_text(textwrap.dedent(MIXER))
    return path


@pytest.fixture(scope="module")
def mixer_plan(mixer_file):
    """The mixer's stages profiled here (so prepared in this process, not in the child) and a hierarchical plan
    at 50% that runs some of them with an option."""
    from planner.plan import load_plan

    chain, plan = mixer_file.parent / "chain.json", mixer_file.parent / "plan.json"
    spec = f"{mixer_file}:stages"
    assert cli.main(["profile", spec, "-o", str(chain), "--warmup", "0", "--repeats", "1", "--options", "2"]) == 0
    assert cli.main(["solve", str(chain), "--budget", "50%", "--solver", "hierarchical", "-o", str(plan)]) == 0
    solved = load_plan(plan)
    assert any(op.option is not None for op in solved.schedule), "the plan runs no stage option"
    return spec, chain, plan, solved.predicted.peak_bytes


@pytest.mark.slow
def test_the_first_step_of_a_plan_with_options_in_a_fresh_process_peaks_at_its_prediction(mixer_plan, threads):
    """Measured 2.012 of predicted at step 1 (both thread counts) before the preparation was hidden, 1.000 at
    step 2."""
    spec, chain, plan, predicted = mixer_plan
    peaks = child(FIRST_STEP.format(threads=threads, spec=spec, plan=str(plan), chain=str(chain)))
    assert [round(peak / predicted, 3) for peak in peaks] == [1.0, 1.0], (threads, peaks, predicted)


@pytest.mark.slow
def test_the_first_step_of_fit_in_a_fresh_process_peaks_at_its_prediction(mixer_file, threads):
    measured, predicted = child(FIT_FIRST_STEP.format(threads=threads, folder=str(mixer_file.parent)))
    assert abs(measured / predicted - 1) <= 0.01, (threads, measured, predicted)


def test_two_profiles_of_a_model_have_the_same_least_budget_and_sizes(tmp_path, capsys):
    """Profiled twice (the exported graphs let go in between), the residual-list model's chains have the same
    sizes and least budget: 1.48 MB and 1.68 MB on two runs of the code before (4.34 MB and 4.14 MB profiled in two
    fresh processes with 6 blocks and a batch of 256)."""
    import dataclasses

    from planner.chain import load_chain
    from planner.execute import selective
    from solvers.minimum import minimum_budget

    path = tmp_path / "residuals.py"
    path.write_text(textwrap.dedent(RESIDUALS))
    found = []
    for k in range(2):
        selective._EXPORTED.clear()
        chain = tmp_path / f"chain{k}.json"
        assert cli.main(["profile", f"{path}:build", "-o", str(chain), "--warmup", "0", "--repeats", "1"]) == 0
        profiled = load_chain(chain)
        sizes = [{key: value for key, value in dataclasses.asdict(stage).items() if key.endswith("bytes")}
                 for stage in profiled.stages]
        found.append((minimum_budget(profiled, options=True), sizes))
    capsys.readouterr()
    assert found[0] == found[1]


def test_the_candidate_options_follow_counts_not_the_clock():
    """Two measurements of one stage's graph give the same nodes, so the same candidates (on the code before,
    each node carried its measured seconds, which ranked the candidates)."""
    import torch

    from planner.execute.selective import forward_nodes
    from profiles.options import candidate_recomputes

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Dropout(0.1), torch.nn.Linear(256, 64))
    x = torch.randn(256, 64, requires_grad=True)
    first, second = forward_nodes(block, (x,)), forward_nodes(block, (x,))
    assert first == second
    assert len(candidate_recomputes(first, 4)) >= 2
