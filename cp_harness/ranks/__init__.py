"""Ranks: the processes that run cases, and how the test process talks to them.

* ``worker`` -- the launcher that forks the ranks (or torchrun's entry) and one rank's loop.
* ``wire`` -- the pickle-free message format between the test process and the ranks.
* ``devices`` -- which GPUs a pool may use (nccl), checked before any rank starts.
* ``pool`` -- the persistent pool: start once, feed one case per request, restart after a fault.
"""
