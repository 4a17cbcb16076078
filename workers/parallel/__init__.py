"""Tensor parallelism (issue 26): a Llama-family model split across ranks of a `torch.distributed`
process group (gloo on CPUs, NCCL on GPUs). `layers` holds the parallel layers and the sharding,
`model` the sharded model (rank 0 drives, the other ranks follow), `launch` starts the ranks."""
