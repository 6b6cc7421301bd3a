"""Ranks: the processes that run cases, and how the test process talks to them.

* ``worker`` -- the launcher that forks the ranks (or torchrun's / srun's entry) and one rank's loop.
* ``startup`` -- how one rank comes up (placement, its log, phases, store and process group) and the meshes it builds.
* ``wire`` -- the pickle-free message format between the test process and the ranks.
* ``devices`` -- which GPUs a pool may use (nccl), checked before any rank starts.
* ``pool`` -- the persistent pool (``RankPool``): start once, feed one case per request, restart after a fault.
* ``outputs`` -- plain data (``RankOutput``, ``RankFailure``, ``PoolConfig``) and the pool side of the messages.
* ``lifecycle`` -- the pool's processes: starting the launcher, the rendezvous, shutdown, log and stack dumps.
* ``fork_server`` -- the fork launcher's imports kept between a pool's starts: each start forks a launcher from them.
* ``tickets`` -- the cases in flight: submit, collect in order, send again after a fault, timing.
* ``diagnosis`` -- which rank failed a case and how, a pure function of what the pool observed.
"""
