"""Instruments: what the ranks record while a case runs, beside its results.

* ``comm_meter`` -- bytes sent and received through ``torch.distributed``, counted at the dispatcher.
* ``leaks`` -- whether a communication call leaves the rank's CP group (the meter raises ``CommLeak``).
* ``coverage`` -- which documented functions of the implementation a case actually called.
"""
