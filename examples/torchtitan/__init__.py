"""torchtitan 0.3.0 as the real-client gate's second framework (docs/torchtitan.md).

``models``: model specs of torchtitan's own llama3 at a tiny config through its CP entry
(``torchtitan.distributed.context_parallel``: ``apply_cp_to_forward`` on FlexAttention, ``prepare_context_parallel_input``
with its head-tail or PTRR load balancer and document block masks), judged by the harness's ``real_model`` check
against the same model on one device. Importing this package needs nothing; importing a spec needs torchtitan
(``constraints/torchtitan.txt``).
"""
