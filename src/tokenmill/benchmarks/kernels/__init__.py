"""The kernel micro-benchmarks, ``tokenmill bench kernels`` (flags and output: ``command``).

* ``command``: the flags and the run: the kernel table, then the sections below;
* ``elementwise`` and ``attention``: the kernel table's cases (and the attention tile sweep), each a
  Triton kernel against the PyTorch code it replaces, at the shapes and sizes of ``shapes``;
* ``cases``: a case checked against its reference, then timed; the table of the rows;
* ``timing``: the ``Timer`` every section times with (``do_bench``, CUDA graph replays, host time);
* ``gemv``, ``sampler``, ``fused_model``, ``decode_sweep``: the further sections (small-batch
  projections, the sampler step, the fused model layers, decode attention over split counts).
"""

from tokenmill.benchmarks.lazy import lazy_command

__all__ = ["add_arguments", "main", "run"]
__getattr__ = lazy_command(__name__)
