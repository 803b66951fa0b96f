"""The CPU speed pack (docs/performance.md): what a rank sets for speed and
memory, and how CPU ranks run the model. tune_rank applies all of it, in
the order it needs (the examples call it). Elsewhere in gbrun only
gbrun.planning imports the modules below, to decide before spawning:
info.has_bf16 (the CPU computes bf16) and dropout.kernel_problem (whether
--fused-dropout can run here).

    info      what this CPU has (model, flags, bf16 instructions)
    memory    glibc's malloc, oneDNN's primitive cache, the prefetch
              thread's polling: settings of the process
    dropout   nn.Dropout, and ReLU then dropout, in one pass (a C kernel,
              dropout.c, built once per machine)
    products  nn.Linear's bf16 products in shapes that recur
"""


def tune_rank(model, plan):
    """This rank, once its data is loaded, and its `model`, in place, as
    `plan` says: glibc's malloc keeps freed memory, GraphBolt's prefetch
    thread polls less, and the model runs as tune_model makes it. Returns
    `model`."""
    from . import memory

    memory.keep_freed_memory()
    memory.poll_less()
    return tune_model(model, plan)


def tune_model(model, plan):
    """`model`, in place, as CPU ranks run it where `plan` says so
    (plan.fused_dropout, plan.split_products): its nn.Dropout (and ReLU then
    dropout) in one pass, and in bf16 its nn.Linear's products in shapes
    that recur, which oneDNN then keeps (otherwise it keeps no product of a
    past shape). Its parameters, repr and state_dict stay the same. Returns
    `model`."""
    from . import dropout, memory, products

    if plan.fused_dropout:
        dropout.fuse_dropout(model)
    split = plan.split_products and products.split_products(model) > 0
    memory.keep_onednn_primitives(recurring=split)
    return model
