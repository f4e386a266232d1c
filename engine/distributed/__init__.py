"""Tensor parallelism's plumbing over torch.distributed: ``shard`` (which slice of each weight a
rank holds) and ``comm`` (joining the ranks, and rank 0's messages to the workers). It knows no
model and no runner: the layers that end in a collective are ``models.parallel``, rank 0's
handle on the workers and a worker's loop are ``worker.tp_group`` and ``worker.tp_worker``.
"""
