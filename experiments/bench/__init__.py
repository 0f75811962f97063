"""Micro-benchmarks of the engines' communication (`psar bench`, `make bench`) and the
torch.distributed.rpc baseline the parameter server is measured against."""
