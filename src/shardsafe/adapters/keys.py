"""The stored key convention of a model and optimizer checkpoint, in one place.

``save_model_and_optim_state``, ``CheckpointManager``, ``shardsafe.lightning`` and
``load_hf_safetensors`` store and find a model's parameters and persistent buffers as
``model.<name>`` (the name without wrapper parts), the optimizer's per-parameter state as
``optim.state.<name>.<state>``, its param groups as one JSON value ``optim.param_groups`` and its
class as ``optim.class``; ``shardsafe.lightning`` keeps the rest of Lightning's checkpoint dict
as one value, ``lightning.meta`` (``shardsafe.dcp.convert`` writes it there too when a Lightning
sharded folder is converted).
"""

from __future__ import annotations

__all__ = ["CLASS_KEY", "GROUPS_KEY", "LIGHTNING_META_KEY", "MODEL_PREFIX", "OPTIM_PREFIX", "STATE_PREFIX"]

MODEL_PREFIX = "model."
"""Parameters and persistent buffers: ``model.<name>``."""
OPTIM_PREFIX = "optim."
"""Everything of the optimizer."""
STATE_PREFIX = OPTIM_PREFIX + "state."
"""Per-parameter optimizer state: ``optim.state.<name>.<state>`` (``exp_avg``, ``step``...)."""
GROUPS_KEY = OPTIM_PREFIX + "param_groups"
"""The param groups (hyper-parameters; parameters listed by name), one JSON value."""
CLASS_KEY = OPTIM_PREFIX + "class"
"""The optimizer's class, ``module.qualname``."""
LIGHTNING_META_KEY = "lightning.meta"
"""The rest of a Lightning checkpoint dict (epoch, loops, callbacks, hyper-parameters)."""
