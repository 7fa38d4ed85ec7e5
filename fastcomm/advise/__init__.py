"""The advisor: which hook, flat or two-level, for a cluster and a model, from an alpha-beta cost model.

``python -m fastcomm.advise --params 1.3e9 --gpus 64 --gpus-per-node 8 --link 25gbit --intra nvlink
--step-compute 0.8s`` prints, per method, the predicted step time flat and two-level, the speedup over
dense allreduce and the reason. The same as data: :func:`predict` returns :class:`Prediction` rows, and
the pieces (links, collectives, per-hook costs, kernel rates) are importable on their own.

=================  ==============================================================================
module             what it holds
=================  ==============================================================================
``model``          :class:`Link`, the collectives' alpha-beta times, :class:`Topology`, overlap
``methods``        per hook: its compressor and name, exchange, payloads (``wire_bytes``), kernels
``kernels``        kernel throughputs from ``bench_kernels`` results, or measured on this device
``predict``        :func:`predict` and :func:`format_table`
``calibrate``      gloo allreduce timed on this machine, and a :class:`Link` fitted to it
=================  ==============================================================================

Example::

    import fastcomm.advise as advise
    rows = advise.predict(1.3e9, gpus=64, gpus_per_node=8, link="25gbit", intra="nvlink", step_compute=0.8)
    print(advise.format_table(rows))
"""

from fastcomm.advise.kernels import KernelRates, kernel_rates, load_rates, measure_rates
from fastcomm.advise.methods import METHODS, Method, method_cost, method_of
from fastcomm.advise.model import (
    LINK_PRESETS,
    Link,
    Topology,
    all_gather,
    all_to_all,
    exposed_seconds,
    parse_link,
    reduce_scatter,
    ring_allreduce,
    tree_allreduce,
)
from fastcomm.advise.prediction import Prediction, format_table, predict

__all__ = [
    "LINK_PRESETS",
    "METHODS",
    "KernelRates",
    "Link",
    "Method",
    "Prediction",
    "Topology",
    "all_gather",
    "all_to_all",
    "exposed_seconds",
    "format_table",
    "kernel_rates",
    "load_rates",
    "measure_rates",
    "method_cost",
    "method_of",
    "parse_link",
    "predict",
    "reduce_scatter",
    "ring_allreduce",
    "tree_allreduce",
]
