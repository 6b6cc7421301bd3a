"""The recipes' training steps, built from nemo-automodel 0.7.0's own pieces: the drivers ``verify --step training``
runs on the ranks (``cp_harness.checks.training_step``, docs/training_step.md).

- ``train_ft_step``: one step of ``recipes/llm/train_ft.py`` at CP > 1 on ``dp_shard x cp`` (the framework's mesh,
  parallelizer and clip-grad helper; the recipe's label count and loss scaling).
"""
