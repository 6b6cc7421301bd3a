"""Examples of gating implementations that this project did not write (see ``automodel/``)."""
