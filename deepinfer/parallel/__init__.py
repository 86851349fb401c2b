"""Many devices, one model: attention data parallelism, MoE expert parallelism and expert load
balancing over one torch.distributed group (see README, "Parallelism")."""
