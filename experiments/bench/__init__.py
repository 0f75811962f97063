"""Micro-benchmarks of the engines' communication (`psar bench`, `make bench`) and the
torch.distributed.rpc baseline the parameter server is measured against."""


def size_label(nbytes: int) -> str:
    """A message size as the tables print it: 1 KiB, 4 MiB, 512 B."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"
