"""Draft heads on the target's last hidden state: ReDrafter (a recurrent draft head, arXiv
2403.09919) and its Medusa baseline.

- ``model``: the ReDrafter head (inference recurrence + teacher-forced training forward)
- ``medusa``: K independent Medusa-style heads
- ``beam_search``: beam search over a head (L counts g0), and top-W trees for Medusa
- ``compiled``: a head's beam search through torch.compile (``--compile-drafter``)
- ``io`` / ``config``: checkpoint folders (config.json + model.safetensors)
- ``export``: the TensorRT-LLM ReDrafter layout

The drafters that plug these into the engine live in ``specdraft.drafters.redrafter``
and ``specdraft.drafters.medusa``. See docs/redrafter.md for the equations.
"""

from .beam_search import BeamResult, beam_search, independent_beam_search, redrafter_beam_search
from .config import MedusaConfig, ReDrafterConfig
from .export import export_trtllm
from .medusa import MedusaHeads
from .model import ReDrafterHead, future_labels
from .parts import TargetParts

__all__ = ["ReDrafterConfig", "ReDrafterHead", "MedusaConfig", "MedusaHeads", "TargetParts", "BeamResult",
           "beam_search", "redrafter_beam_search", "independent_beam_search", "future_labels", "export_trtllm"]
