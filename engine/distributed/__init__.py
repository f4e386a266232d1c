"""Tensor parallelism over torch.distributed: one engine across several devices or machines.

``shard``: which slice of each weight a rank holds; ``layers``: the layers that end in a
collective; ``comm``: joining the ranks and rank 0's messages; ``worker``: a rank >= 1;
``group``: rank 0's handle on the workers (start, mirror each runner call, stop).
"""
