"""Instruments: what the ranks record while a case runs, beside its results.

* ``comm_meter`` -- bytes sent and received through ``torch.distributed``, counted at the dispatcher.
* ``coverage`` -- which documented functions of the implementation a case actually called.
"""
