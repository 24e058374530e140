"""The selective-checkpoint policies people write by hand are among a stage's options (issue 41): PyTorch's "save
the matmuls" (matrix products and attention kept, the rest recomputed) and torchtitan's "every second matmul"
recomputed as well; measured against torch's own selective checkpointing of the same block, the option keeps no
more bytes and recomputes no matrix product. A long stage's graph is read for its options on fake tensors (issue 40:
planning time), with the real run's nodes."""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from planner.execute.live_memory import LiveMemoryTracker
from planner.execute.selective import forward_nodes, run_with_option
from profiles.options import MATRIX_PRODUCTS, candidate_recomputes


class Mlp(nn.Module):
    """A transformer's MLP half-block: norm, up-projection, GELU, down-projection, residual."""

    def __init__(self, width=32):
        super().__init__()
        self.norm, self.up, self.act, self.down = (nn.LayerNorm(width), nn.Linear(width, 4 * width),
                                                   nn.GELU("tanh"), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))


def _save_matmuls():
    return create_selective_checkpoint_contexts([torch.ops.aten.mm.default, torch.ops.aten.addmm.default])


def test_the_save_matmuls_option_keeps_no_more_than_torch_selective_checkpointing():
    """Among the block's candidates, the one recomputing every saved value but the products' (bytes measured as
    the executor runs it, not its place on the measured Pareto front, which moves with the clock) keeps no more
    than torch's own selective checkpointing, which keeps less than the plain forward."""
    torch.manual_seed(0)
    block, x = Mlp(), torch.randn(8, 64, 32)

    def kept(run) -> int:  # bytes the forward leaves (its output included)
        with LiveMemoryTracker() as tracker:
            output = run(x.clone().requires_grad_())
            left = tracker.current
        del output
        return left

    by_torch = kept(lambda leaf: checkpoint(block, leaf, use_reentrant=False, context_fn=_save_matmuls))
    nodes = forward_nodes(block, (x.clone().requires_grad_(),))
    products = {node.position for node in nodes if node.name.startswith(MATRIX_PRODUCTS)}
    pointwise = {node.position for node in nodes if node.saved and node.recomputable and node.bytes} - products
    assert products and pointwise
    policy = [c for c in candidate_recomputes(nodes, 4) if not set(c) & products and pointwise <= set(c)]
    assert policy, candidate_recomputes(nodes, 4)
    assert kept(block) > by_torch >= kept(lambda leaf: run_with_option(block, policy[0], leaf))


def test_every_second_matrix_product_is_recomputed_by_torchtitan_s_policy():
    """Four products, each but the last saved by the GELU after it: the policy recomputes the second and the
    fourth (the latter saved by nothing: nothing to recompute), keeps the first and the third."""
    torch.manual_seed(0)
    layers = [layer for _ in range(3) for layer in (nn.Linear(16, 16), nn.GELU())] + [nn.Linear(16, 16)]
    chain = nn.Sequential(*layers)
    nodes = forward_nodes(chain, (torch.randn(4, 16, requires_grad=True),))
    products = [node.position for node in nodes if node.name.startswith(MATRIX_PRODUCTS)]
    assert len(products) == 4
    candidates = [set(c) for c in candidate_recomputes(nodes, 4)]
    gelus = {node.position for node in nodes if node.name.startswith("aten.gelu")}
    assert any(c & set(products) == {products[1]} and gelus <= c for c in candidates), candidates
    assert any(not c & set(products) and gelus <= c for c in candidates), candidates  # save the matmuls


def test_a_long_stage_s_graph_is_read_on_fake_tensors_with_the_real_nodes():
    """A discovered stage whose forward takes FAKE_NODES_S or more is read for its options on fake copies of its
    inputs: the nodes (operations, bytes, saved, FLOPs) are those of the real run, and no real value is made."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from planner.rates import Rates
    from profiles.chain_profiler import FAKE_NODES_S, _Runner
    from profiles.discover import discover

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                         max_position_embeddings=32)).train()
    ids = torch.randint(0, 100, (2, 32))
    staged = discover(model, {"input_ids": ids, "labels": ids}).staged
    runner = _Runner(torch.device("cpu"), 0, 1, None, Rates(1e12))
    activation, extra = staged.example_inputs[0], staged.example_inputs[1:]
    for k, (_, stage) in enumerate(staged.stages):
        leaf = activation.detach().requires_grad_(k > 0) if activation.is_floating_point() else activation
        with LiveMemoryTracker() as tracker:
            fake = runner._graph_nodes(stage, (leaf, *extra), FAKE_NODES_S)
        assert tracker.peak == 0  # nothing real allocated
        assert fake == forward_nodes(stage, (leaf, *extra))
        with torch.no_grad():
            activation = stage(activation, *extra)
