"""bf16 matrix products on CPU ranks in parts whose shapes recur
(docs/performance.md).

Under bf16 autocast on the CPU, torch runs each nn.Linear's products in
oneDNN, which builds (JIT-compiles) a primitive for every new shape and
keeps it in a cache for the next product of that shape. A sampled block
has new node counts in every batch, so no shape came back: building took
25 ms of a 0.16 s bf16 step at 200k nodes (2 threads), and the cache only
held memory (gbrun.cpu.memory turns it off).

Here a product over m rows runs as two: the first m rounded down to a
multiple of a grain (a power of two, 1/16 to 1/32 of m), then the rest,
zero-padded to one grain. Both shapes recur from batch to batch, so after
the first few batches oneDNN builds nothing; the padding costs at most
1/16 more rows, and no copy but the last grain's. The results are one
product's up to rounding (the weight's gradient sums two). Elsewhere
(fp32, GPUs, no autocast) nn.Linear runs as it is."""
import torch
import torch.nn as nn

MIN_GRAIN = 64


def split_products(model):
    """Replaces every nn.Linear in `model` (the class itself, not its
    subclasses) with a Linear of this module holding the same parameters,
    in place; returns how many it replaced. The parameters (the same
    objects, so an optimizer made before still steps them), repr and
    state_dict stay the same."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is nn.Linear:
                setattr(module, name, Linear.sharing(child))
                replaced += 1
    return replaced


def grain(rows):
    """The grain for a product over `rows` rows: the largest power of two
    at most rows / 16, and at least MIN_GRAIN."""
    return max(MIN_GRAIN, 1 << max(rows.bit_length() - 5, 0))


class Linear(nn.Linear):
    """nn.Linear whose products under bf16 autocast on the CPU run in
    parts of recurring shapes (SplitLinear); otherwise nn.Linear's."""

    @classmethod
    def sharing(cls, linear):
        """A Linear holding `linear`'s own parameters (no copy), in its
        training mode."""
        split = cls(linear.in_features, linear.out_features,
                    bias=linear.bias is not None, device="meta")
        split.weight, split.bias = linear.weight, linear.bias
        return split.train(linear.training)

    def forward(self, x):
        if not (x.device.type == "cpu" and torch.is_autocast_cpu_enabled()
                and torch.get_autocast_cpu_dtype() == torch.bfloat16
                and x.numel() > 0):
            return super().forward(x)
        # What autocast would do: the product and its inputs in bf16.
        bf16 = torch.bfloat16
        bias = None if self.bias is None else self.bias.to(bf16)
        rows = x.reshape(-1, x.shape[-1]).to(bf16)
        with torch.autocast("cpu", enabled=False):
            y = SplitLinear.apply(rows, self.weight.to(bf16), bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def _product(a, b, bias, out=None):
    """a @ b (+ bias), into `out` if given."""
    if bias is None:
        return torch.mm(a, b, out=out)
    return torch.addmm(bias, a, b, out=out)


def _padded(x, start, size):
    """Rows start: of `x`, zero-padded to `size` rows."""
    part = x.new_zeros(size, x.shape[1])
    part[:x.shape[0] - start] = x[start:]
    return part


def _by_rows(a, b, bias, bulk, a_tail):
    """a @ b (+ bias): the first `bulk` rows of `a` as they are, the rest
    from `a_tail`, their zero-padded copy (None if there is no rest)."""
    out = a.new_empty(a.shape[0], b.shape[1])
    if bulk:
        _product(a[:bulk], b, bias, out=out[:bulk])
    if a_tail is not None:
        out[bulk:] = _product(a_tail, b, bias)[:a.shape[0] - bulk]
    return out


class SplitLinear(torch.autograd.Function):
    """F.linear(x, weight, bias) for 2-D x, as a product over the first
    `bulk` rows of x and one over the rest, padded to one grain."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        rows = x.shape[0]
        step = grain(rows)
        bulk = rows - rows % step
        tail = _padded(x, bulk, step) if bulk < rows else None
        y = _by_rows(x, weight.t(), bias, bulk, tail)
        ctx.save_for_backward(x, weight, tail)
        ctx.bulk, ctx.step = bulk, step
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, tail = ctx.saved_tensors
        bulk, rows = ctx.bulk, x.shape[0]
        grad_tail = _padded(grad_y, bulk, ctx.step) if bulk < rows else None
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _by_rows(grad_y, weight, None, bulk, grad_tail)
        if ctx.needs_input_grad[1]:
            if not bulk:
                grad_weight = torch.mm(grad_tail.t(), tail)
            else:
                grad_weight = torch.mm(grad_y[:bulk].t(), x[:bulk])
                if grad_tail is not None:
                    grad_weight.addmm_(grad_tail.t(), tail)
        if ctx.needs_input_grad[2]:
            grad_bias = grad_y.sum(0)
        return grad_x, grad_weight, grad_bias
