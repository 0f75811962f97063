"""Which parameters can travel row-sparse, and whether the optimizer allows it.

An embedding table's gradient is non-zero only on the rows a batch looked up. The engines
can move just those rows (ids and values) instead of the whole table when two things hold:
the table is an nn.Embedding or nn.EmbeddingBag weight that no other module uses (a table
tied to an output layer gets a dense gradient), and the optimizer's update of a row with a
zero gradient is no update at all, so that updating only the touched rows is the dense
update exactly: SGD without momentum or weight decay, or Adagrad without weight decay.
"""

from __future__ import annotations

from torch import nn

from ps.layout import ROW_MODULES, Layout, ParamSpec, build_layout, chunk_elems_from_mb


def embedding_tables(model: nn.Module) -> dict[str, nn.Module]:
    """{parameter name: the module that looks rows up in it} for every embedding weight that
    can have a row-sparse gradient: 2-D, trainable, without max_norm (which rewrites the rows
    it reads), and owned by that module alone."""
    owners: dict[int, int] = {}
    for _, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    found = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, ROW_MODULES):
            continue
        w = module.weight
        if w.dim() != 2 or not w.requires_grad or module.max_norm is not None or owners[id(w)] != 1:
            continue
        found[f"{prefix}.weight" if prefix else "weight"] = module
    return found


def sparse_update_problem(optim) -> str | None:
    """Why optim (an OptimConfig) cannot update only the touched rows, or None if it can."""
    if optim.name == "sgd" and not optim.momentum and not optim.weight_decay:
        return None
    if optim.name == "adagrad" and not optim.weight_decay:
        return None
    what = optim.name
    if optim.name == "sgd" and optim.momentum:
        what += f" with momentum={optim.momentum:g}"
    if optim.weight_decay:
        what += f" with weight_decay={optim.weight_decay:g}"
    return (f"optim.name={what} changes rows with a zero gradient, so a row-sparse update would "
            "differ from the dense one; row-sparse needs sgd without momentum or weight decay, "
            "or adagrad without weight decay")


def model_layout(model: nn.Module, cfg, num_shards: int) -> Layout:
    """The parameter-server layout of model's trainable parameters under cfg (a RunConfig):
    chunks of ps.chunk_mb (by the link's rate where it is 0), and the embedding tables cfg
    moves by rows (ps.sparse) cut on row boundaries into keys of ps.chunk_mb (the largest
    key where it is 0, whatever the link: see RunConfig.sparse_key_mb). Shards and workers
    derive the same one from the same model."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    tables = cfg.sparse_tables(model)
    itemsize = named[0][1].element_size()
    return build_layout([ParamSpec.of(n, p) for n, p in named], num_shards,
                        chunk_elems_from_mb(cfg.key_mb(), itemsize),
                        sparse=[i for i, (n, _) in enumerate(named) if n in tables],
                        sparse_chunk_elems=chunk_elems_from_mb(cfg.sparse_key_mb(), itemsize))
