"""The torch side's work on a model directory of any family (``[export]`` extra): the table of families (parts.py)
and what reads it: the exporter, the fixture writer and the reference pipeline. Importing a submodule needs torch."""
