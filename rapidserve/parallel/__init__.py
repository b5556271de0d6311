"""Running one model over several GPUs: tensor-parallel sharding (issue 17)."""
