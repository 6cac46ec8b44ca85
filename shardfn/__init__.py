"""shardfn: JAX-style sharding for PyTorch.

Models are pure functions over parameter trees (`functionalize`), sharding is a tree of partition
specs over a device mesh (`P`, `specs`, `shard`), and `train_step` runs the FSDP algorithm around
an ordinary `loss_fn(params, batch)`.
"""

from . import optim, rules
from ._checkpoint import LoadReport, SaveHandle, latest, load, load_extras, save
from ._describe import describe
from ._donate import DonatedError, copy
from ._engine import StaleParameterError
from ._estimate import MemoryCheckError, MemoryEstimate, estimate_memory
from ._export import export, import_state_dict
from ._launch import launch
from ._grad import grad, value_and_grad
from ._functional import Apply, from_state_dict, functionalize, to_state_dict
from ._param import Param
from ._per_sample import DPValueAndGrad, dp_value_and_grad, per_sample_grad_norms, per_sample_grads
from ._mesh import mesh
from ._named import all_gather, all_to_all, axis_index, axis_size, pmax, pmean, pmin, ppermute, psum, psum_scatter, pvary
from ._meta_init import meta_device
from ._shard import gather, shard
from ._rng import fold_rng
from ._layouts import constrain
from ._shard_map import shard_map
from ._simulate import simulate
from ._spec import P, specs
from ._context import ContextParallelWarning
from ._tp import FallbackWarning
from ._train import MixedPrecision, TrainState, TrainStep, train_step
from ._tree import tree_paths
from ._watch import RankError
from .optim import apply_updates

__version__ = "0.1.0"

__all__ = [
    "Apply",
    "DPValueAndGrad",
    "DonatedError",
    "ContextParallelWarning",
    "FallbackWarning",
    "LoadReport",
    "MemoryCheckError",
    "MemoryEstimate",
    "MixedPrecision",
    "P",
    "Param",
    "RankError",
    "SaveHandle",
    "StaleParameterError",
    "TrainState",
    "TrainStep",
    "all_gather",
    "all_to_all",
    "apply_updates",
    "axis_index",
    "axis_size",
    "copy",
    "describe",
    "dp_value_and_grad",
    "estimate_memory",
    "export",
    "fold_rng",
    "from_state_dict",
    "functionalize",
    "gather",
    "grad",
    "import_state_dict",
    "launch",
    "latest",
    "load",
    "load_extras",
    "mesh",
    "meta_device",
    "optim",
    "per_sample_grad_norms",
    "per_sample_grads",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "psum",
    "psum_scatter",
    "pvary",
    "rules",
    "save",
    "shard",
    "shard_map",
    "simulate",
    "specs",
    "to_state_dict",
    "train_step",
    "tree_paths",
    "value_and_grad",
    "constrain",
]
