"""gbrun.cpu.products.split_products (gbrun/cpu/products.py): under bf16 autocast on the CPU,
nn.Linear's products run in parts whose shapes recur from batch to batch,
with the gradients of one product; anywhere else nn.Linear runs as it is,
and the model looks the same."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import gbrun.cpu.products
from gbrun import planning
from gbrun.cpu.products import MIN_GRAIN, SplitLinear, grain

import node_classification as nc


def split_copy(linear):
    """A copy of `linear` with its products split, as split_products makes
    the Linears of a model."""
    copy = nn.Linear(linear.in_features, linear.out_features,
                     bias=linear.bias is not None)
    copy.load_state_dict(linear.state_dict())
    return gbrun.cpu.products.Linear.sharing(copy)


class ProductShapes(TorchDispatchMode):
    """Records the shapes of every matrix product torch runs."""

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            factors = args[-2:]
            self.shapes.add(tuple(tuple(f.shape) for f in factors))
        return func(*args, **kwargs)


def products_of_a_step(linear, rows):
    """The product shapes of `linear`'s forward and backward under bf16
    autocast, over inputs of each row count in `rows`."""
    with ProductShapes() as recorder:
        for count in rows:
            x = torch.randn(count, linear.in_features, requires_grad=True)
            with torch.autocast("cpu", torch.bfloat16):
                y = linear(x)
            y.float().sum().backward()
    return recorder.shapes


@pytest.mark.parametrize("rows", [1, MIN_GRAIN - 1, MIN_GRAIN, MIN_GRAIN + 1,
                                  3 * MIN_GRAIN + 5])
@pytest.mark.parametrize("bias", [True, False])
def test_the_split_product_has_the_gradients_of_one_product(rows, bias):
    # Float64, so that gradcheck can compare with finite differences; the
    # split is the same for any dtype. The rows cover: tail only, bulk
    # only, bulk and tail.
    x = torch.randn(rows, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, dtype=torch.float64, requires_grad=True) if bias else None
    assert torch.autograd.gradcheck(SplitLinear.apply, (x, weight, b))
    assert torch.allclose(SplitLinear.apply(x, weight, b),
                          F.linear(x, weight, b))


def test_the_grain_is_a_power_of_two_of_1_16_to_1_32_of_the_rows():
    for rows in [2 * 16 * MIN_GRAIN, 87497, 10949, 2**20, 2**20 - 1]:
        step = grain(rows)
        assert step & (step - 1) == 0 and rows / 32 < step <= rows / 16
    assert grain(1) == grain(16 * MIN_GRAIN) == MIN_GRAIN


def test_under_bf16_autocast_a_split_linear_computes_as_nn_linear():
    torch.manual_seed(0)
    linear = nn.Linear(100, 256)
    split = split_copy(linear)
    x = torch.randn(2000, 100)  # 1984 rows and a tail of 16
    outputs = []
    for module in (linear, split):
        inputs = x.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16):
            y = module(inputs)
        y.float().square().sum().backward()
        outputs.append([y, inputs.grad, module.weight.grad, module.bias.grad])
    assert outputs[1][0].dtype == torch.bfloat16
    for ours, theirs in zip(*outputs):
        # bf16's precision: the weight's gradient sums two products.
        assert torch.allclose(ours.float(), theirs.float(), rtol=2e-2,
                              atol=2e-2 * theirs.float().abs().max().item())


def test_under_bf16_autocast_products_recur_across_row_counts():
    linear = nn.Linear(16, 8)
    rows = range(2000, 2400, 10)  # 40 row counts, as 40 sampled batches
    assert len(products_of_a_step(linear, rows)) >= 3 * len(rows)
    # Bulks of 1984, 2048, 2176 and 2304 rows and a tail of one grain (64
    # or 128): forward, input and weight gradients of each.
    assert len(products_of_a_step(split_copy(linear), rows)) <= 3 * 6


def test_outside_bf16_autocast_it_is_nn_linear():
    torch.manual_seed(0)
    linear = nn.Linear(10, 4)
    split = split_copy(linear)
    x = torch.randn(300, 10)
    assert torch.equal(split(x), linear(x))
    with ProductShapes() as recorder:
        split(x)
    assert recorder.shapes == {((300, 10), (10, 4))}


def test_the_model_looks_the_same_with_the_same_parameters():
    model = nc.create_model(32, 10)
    parameters = list(model.parameters())
    before = repr(model), {k: v.clone() for k, v in model.state_dict().items()}
    gbrun.cpu.products.split_products(model)
    assert repr(model) == before[0]
    assert all(p is q for p, q in zip(model.parameters(), parameters))
    state = model.state_dict()
    assert state.keys() == before[1].keys()
    assert all(torch.equal(state[k], v) for k, v in before[1].items())
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is gbrun.cpu.products.Linear for m in linears)


@pytest.mark.parametrize("mode, precision, cpu_bf16, split", [
    ("cpu-cpu", "bf16", True, True),
    ("cpu-cpu", "bf16", False, False),  # bf16 storage, fp32 products
    ("cpu-cpu", "fp32", True, False),  # fp32 products go to MKL
    ("cpu-cuda", "bf16", True, False),  # GPUs build no primitives per shape
])
def test_the_plan_splits_products_where_cpu_ranks_compute_bf16(
        mode, precision, cpu_bf16, split):
    cuda = mode != "cpu-cpu"
    machine = planning.Machine(cuda, cuda, 2 if cuda else 0, 2,
                             cpu_bf16=cpu_bf16)
    args = nc.parse_args(["--mode", mode, "--gpu", "0",
                          "--precision", precision])
    assert planning.plan_run(args, args.gpu, args.num_workers, {}, machine).split_products is split
